"""Property-based bad input: whatever a caller passes to `Pipeline.generate`, it gets images or one VisarError.

Hypothesis draws a tiny random model of every registered family (every kind: raster, masked,
next-scale, continuous; the Hugging Face ones where transformers / diffusers are installed), a
method name (the model's own, another kind's, or made up), options (the method's names and made-up
ones, with ints, floats, NaN, infinities, huge and negative numbers, strings, None, lists), sampling
settings, conditions (empty, out of range, of the wrong kind or type), negative prompts (one, one
per prompt, a list of the wrong length, empty, anything; on class models too) and images per
condition. Each call must either return num_images_per_prompt images per condition or raise visar's
own `VisarError` with a one-line message: never
another exception type, never an empty result. The quick tier runs 40 examples,
derandomized; the slow tier 1,000. No example database is kept (`database=None`).
"""

import math
import os

import pytest
import torch
from laws import tiny_pipeline

from visar.accel import METHODS
from visar.errors import VisarError
from visar.families import FAMILIES

try:
    import hypothesis  # noqa: F401
except ImportError:  # the dev extra installs it; CI must have it
    if os.environ.get("CI"):
        raise
    pytest.skip("hypothesis is not installed: pip install -e '.[dev]'", allow_module_level=True)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PIPES: dict[str, object] = {}


def pipe_of(family: str):
    """The family's tiny random pipeline, built once per module (a draft: the same family, seed 1)."""
    if family not in PIPES:
        PIPES[family] = tiny_pipeline(family, 0)
    return PIPES[family]


def available_families() -> list[str]:
    usable = []
    for name, family in sorted(FAMILIES.items()):
        needs = []
        if family.architectures or family.pipeline_classes:
            needs.append("transformers")
        if family.pipeline_classes:
            needs.append("diffusers")
        try:
            for module in needs:
                __import__(module)
        except ImportError:
            continue
        usable.append(name)
    return usable


FAMILY_NAMES = available_families()
BAD_NUMBERS = [-1, 0, 1, 2, 3, -(10**9), 10**9, 2**63, 0.5, -0.5, 1e300, -1e300]
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.sampled_from(BAD_NUMBERS),
    FLOATS,
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.text(max_size=6),
    st.sampled_from(["above", "random", "maximal", "cosine", "arccos", "linear", "exact", "naive_extend_57"]),
    st.lists(st.integers(-2, 5), max_size=3),
    st.tuples(FLOATS, FLOATS),
)
# a draft: none, a made-up name, a model of each family (another kind's too), a wrong type
DRAFTS = st.one_of(
    st.none(),
    st.sampled_from(["visar-no-such-draft", "", "/nonexistent/folder"]),
    st.sampled_from(FAMILY_NAMES).map(lambda name: pipe_of(name).model),
    st.sampled_from(FAMILY_NAMES).map(pipe_of),
    VALUES,
)


