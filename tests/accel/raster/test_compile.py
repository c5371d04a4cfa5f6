"""The model call of AR and of the Jacobi window compiles as one graph: no graph breaks, and the
inputs it writes are module buffers, so that torch.compile(mode="reduce-overhead") can replay it as
one CUDA graph per shape on a GPU.

Every distinct kind of call a real decode makes (the prefill over the condition, AR's one-token
step with shared positions, the window pass with per-image positions, under CFG with the KV cache
of the decode) is traced by `torch._dynamo.explain`, on the CPU, in the middle of the decode.
"""

import pytest
import torch
import torch._dynamo as dynamo
from laws import tiny_llamagen

from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, make_generators


def explained_calls(model, method: str, **options) -> dict:
    """Decode with `method`, explaining the first call of every distinct signature -> {signature: explain output}."""
    eager = model.forward
    reports = {}

    def forward(tokens=None, cond=None, **kwargs):
        key = (
            None if tokens is None else tuple(tokens.shape),
            cond is not None,
            tuple(kwargs["input_pos"].shape),
            kwargs.get("mask") is not None,
        )
        if key not in reports:  # the traced run writes the same cache slots the real call then writes again
            reports[key] = dynamo.explain(eager)(tokens, cond, **kwargs)
        return eager(tokens, cond, **kwargs)

    model.forward = forward
    try:
        params = SamplingParams(guidance_scale=2.0, top_k=8)
        get_method(method).fn(Request(model, torch.tensor([0, 2]), params, make_generators(2, 0)), **options)
    finally:
        del model.forward
    dynamo.reset()
    return reports


@pytest.mark.parametrize("method, options", [("ar", {}), ("mc-sjd", {"window": 4})])
def test_the_model_call_has_no_graph_breaks(method, options):
    model = tiny_llamagen(vocab=16, block_size=16, std=0.3)  # a 4 x 4 grid
    reports = explained_calls(model, method, **options)
    with_condition = [key for key in reports if key[1]]
    assert len(with_condition) >= 1  # the prefill
    if method == "ar":
        assert ((4, 1), False, (1,), False) in reports  # the one-token step ([cond ; uncond]), positions shared
    else:
        assert any(key[0] is not None and key[0][1] > 1 and len(key[2]) == 2 for key in reports)  # a window pass
    for key, report in reports.items():
        assert report.graph_break_count == 0 and report.graph_count == 1, (key, report.break_reasons)
        assert mutated_inputs(report.graphs[0]) and all(
            "_buffers_" in name for name in mutated_inputs(report.graphs[0])
        )


def mutated_inputs(graph) -> list[str]:
    """The graph inputs an in-place operation writes (the KV cache, the written-slot flags). All must be
    module buffers: CUDA graphs (reduce-overhead) replay a mutation only of an input at a static address,
    and a tensor kept as a plain attribute would be a new input to every call."""
    names = []
    for node in graph.graph.nodes:
        in_place = node.op == "call_method" and str(node.target).endswith("_")
        in_place |= node.op == "call_function" and getattr(node.target, "__name__", "") == "setitem"
        if in_place and getattr(node.args[0], "op", None) == "placeholder":
            names.append(node.args[0].name)
    return names


def pass_graphs(engine, passes_before: int = 3):
    """Trace one whole pass of a pass-loop engine after a few real ones (propose, score, verify,
    commit: what runs between two plans, the model call and the bookkeeping) -> dynamo's explanation."""
    from visar.accel.raster.pass_loop import run_pass

    with torch.no_grad(), engine:
        for _ in range(passes_before):
            run_pass(engine, engine.plan())
        return dynamo.explain(run_pass)(engine, engine.plan())


