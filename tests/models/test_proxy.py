"""The proxies (visar/models/proxy.py): visar-tiny-c2i's law, bit for bit, at a full-size LlamaGen's cost in
every pass, where a profile or a compiler can see it."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import visar
from visar.accel import METHODS, methods_for
from visar.checkpoints import seeded_init
from visar.errors import VisarError
from visar.families.proxy import OFFICIAL_VOCAB, cost_config
from visar.models.llamagen import GPT_SIZES, LlamaGen
from visar.models.proxy import LawCostProxy
from visar.registry import proxy_models

SMALL_COST = dict(dim=64, n_layer=2, n_head=2, multiple_of=32)  # the official head, a small trunk: fast tests
DRAFT = "visar-tiny-c2i-draft"


@pytest.fixture(scope="module")
def tiny():
    return visar.load("visar-tiny-c2i", device="cpu")


def small_proxy(tiny, cost_seed=0) -> visar.Pipeline:
    law = copy.deepcopy(tiny.model)
    cost = LlamaGen(cost_config(law.config, SMALL_COST))
    seeded_init(cost, cost_seed)
    return visar.Pipeline(LawCostProxy(law, cost), tiny.tokenizer, name="proxy", defaults=tiny.defaults)


@pytest.fixture(scope="module")
def proxy(tiny):
    return small_proxy(tiny)


def same_decode(proxy, tiny, method_name):
    method = METHODS[method_name]
    options = {method.draft_option: DRAFT} if method.needs_draft else {}
    run = dict(class_labels=[3, 7], method=method_name, seed=11, output_type="tokens", batch_size=2, **options)
    ours, theirs = proxy.generate(**run), tiny.generate(**run)
    assert torch.equal(ours.tokens, theirs.tokens), method_name
    assert ours.stats["forward_passes_per_image"] == theirs.stats["forward_passes_per_image"], method_name


@pytest.mark.one_thread
@pytest.mark.parametrize("method_name", ["mc-sjd", "tree-mc-sjd"])
def test_a_proxy_decodes_the_tokens_of_its_law(proxy, tiny, method_name):
    same_decode(proxy, tiny, method_name)


@pytest.mark.slow
@pytest.mark.one_thread
def test_a_proxy_decodes_the_tokens_of_its_law_under_every_raster_method(proxy, tiny):
    names = methods_for(proxy.model)
    assert names == methods_for(tiny.model) and len(names) > 15
    for method_name in names:
        same_decode(proxy, tiny, method_name)


class MatmulWidths(TorchDispatchMode):
    """The output width of every matrix product dispatched (linear layers included)."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.PRODUCTS:
            self.widths.append(out.shape[-1])
        return out


def test_every_pass_runs_the_cost_models_head_beside_the_laws(proxy):
    heads = {"law": proxy.model.law.output, "cost": proxy.model.cost.output}
    calls = {name: 0 for name in heads}
    hooks = [
        head.register_forward_hook(lambda *_, name=name: calls.update({name: calls[name] + 1}))
        for name, head in heads.items()
    ]
    try:
        out = proxy.generate(class_labels=[3], method="mc-sjd", seed=0, output_type="tokens")
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["law"] >= out.stats["forward_passes"] > 0 and calls["cost"] == calls["law"]
    with MatmulWidths() as products:  # and each call dispatches the official-size head's matrix product
        proxy.model(torch.tensor([[1, 2, 3]]), torch.tensor([4]))
    assert products.widths.count(OFFICIAL_VOCAB) == products.widths.count(proxy.model.law.vocab_size) == 1


def test_the_cost_models_output_reaches_the_logits(proxy):
    """A NaN in the cost model's head makes every output NaN (the negative control of bit equality: the
    cost model is not dead code); finite, the output is the law's bit for bit."""
    model = copy.deepcopy(proxy.model)
    tokens, cond = torch.tensor([[1, 2, 3]]), torch.tensor([4])
    assert torch.equal(model(tokens, cond), model.law(tokens, cond))
    with torch.no_grad():
        model.cost.output.weight[5, 0] = float("nan")
    assert bool(model(tokens, cond).isnan().all())
    assert not bool(model.law(tokens, cond).isnan().any())


