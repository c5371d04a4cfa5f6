"""Emu3 through transformers: a tiny random `Emu3ForConditionalGeneration`, saved with save_pretrained and
loaded offline through `visar.load(FOLDER)`, against transformers' own image generation.

(a) greedy image tokens equal transformers' `generate` with Emu3's prefix constraint (visual tokens,
and the end-of-line token at every row end) and its negative-prompt guidance, at CFG 1 and at CFG 3
(Emu3's default), for a batch of left-padded prompts of different lengths, for every method that is
exact at top-k 1;
(a') the same against transformers run as a user runs it from the folder's saved processor alone (its
tokenizer's padding, its image_sizes, the negative prompt through it): batches of one and of several
prompt lengths, CFG 1, 3 and 7, the processor's rounded grids (4 x 4, 4 x 8, 4 x 5, 9 x 3);
(b) teacher-forced image-token logits equal those of transformers' forward over Emu3's own sequence
(rows with their end-of-line tokens), through visar's cache and without it;
(c) ar, sjd and mc-sjd on the adapter sample the enumerated joint law (image vocabulary 6, 2 x 2
tokens, so every token sits next to a row end) of each prompt, in one batch that mixes two prompts
of different lengths;
bad input: unknown load options, a bad ratio, prompts too long, a draft of another family.
Every raster method on the tiny Emu3: tests/accel/test_method_conformance.py (the family registers tiny args).
"""

import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from laws import prompt_law, random_emu3, sample_each_prompt_s_law, save_emu3_folder, tiny_llamagen  # noqa: E402

import visar  # noqa: E402
from visar.accel import Request, get_method  # noqa: E402
from visar.accel.core.sampling import SamplingParams, make_generators  # noqa: E402
from visar.errors import VisarError  # noqa: E402
from visar.families import hf_emu3  # noqa: E402

PROMPTS = ["a red circle", "the blue dog on a green square"]  # 6 and 10 tokens with the image prefix
OPTIONS = hf_emu3.TINY_OPTIONS  # 16 condition positions, a 4 x 4 grid, a short negative prompt


@pytest.fixture(scope="module")
def emu3_folder(tmp_path_factory, offline):
    return save_emu3_folder(random_emu3(image_vocab=16, seed=0), 16, tmp_path_factory.mktemp("emu3"))


