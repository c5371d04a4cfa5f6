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