PARTS = ("method", "option names", "sampling", "condition", "seed", "images per condition")
# a negative prompt: one for all, a list of one, two or three, the empty one, or anything
NEGATIVES = st.one_of(st.sampled_from(["blurry", "", "a red circle", ["blurry"], ["a", "b"], ["a", "b", "c"]]), VALUES)
GOOD_SAMPLING = {
    "guidance_scale": st.sampled_from([1.0, 2.0, 4]),
    "temperature": st.sampled_from([0.5, 1.0, 2]),
    "top_k": st.sampled_from([None, 1, 5, 0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "entropy_temperature": st.sampled_from([None, 0.6, 1.4]),  # beside a temperature other than 1: refused
}


@st.composite
def calls(draw):
    """(pipe, keyword arguments of one `generate` call): a call with up to two of its parts drawn from
    anything (method, option names, sampling settings, condition, seed) and option values drawn from
    the method's defaults, small numbers and anything, so most calls reach the method's own checks."""
    pipe = pipe_of(draw(st.sampled_from(FAMILY_NAMES)))
    bad = draw(st.sets(st.sampled_from(PARTS), max_size=2))
    own = sorted(name for name, method in METHODS.items() if method.model_kind == pipe.model.model_kind)
    method = draw(st.sampled_from(own))
    if "method" in bad:
        method = draw(st.one_of(st.sampled_from(sorted(METHODS)), st.none(), st.text(max_size=8), VALUES))
    kwargs = {"method": method, "output_type": "tokens"}
    decoding_method = METHODS.get(method) if isinstance(method, str) else None
    names = list(decoding_method.options) if decoding_method is not None else []
    draft_option = decoding_method.draft_option if decoding_method is not None else None
    option_names = st.sampled_from(names) if names else st.nothing()
    if "option names" in bad or not names:
        option_names = st.one_of(option_names, st.text(min_size=1, max_size=6))
    for name in draw(st.lists(option_names, max_size=3, unique=True)):
        default = decoding_method.defaults.get(name) if decoding_method is not None else None
        values = DRAFTS if name == draft_option else st.one_of(st.just(default), st.integers(0, 20), VALUES)
        kwargs[name] = draw(values)
    if draft_option and decoding_method.needs_draft and draft_option not in kwargs and draw(st.integers(0, 3)) > 0:
        kwargs[draft_option] = tiny_pipeline_draft(pipe)
    for setting in draw(st.lists(st.sampled_from(sorted(GOOD_SAMPLING)), unique=True, max_size=4)):
        kwargs[setting] = draw(VALUES if "sampling" in bad else GOOD_SAMPLING[setting])
    n = draw(st.integers(1, 3))
    if pipe.is_class_conditional:
        key, value = "class_labels", draw(st.lists(st.integers(0, pipe.num_classes - 1), min_size=n, max_size=n))
    else:
        key, value = (
            "prompts",
            draw(st.lists(st.sampled_from(["a red circle", "two blue squares"]), min_size=n, max_size=n)),
        )
    if "condition" in bad:
        good_class = st.integers(0, max(pipe.num_classes - 1, 0))
        key, value = draw(
            st.one_of(
                st.tuples(st.just("class_labels"), st.lists(st.one_of(good_class, VALUES), max_size=3)),
                st.tuples(st.just("prompts"), st.lists(st.one_of(st.text(max_size=12), VALUES), max_size=3)),
                st.tuples(st.sampled_from(["class_labels", "prompts"]), VALUES),
                st.just(("nothing", None)),
            )
        )
    if key != "nothing":
        kwargs[key] = value
    if draw(st.integers(0, 3)) == 0:  # any family, class-conditional ones included (they refuse it)
        kwargs["negative_prompt"] = draw(NEGATIVES)
    if "images per condition" in bad:
        kwargs["num_images_per_prompt"] = draw(st.one_of(st.integers(-1, 3), VALUES))
    elif draw(st.integers(0, 3)) == 0:
        kwargs["num_images_per_prompt"] = 2
    if "seed" in bad:
        kwargs["seed"] = draw(st.one_of(st.sampled_from([-1, 2**64, 2**64 - 1]), VALUES))
    elif draw(st.booleans()):
        kwargs["seed"] = draw(st.integers(0, 2**40))
    return pipe, kwargs


DRAFT_PIPES: dict[str, object] = {}


def tiny_pipeline_draft(pipe):
    """A second instance of the pipe's family (seed 1): a valid draft for the methods that need one."""
    family = pipe.name.removeprefix("tiny-")
    if family not in DRAFT_PIPES:
        DRAFT_PIPES[family] = tiny_pipeline(family, 1)
    return DRAFT_PIPES[family].model


def expected_count(kwargs) -> int | None:
    """Images a successful call returns: conditions times num_images_per_prompt (None: not known)."""
    copies = kwargs.get("num_images_per_prompt", 1)
    for key in ("class_labels", "prompts"):
        value = kwargs.get(key)
        if isinstance(value, str):
            return copies
        if isinstance(value, (list, tuple)):
            return len(value) * copies
    return None


def one_call(pipe, kwargs):
    try:
        out = pipe.generate(**kwargs)
    except VisarError as err:
        message = str(err)
        assert message.strip() and "\n" not in message, f"a VisarError of more than one line: {message!r}"
        return
    count = expected_count(kwargs)
    tokens = out.tokens
    batch = tokens[0].shape[0] if isinstance(tokens, (list, tuple)) else tokens.shape[0]
    assert batch >= 1, "an empty result instead of an error"
    assert count is None or batch == count, f"{batch} images for {count} conditions"
    if pipe.model.model_kind == "continuous":
        assert bool(torch.isfinite(tokens).all()), "a continuous latent with NaN or infinity in it"
    else:
        maps = tokens if isinstance(tokens, (list, tuple)) else [tokens]
        for t in maps:
            assert t.dtype == torch.long and 0 <= int(t.min()) and int(t.max()) < pipe.model.vocab_size


COMMON = dict(database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(max_examples=40, **COMMON)
@given(calls())
def test_generate_returns_images_or_one_visar_error(call):
    pipe, kwargs = call
    one_call(pipe, kwargs)


@pytest.mark.slow
@settings(max_examples=1000, **COMMON)
@given(calls())
def test_generate_returns_images_or_one_visar_error_many(call):
    pipe, kwargs = call
    one_call(pipe, kwargs)


BUDGET_METHODS = sorted(name for name, method in METHODS.items() if "budget" in method.options)


@pytest.mark.parametrize("method", BUDGET_METHODS)
def test_every_budget_of_every_method_returns_images_or_one_visar_error(method):
    """Every whole-number budget from 1 to past the largest window and tree, and "auto", at each zipar
    lag: zipar-tree at budget=1 once ended in a TypeError (a pass of one slot per front drafts nothing
    for its trees to branch from)."""
    pipe = pipe_of("llamagen")
    lags = [{"s": s} for s in (1, 2, 3)] if method.startswith("zipar") else [{}]
    for budget in [*range(1, 10), 16, 64, "auto"]:  # "auto": the sentence that says it is gone
        for lag in lags:
            one_call(pipe, {"method": method, "class_labels": [1, 2], "output_type": "tokens", "budget": budget, **lag})


def test_one_slot_per_front_is_plain_zipar_for_tree_fronts_too():
    pipe = pipe_of("llamagen")
    plain = pipe.generate(class_labels=[1, 2], method="zipar", s=2, seed=3, output_type="tokens")
    for method in ("zipar-sjd", "zipar-tree"):
        out = pipe.generate(class_labels=[1, 2], method=method, s=2, budget=1, seed=3, output_type="tokens")
        assert torch.equal(out.tokens, plain.tokens), method


@pytest.mark.parametrize("method, least", [("tree-mc-sjd", 7), ("sjd-pac", 13)])
def test_a_number_budget_too_small_for_the_tree_names_the_budget(method, least):
    for budget in (1, least - 1):
        with pytest.raises(VisarError, match=f"budget for {method} is the tree's nodes per pass: .* needs {least}"):
            pipe_of("llamagen").generate(class_labels=[1], method=method, budget=budget, output_type="tokens")
    pipe_of("llamagen").generate(class_labels=[1], method=method, budget=least, output_type="tokens")