@pytest.fixture(scope="module")
def reference(emu3_folder):
    """transformers' own model and processor, loaded from the same folder."""
    model = transformers.Emu3ForConditionalGeneration.from_pretrained(emu3_folder, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(emu3_folder)


@pytest.fixture(scope="module")
def pipe(emu3_folder):
    return visar.load(emu3_folder, device="cpu", model_args=OPTIONS)


def test_loads_as_emu3_with_its_defaults(pipe, reference):
    assert type(pipe.model).__name__ == "HFEmu3" and pipe.model.model_kind == "raster"
    assert pipe.model.grid_size == (4, 4) and pipe.model.vocab_size == 16 == pipe.tokenizer.vocab_size
    assert pipe.defaults == {"guidance_scale": 3.0, "temperature": 1.0, "top_k": 2048, "top_p": 1.0}
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    assert ids.shape == mask.shape == (2, 16)
    assert mask.sum(1).tolist() == [9, 13] and not mask[:, 0].any()  # left-padded
    tokenizer = reference[1].tokenizer
    # BOS, the prompt, then <|image start|>4*4<|image token|>, as Emu3's processor writes it
    words = tokenizer.convert_ids_to_tokens(ids[0][mask[0]])
    assert words == ["<|extra_203|>", "a", "red", "circle", "<|image start|>", "4", "*", "4", "<|image token|>"]
    negative = tokenizer.convert_ids_to_tokens(pipe.model.null_ids[pipe.model.null_mask])
    assert negative[:2] == ["<|extra_203|>", "lowres"] and negative[-5:] == words[-5:]  # formatted for generation
    out = pipe.generate(prompts=PROMPTS, output_type="np", seed=0)
    assert out.images.shape == (2, 8, 8, 3)  # the tiny VQ upsamples its 4 x 4 latent once


def emu3_constraint(reference, height, width):
    """Emu3's prefix constraint (transformers' Emu3 docs): visual tokens, the end-of-line token closing
    every row of `width`, counted from the prompt's `<|image token|>`; then the end of frame."""
    model, processor = reference
    tokenizer, mapping = processor.tokenizer, model.model.vocabulary_mapping
    visual = mapping.image_tokens

    def allowed(batch_id, input_ids):
        offset = input_ids.shape[0] - torch.nonzero(input_ids == tokenizer.image_wrapper_token_id)[0, 0]
        if offset % (width + 1) == 0:
            return (mapping.eol_token_id,)
        if offset > (width + 1) * height:
            return (tokenizer.eof_token_id,)
        return visual

    return allowed


def emu3_image_tokens(reference, out, prompt_length, height, width):
    """generate's output -> the image tokens [B, H, W] (the visual codes, row ends dropped)."""
    mapping = reference[0].model.vocabulary_mapping
    rows = out[:, prompt_length:].reshape(-1, height, width + 1)
    assert (rows[:, :, -1] == mapping.eol_token_id).all(), "a row without its end-of-line token (right padding?)"
    return mapping.convert_bpe2img(rows).long()


def emu3_generate(reference, ids, mask, negative, guidance_scale, height=4, width=4):
    """transformers' image generation as Emu3's docs run it: the prefix constraint and negative-prompt CFG."""
    guidance = {}
    if guidance_scale != 1:
        negative = negative.expand(ids.shape[0], -1)
        guidance = dict(negative_prompt_ids=negative, negative_prompt_attention_mask=torch.ones_like(negative))
    out = reference[0].generate(
        input_ids=ids,
        attention_mask=mask.long(),
        prefix_allowed_tokens_fn=emu3_constraint(reference, height, width),
        do_sample=False,
        max_new_tokens=height * (width + 1),
        guidance_scale=guidance_scale,
        **guidance,
    )
    return emu3_image_tokens(reference, out, ids.shape[1], height, width)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_greedy_equals_transformers(pipe, reference, emu3_folder, guidance_scale):
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    negative = pipe.model.null_ids[pipe.model.null_mask][None]
    expected = emu3_generate(reference, ids, mask, negative, guidance_scale)
    assert len(set(expected.flatten().tolist())) > 4  # random weights that do not collapse to one token
    greedy = dict(top_k=1, guidance_scale=guidance_scale, output_type="tokens")
    for method in ("ar", "sjd", "mc-sjd"):  # lossless, so exact under greedy sampling
        out = pipe.generate(prompts=PROMPTS, method=method, **greedy)
        assert torch.equal(out.tokens, expected), method
        assert method == "ar" or max(out.stats["forward_passes_per_image"]) < 16  # fewer passes than tokens
    # spec's draft tree is written to scratch slots past the image, each node with its own row end
    draft = visar.load(emu3_folder, device="cpu", model_args=OPTIONS).model  # the same weights: every node accepted
    out = pipe.generate(prompts=PROMPTS, method="spec", draft=draft, **greedy)
    assert torch.equal(out.tokens, expected) and out.stats["tokens_per_forward"] > 2


# -- (a') as a user runs transformers: prompts, grid and negative prompt from the folder's own processor ---

THREE_PROMPTS = ["dog", "a red circle", "the blue dog on a green square of 1 2"]  # 5, 8 and 16 tokens
LONG_NEGATIVE = "lowres , blurry . the red square of a green triangle in 1 2 3"  # longer than two of them


def user_generate(reference, prompts, guidance_scale, size, negative, negative_header=True):
    """transformers' image generation run as its Emu3 docs run it, from the folder's saved processor alone:
    the processor pads the batch with its saved tokenizer's settings (`padding=True`), writes the size into
    the prompt and gives the grid (`image_sizes`). negative: one for all prompts or a list of one per prompt.
    With negative_header, the negative prompt is formatted for image generation, as baaivision/Emu3's
    image_generation.py does (the processor's mode 'G'); without, as transformers' docs format it
    (`processor(text=[negative])`: BOS and the text, no size prefix). -> image tokens [B, H, W], grid (H, W)."""
    model, processor = reference
    inputs = processor(text=prompts, padding=True, return_tensors="pt", return_for_image_generation=True, **size)
    height, width = (int(n) for n in inputs.pop("image_sizes")[0])
    guidance = {}
    if guidance_scale != 1:
        texts = [negative] * len(prompts) if isinstance(negative, str) else negative
        header = dict(return_for_image_generation=True, **size) if negative_header else {}
        neg = processor(text=texts, padding=True, return_tensors="pt", **header)
        guidance = dict(negative_prompt_ids=neg["input_ids"], negative_prompt_attention_mask=neg["attention_mask"])
    out = model.generate(
        **inputs,
        prefix_allowed_tokens_fn=emu3_constraint(reference, height, width),
        do_sample=False,
        max_new_tokens=height * (width + 1),
        guidance_scale=guidance_scale,
        **guidance,
    )
    return emu3_image_tokens(reference, out, inputs["input_ids"].shape[1], height, width), (height, width)


NEGATIVE = OPTIONS["negative_prompt"]
USER_CASES = [  # prompts, guidance scale, size options, negative prompt (None: visar's default, Emu3's own)
    # batches of prompts of different lengths: padding that differs within the batch
    pytest.param(THREE_PROMPTS, 3.0, {"image_area": 32 * 32}, NEGATIVE, id="3-prompts-cfg3-4x4"),
    pytest.param(PROMPTS, 1.0, {"image_area": 32 * 64, "ratio": "2:1"}, NEGATIVE, id="2-prompts-cfg1-4x8"),
    pytest.param(THREE_PROMPTS, 1.0, {"image_area": 32 * 32}, NEGATIVE, id="3-prompts-cfg1-4x4"),
    pytest.param(PROMPTS, 3.0, {"image_area": 32 * 64, "ratio": "2:1"}, LONG_NEGATIVE, id="2-prompts-cfg3-4x8"),
    # the processor's rounding: 1200 pixels at 4:3 -> 4 x 5 tokens; 1728 at 1:3 -> 9 x 3
    pytest.param(THREE_PROMPTS, 3.0, {"image_area": 1200, "ratio": "4:3"}, None, id="3-prompts-cfg3-4x5"),
    pytest.param(THREE_PROMPTS, 7.0, {"image_area": 1728, "ratio": "1:3"}, LONG_NEGATIVE, id="3-prompts-cfg7-9x3"),
    # a batch of one (no padding on transformers' side)
    pytest.param(PROMPTS[1:], 3.0, {"image_area": 1200, "ratio": "4:3"}, LONG_NEGATIVE, id="1-prompt-cfg3-4x5"),
    pytest.param(PROMPTS[:1], 1.0, {"image_area": 32 * 32}, NEGATIVE, id="1-prompt-cfg1-4x4"),
]


@pytest.mark.parametrize("prompts, guidance_scale, size, negative", USER_CASES)
def test_greedy_equals_transformers_from_the_saved_processor(
    emu3_folder, reference, prompts, guidance_scale, size, negative
):
    """visar.load(FOLDER) against transformers' generate on inputs the folder's own processor makes, as a user
    of transformers would (nothing taken from visar's encoder): same grid, same greedy tokens."""
    options = {"max_prompt_tokens": 64, **size, **({} if negative is None else {"negative_prompt": negative})}
    pipe = visar.load(emu3_folder, device="cpu", model_args=options)
    expected, grid = user_generate(reference, prompts, guidance_scale, size, negative or hf_emu3.NEGATIVE_PROMPT)
    assert pipe.model.grid_size == grid
    for method in ("ar", "mc-sjd"):
        out = pipe.generate(
            prompts=prompts, method=method, top_k=1, guidance_scale=guidance_scale, output_type="tokens"
        )
        assert torch.equal(out.tokens, expected), method


PER_CALL_CASES = [  # prompts, negative_prompt of the call, negative_prompt_format (None: the default, "text")
    pytest.param(THREE_PROMPTS, LONG_NEGATIVE, None, id="one-for-all"),
    pytest.param(THREE_PROMPTS, ["lowres", LONG_NEGATIVE, "blurry . dog"], None, id="one-per-prompt"),
    pytest.param(PROMPTS, "", None, id="empty-is-bos"),
    pytest.param(THREE_PROMPTS, ["lowres", LONG_NEGATIVE, "blurry . dog"], "generation", id="with-the-header"),
]


@pytest.mark.parametrize("prompts, negative, negative_format", PER_CALL_CASES)
def test_a_per_call_negative_prompt_equals_transformers(emu3_folder, reference, prompts, negative, negative_format):
    """At Emu3's default CFG (3), negative_prompt= per call gives transformers' greedy generate with the same
    negative_prompt_ids (formatted as its docs do, or with the image header under negative_prompt_format
    'generation'), with no reload: one pipeline serves every negative prompt."""
    size = {"image_area": 32 * 32}
    options = {"max_prompt_tokens": 64, **size}
    if negative_format is not None:
        options["negative_prompt_format"] = negative_format
    pipe = visar.load(emu3_folder, device="cpu", model_args=options)
    header = negative_format == "generation"
    expected, _ = user_generate(reference, prompts, 3.0, size, negative, negative_header=header)
    for method in ("ar", "mc-sjd"):
        out = pipe.generate(prompts=prompts, negative_prompt=negative, method=method, top_k=1, output_type="tokens")
        assert out.stats["batch_size"] == len(prompts) and torch.equal(out.tokens, expected), method
    # negative control: the load-time negative prompt (Emu3's own) gives other tokens
    default = pipe.generate(prompts=prompts, method="ar", top_k=1, output_type="tokens")
    assert not torch.equal(default.tokens, expected)


def test_a_draft_model_is_guided_by_the_same_negative_prompt(pipe, emu3_folder):
    """spec with a draft of the same weights: the call's negative prompt is held on the draft too, so every
    draft is accepted (greedy); a draft left on its own negative prompt passed 30% of them when this was
    checked. The tokens are AR's either way (spec is lossless)."""
    draft = visar.load(emu3_folder, device="cpu", model_args=OPTIONS).model
    kwargs = dict(prompts=PROMPTS, negative_prompt="the red dog", top_k=1, output_type="tokens")
    out = pipe.generate(method="spec", draft=draft, **kwargs)
    assert torch.equal(out.tokens, pipe.generate(method="ar", **kwargs).tokens)
    assert out.stats["acceptance_rate"] == 1.0 and draft.negative is None and pipe.model.negative is None


def test_the_saved_tokenizer_pads_on_the_left(reference):
    """As transformers' convert_emu3_weights_to_hf.py saves Emu3-Gen-hf's tokenizer: a batch padded with the
    folder's own settings is left-padded, which generate needs (its positions and the prefix constraint)."""
    processor = reference[1]
    assert processor.tokenizer.padding_side == "left"
    mask = processor(text=PROMPTS, padding=True, return_for_image_generation=True)["attention_mask"]
    assert mask[0][0] == 0 and mask[0][-1] == 1


def emu3_sequence(reference, ids, tokens):
    """Emu3's own input sequence: the prompt, then each row of visual tokens and its end-of-line token."""
    mapping = reference[0].model.vocabulary_mapping
    rows = mapping.convert_img2bpe(tokens.reshape(-1, 4)).reshape(tokens.shape[0], -1)
    return torch.cat([ids, rows], dim=1).long()


def test_teacher_forced_logits_equal_transformers(pipe, reference):
    model = reference[0]
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    tokens = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    sequence = emu3_sequence(reference, ids, tokens)
    attention = torch.cat([mask.long(), torch.ones(2, 20, dtype=torch.long)], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # as transformers' generate counts them
    with torch.no_grad():
        logits = model(input_ids=sequence, attention_mask=attention, position_ids=positions).logits
    # the output before each visual token: (r, c) sits at T + 5 r + c, so it is predicted at T + 5 r + c - 1
    index = torch.tensor([16 + 5 * r + c - 1 for r in range(4) for c in range(4)])
    theirs = logits[:, index][..., model.model.vocabulary_mapping.image_tokens].float()
    ours = pipe.logits(tokens, prompts=PROMPTS)  # [B, N, V], through visar's cache and 4-D masks
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    uncached = pipe.model(tokens[:, :-1], ids, cond_mask=mask)[:, 15:]  # teacher forcing without a cache
    torch.testing.assert_close(uncached, theirs, atol=2e-5, rtol=1e-5)
    # negative control: a model that ignored the row ends would predict row starts from the row's last token
    assert (ours[:, 4] - theirs[:, 3]).abs().max() > 1e-3


# -- (c) the enumerated law --------------------------------------------------------------------------

VOCAB, SAMPLES = 6, 12_000
LAW_OPTIONS = {**OPTIONS, "image_area": (2 * 8) ** 2}  # a 2 x 2 grid
LAW_CASES = [
    ("ar", {}, SamplingParams(guidance_scale=2.0)),
    ("sjd", {"window": 4}, SamplingParams(guidance_scale=2.0, top_k=4)),
    ("mc-sjd", {"window": 4, "coupling": "gumbel"}, SamplingParams(guidance_scale=2.0, top_p=0.9)),
]


@pytest.fixture(scope="module")
def law_pipe(tmp_path_factory, offline):
    folder = save_emu3_folder(random_emu3(image_vocab=VOCAB, seed=1), VOCAB, tmp_path_factory.mktemp("law"))
    return visar.load(folder, device="cpu", model_args=LAW_OPTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("method, options, params", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_joint_law_with_left_padded_prompts(law_pipe, method, options, params):
    model = law_pipe.model
    ids, mask = law_pipe.text_encoder.encode(PROMPTS)
    sample_each_prompt_s_law(model, ids, mask, method, options, params, VOCAB, SAMPLES)
    # negative controls: the prompt reaches the image tokens, and so does the row end (a model that
    # predicted row 1 from row 0's last token instead of its end-of-line token has another law)
    laws = [prompt_law(model, ids[p], mask[p], params) for p in (0, 1)]
    assert 0.5 * np.abs(laws[0] - laws[1]).sum() > 0.05
    without_row_ends = RowEndsIgnored(model)
    assert 0.5 * np.abs(laws[0] - prompt_law(without_row_ends, ids[0], mask[0], params)).sum() > 0.05


class RowEndsIgnored:
    """The tiny Emu3 with its row ends dropped: a W + 1 wide grid, one image row, no row ends fed."""

    def __init__(self, model):
        self.model = model
        self.num_condition_tokens, self.num_image_tokens, self.vocab_size = (
            model.num_condition_tokens,
            model.num_image_tokens,
            model.vocab_size,
        )
        self.null_condition, self.null_condition_mask = model.null_condition, model.null_condition_mask

    def __call__(self, tokens, cond, cond_mask):
        grid = self.model._grid_size
        self.model._grid_size = (1, self.num_image_tokens + 1)
        try:
            return self.model(tokens, cond, cond_mask=cond_mask)
        finally:
            self.model._grid_size = grid


def test_the_grid_is_the_one_the_folders_processor_writes(emu3_folder, reference, tmp_path):
    """Without size options: the processor's own image-generation size (here transformers' default, 518400
    pixels at 1:1); a config that saves an image_area (as the original Emu3 configs do) sets it."""
    _, processor = reference
    written = processor(text=["a"], return_for_image_generation=True)["image_sizes"][0]
    options = {"max_prompt_tokens": 16, "negative_prompt": "lowres"}
    pipe = visar.load(emu3_folder, device="cpu", model_args=options)
    assert pipe.model.grid_size == tuple(written) == (90, 90)
    ids, mask = pipe.text_encoder.encode(["a"])  # the prompt states the same size as the processor's own call
    own = processor(text=["a"], return_for_image_generation=True)["input_ids"][0]
    assert ids[0][mask[0]].tolist() == list(own)
    saved = tmp_path / "saved"
    shutil.copytree(emu3_folder, saved)
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "image_area": 16 * 16 * 2 * 2}))
    assert visar.load(str(saved), device="cpu", model_args=options).model.grid_size == (4, 4)


# -- bad input -------------------------------------------------------------------------------------


def test_load_options_are_checked(emu3_folder, reference):
    with pytest.raises(VisarError, match=r"unknown model_args \['guidance'\] for an Emu3 folder"):
        visar.load(emu3_folder, device="cpu", model_args={**OPTIONS, "guidance": 3})
    with pytest.raises(VisarError, match="negative_prompt_format 'repo': expected 'text'"):
        visar.load(emu3_folder, device="cpu", model_args={**OPTIONS, "negative_prompt_format": "repo"})
    with pytest.raises(VisarError, match="ratio 'square'"):
        visar.load(emu3_folder, device="cpu", model_args={**OPTIONS, "ratio": "square"})
    wide = visar.load(emu3_folder, device="cpu", model_args={**OPTIONS, "image_area": 32 * 64, "ratio": "2:1"})
    assert wide.model.grid_size == (4, 8)  # Emu3's processor: sqrt(area / 2) x (1, 2) pixels, 8 per token
    ids, mask = wide.text_encoder.encode(PROMPTS)
    negative = wide.model.null_ids[wide.model.null_mask][None]
    expected = emu3_generate(reference, ids, mask, negative, 3.0, height=4, width=8)
    for method in ("ar", "mc-sjd"):
        out = wide.generate(prompts=PROMPTS, method=method, top_k=1, output_type="tokens")
        assert torch.equal(out.tokens, expected), method


def test_prompt_too_long_and_foreign_draft(pipe):
    with pytest.raises(VisarError, match="more than this model's 16 condition positions"):
        pipe.generate(prompts=["a red circle on the green square of the blue dog in a"], output_type="tokens")
    long_negative = "the red circle on the green square of the blue dog in a red triangle of a dog"
    with pytest.raises(VisarError, match="a negative prompt takes 19 tokens .* more than this model's 16"):
        pipe.generate(prompts=PROMPTS, negative_prompt=long_negative, output_type="tokens")
    with pytest.raises(VisarError, match="condition"):
        pipe.generate(prompts=PROMPTS[:1], method="spec", draft=tiny_llamagen(vocab=16, block_size=16), top_k=1)


def test_cli_generates_from_the_folder(emu3_folder, tmp_path):
    from visar.apps.cli import main

    out = tmp_path / "out"
    args = ["generate", "--model", emu3_folder, "--prompt", PROMPTS[0], "--method", "mc-sjd", "--device", "cpu"]
    options = ["--model-arg", f"image_area={OPTIONS['image_area']}", "--model-arg", "max_prompt_tokens=16"]
    options += ["--model-arg", f"negative_prompt={OPTIONS['negative_prompt']}"]
    assert main([*args, *options, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["00000.png", "images.jsonl", "settings.json", "stats.json"]
    report = tmp_path / "bench.json"
    bench = ["bench", "--model", emu3_folder, "--methods", "mc-sjd", "--n", "2", "--device", "cpu"]
    assert main([*bench, *options, "--json", str(report)]) == 0
    rows = {row["method"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows["ar"]["forward_passes"] == 16 and rows["mc-sjd"]["forward_passes"] < 16


def test_prompt_ids_without_a_mask_still_pad_the_negative_prompt(pipe):
    """Condition ids given without a validity mask (all positions valid) decode as with an all-True mask:
    the negative prompt keeps its own padding either way."""
    ids, _ = pipe.text_encoder.encode(PROMPTS[1:])
    params, run = SamplingParams(guidance_scale=3.0, top_k=1), get_method("ar").fn
    everything_valid = torch.ones_like(ids, dtype=torch.bool)
    with_mask, _ = run(Request(pipe.model, ids, params, make_generators(1, 0), cond_mask=everything_valid))
    without, _ = run(Request(pipe.model, ids, params, make_generators(1, 0)))
    assert torch.equal(with_mask, without)