def test_a_compiled_proxy_keeps_the_cost_model(proxy):
    """The graph torch.compile hands its backend (after dynamo's and AOTAutograd's dead-code elimination)
    still holds the cost model's official-size head, and gives the law's logits up to rounding."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    model = copy.deepcopy(proxy.model)
    tokens, cond = torch.tensor([[1, 2, 3]]), torch.tensor([4])
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=aot_autograd(fw_compiler=keep))(tokens, cond)
    torch._dynamo.reset()
    # compiled kernels round as they choose (bits: the eager test above); the value is the law's
    torch.testing.assert_close(logits, model.law(tokens, cond), rtol=1e-5, atol=1e-5)
    widths = [
        node.meta["val"].shape[-1]
        for graph in graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target in MatmulWidths.PRODUCTS
    ]
    assert OFFICIAL_VOCAB in widths and model.law.vocab_size in widths


def test_the_registered_proxies_run_official_sizes_on_the_embedded_law(tiny):
    assert proxy_models() == ["visar-proxy-gpt-b", "visar-proxy-gpt-l", "visar-proxy-gpt-xl"]
    pipe = visar.load("visar-proxy-gpt-b", device="cpu")
    law, cost = pipe.model.law, pipe.model.cost
    assert GPT_SIZES["GPT-B"] == {"dim": cost.config.dim, "n_layer": cost.config.n_layer, "n_head": cost.config.n_head}
    assert cost.vocab_size == OFFICIAL_VOCAB and cost.config.num_classes == 1000
    assert 110e6 < cost.num_parameters() < 113e6  # LlamaGen's GPT-B: 111 M
    trained, ours = tiny.model.state_dict(), law.state_dict()
    assert ours.keys() == trained.keys() and all(torch.equal(ours[key], trained[key]) for key in trained)
    assert pipe.defaults == tiny.defaults and pipe.class_names == tiny.class_names
    assert pipe.model.vocab_size == 512 and pipe.model.grid_size == (16, 16)
    seeded = visar.load("visar-proxy-gpt-b", device="cpu").model.cost  # the cost model is seeded: the same each load
    assert torch.equal(seeded.output.weight, cost.output.weight)


def test_a_proxy_config_names_its_law_and_cost(tmp_path):
    folder = tmp_path / "proxy"
    folder.mkdir()
    (folder / "config.json").write_text('{"family": "proxy", "law": "visar-tiny-c2i", "cost": "GPT-Q"}')
    with pytest.raises(VisarError, match="init.random_seed"):
        visar.load(str(folder), device="cpu")
    (folder / "config.json").write_text(
        '{"family": "proxy", "law": "visar-tiny-c2i", "cost": "GPT-Q", "init": {"random_seed": 0}}'
    )
    with pytest.raises(VisarError, match="no LlamaGen size"):
        visar.load(str(folder), device="cpu")
    (folder / "config.json").write_text(
        '{"family": "proxy", "law": "visar-tiny-random", "cost": "GPT-B", "init": {"random_seed": 0}}'
    )
    with pytest.raises(VisarError, match="trained LlamaGen folder"):
        visar.load(str(folder), device="cpu")


@pytest.mark.slow  # a GPT-B-size forward in every pass: about 10 s on one CPU thread
@pytest.mark.one_thread
def test_the_gpt_b_proxy_decodes_visar_tiny_c2i_s_tokens(tiny):
    pipe = visar.load("visar-proxy-gpt-b", device="cpu")
    run = dict(class_labels=[5], method="mc-sjd", seed=3, output_type="tokens")
    ours, theirs = pipe.generate(**run), tiny.generate(**run)
    assert torch.equal(ours.tokens, theirs.tokens)
    assert ours.stats["forward_passes"] == theirs.stats["forward_passes"] < 128
