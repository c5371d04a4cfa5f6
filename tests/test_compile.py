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
from visar.accel.sampling import SamplingParams, make_generators


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