@pytest.mark.parametrize(
    "engine",
    ["sjd", "mc-sjd random init", "mc-sjd gumbel", "gsd", "tree-mc-sjd", "sjd-pac"],
)
def test_a_whole_pass_traces_as_one_graph(engine):
    # Only the plan (a pass's shape: the slots of its longest window, whether any image is left)
    # reads the device back; the rest of a pass is one graph, so a compiled pass could replay as
    # one CUDA graph per shape.
    from functools import partial

    from visar.accel.core import acceptance
    from visar.accel.raster import drafts, proposers
    from visar.accel.raster.chain import ChainPasses
    from visar.accel.raster.tree_passes import DraftTreePasses, check_tree, parse_neighbours

    model = tiny_llamagen(vocab=32, block_size=64, seed=3, std=0.3)  # an 8 x 8 grid
    request = Request(model, torch.tensor([0, 2]), SamplingParams(guidance_scale=2.0, top_k=8), make_generators(2, 0))
    init = drafts.resolve_initialiser("random" if "random" in engine else "above")
    coupling = proposers.carry_updater("gumbel" if "gumbel" in engine else "maximal", engine)
    if engine.startswith(("sjd", "mc-sjd", "gsd")) and engine != "sjd-pac":
        updater = proposers.Carry(proposers.independent_carry) if engine in ("sjd", "gsd") else coupling
        grouped = partial(
            acceptance.grouped_accept, codebook=torch.randn(32, 4), group_size=4, prob_gap=0.1, max_distance=2.0
        )
        rule = acceptance.AcceptanceRule(grouped, acceptance.speculative_residual)
        rule = rule if engine == "gsd" else acceptance.SPECULATIVE
        passes = ChainPasses(request, proposers.JacobiProposer(init, updater), 6, 0, 0, rule)
    else:
        layout = check_tree(model, 16, 3, 2 if engine == "tree-mc-sjd" else 3)
        names = parse_neighbours("left,above" if engine == "tree-mc-sjd" else "")
        passes = DraftTreePasses(request, layout, init, names)
    explained = pass_graphs(passes)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize(
    "method, options",
    [
        ("spec", {"window": 4}),  # the chain engine with a draft model, which catches up before it drafts
        ("lantern++", {"tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]], "lambda_cap": 1.0}),  # the static tree engine
        ("zipar", {"s": 2}),
        ("zipar-mc-sjd", {"s": 2, "window": 4}),
        ("zipar-mc-sjd", {"s": 8, "window": 4, "coupling": "gumbel", "init": "above"}),  # s >= W: cross-row off
        ("zipar-tree", {"s": 2, "window": 4, "branch": 3}),
        ("wavefront", {}),
    ],
)
def test_a_method_s_whole_pass_traces_as_one_graph(method, options, monkeypatch):
    """The front and static-tree engines, and a draft model's chain, as the chain and tree engines:
    their plan reads back what a pass's shape needs (the fronts: the pass's width, the carried laws'
    K and the trees' tokens to feed again; lantern++: whether an image is left and the committed
    tokens not fed yet; spec: the positions its draft catches up on), all at once; the pass itself
    has no host sync, so a compiled pass replays as one graph per shape (the decode is the method's
    own, its engine traced after a few passes)."""
    from visar.accel.raster import chain, static_tree
    from visar.accel.raster.zipar import engine as front_engine

    model = tiny_llamagen(vocab=32, block_size=64, seed=3, std=0.3)  # an 8 x 8 grid
    if method == "wavefront":
        model.dependency_reach = 2  # declares local dependence: the exact wavefront runs
    if method in ("spec", "lantern++"):
        options = {**options, "draft": tiny_llamagen(vocab=32, block_size=64, seed=4, std=0.3)}
    traced = []

    def trace_a_pass(engine, *loop_options):
        traced.append(pass_graphs(engine))
        return engine.finish()  # the decode's tokens so far, as the method expects a result

    monkeypatch.setattr(front_engine, "decode_passes", trace_a_pass)
    monkeypatch.setattr(static_tree, "decode_passes", trace_a_pass)
    monkeypatch.setattr(chain, "decode_passes", trace_a_pass)
    params, codebook = SamplingParams(guidance_scale=2.0, top_k=8), torch.randn(32, 4)  # lantern++ reads a codebook
    request = Request(model, torch.tensor([0, 2]), params, make_generators(2, 0), tokenizer=codebook)
    get_method(method).fn(request, **options)
    (explained,) = traced
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


# the chain, tree and front engines (zipar-mc-sjd's compiled passes padded to a few widths)
COMPILED_METHODS = ("mc-sjd", "sjd-pac", "zipar-mc-sjd")


@pytest.mark.slow  # dynamo traces every shape of pass (backend "eager": no code generated)
def test_whole_passes_under_compile_give_the_eager_tokens():
    import visar
    from visar.accel.raster import pass_loop

    pipe = visar.load("visar-tiny-random", device="cpu")
    eager = {m: pipe.generate(class_labels=[3, 5], seed=1, method=m, output_type="tokens") for m in COMPILED_METHODS}
    running = {  # a running batch: refill passes call the model on the new and the other slots apart
        m: pipe.generate(class_labels=[3, 5, 7, 1], seed=1, method=m, output_type="tokens", batch_size=2)
        for m in COMPILED_METHODS
    }
    pipe.compile(backend="eager", whole_passes=True)
    for method, reference in eager.items():
        out = pipe.generate(class_labels=[3, 5], seed=1, method=method, output_type="tokens")
        assert torch.equal(out.tokens, reference.tokens), method
        assert out.stats["forward_passes"] == reference.stats["forward_passes"]
        out = pipe.generate(class_labels=[3, 5, 7, 1], seed=1, method=method, output_type="tokens", batch_size=2)
        assert torch.equal(out.tokens, running[method].tokens), method
    assert any(callable(step) for step in pass_loop.COMPILED_PASSES.values())  # the passes ran compiled


@pytest.mark.slow
def test_whole_passes_fall_back_to_eager_where_compiling_fails():
    import visar

    def no_compiler(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler on this platform")

    pipe = visar.load("visar-tiny-random", device="cpu")
    eager = pipe.generate(class_labels=[3], seed=2, method="mc-sjd", output_type="tokens").tokens
    pipe.compile(backend=no_compiler, whole_passes=True)
    with pytest.warns(RuntimeWarning, match="torch.compile failed on this platform.*no C.. compiler"):
        out = pipe.generate(class_labels=[3], seed=2, method="mc-sjd", output_type="tokens")
    assert torch.equal(out.tokens, eager)


@pytest.mark.slow  # dynamo traces every shape of pass of two engines with a draft model (backend "eager")
def test_draft_model_passes_under_compile_give_the_eager_tokens():
    """spec (the chain engine, its draft's catch-up width read by the plan) and lantern++ (the static
    tree engine) under compiled whole passes: the eager tokens, in a batch and in a running batch."""
    import visar

    pipe = visar.load("visar-tiny-c2i", device="cpu")
    calls = [dict(class_labels=[3, 5]), dict(class_labels=[3, 5, 7, 1], batch_size=2)]
    options = dict(seed=1, output_type="tokens", draft="visar-tiny-c2i-draft")
    eager = {
        (m, i): pipe.generate(method=m, **call, **options)
        for m in ("spec", "lantern++")
        for i, call in enumerate(calls)
    }
    pipe.compile(backend="eager", whole_passes=True)
    for (method, i), reference in eager.items():
        out = pipe.generate(method=method, **calls[i], **options)
        assert torch.equal(out.tokens, reference.tokens), (method, i)
