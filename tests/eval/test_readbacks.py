"""Host read-backs: the counter sees each kind, and the raster engines read the device back a small,
fixed number of times per forward pass (on a GPU each read-back stalls the launch queue)."""

import pytest
import torch
from conftest import TEST_DEVICE, load_tool
from laws import tiny_llamagen

import visar
from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.eval.readbacks import ReadBackCounter, count_read_backs


def test_the_counter_sees_every_kind_of_read_back():
    x = torch.arange(6)
    reads = [
        ("item", lambda: x[0].item()),
        ("item", lambda: int(x.max())),
        ("item", lambda: bool(x.any())),
        ("item", lambda: float(x.sum())),
        ("tolist", lambda: x.tolist()),
        ("nonzero", lambda: x.nonzero()),
        ("nonzero", lambda: torch.where(x > 2)),
        ("bool index", lambda: x[x > 2]),
        ("bool index", lambda: x.clone().__setitem__(x > 2, 0)),
        ("masked_select", lambda: x.masked_select(x > 1)),
        ("unique", lambda: x.unique()),
        ("equal", lambda: torch.equal(x, x)),
        ("repeat_interleave", lambda: x.repeat_interleave(x)),
    ]
    for kind, read in reads:
        _, counter = count_read_backs(read)
        assert dict(counter.by_kind) == {kind: 1}, (kind, dict(counter.by_kind))
    # what stays on the device: arithmetic, where with three arguments, gather / scatter, index by ids
    with ReadBackCounter() as counter:
        y = torch.where(x > 2, x, 0).cumsum(0).gather(0, torch.tensor([1, 2]))
        x.clone().scatter_(0, torch.tensor([0]), 5)
        _ = x[torch.tensor([0, 3])] + y.sum()
    assert counter.total == 0
    assert torch.Tensor.tolist(x) == list(range(6))  # the wrapper is gone after the block


def test_the_counter_counts_every_dispatched_op():
    x = torch.arange(6.0)
    with ReadBackCounter() as counter:
        y = (x + 1).softmax(0)  # add, softmax
        y[:3].sum()  # a view (slice) is an op too, then sum
    assert counter.ops == 4 and counter.total == 0


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(vocab=32, block_size=64, seed=3, std=0.3).to(TEST_DEVICE)  # an 8 x 8 grid


# Read-backs a whole decode may make besides its passes: the loop's last check (nothing left to do)
# and the statistics at the end (token and draft counts read once; on a GPU also the commit-pass
# map's copy to the host): at most 12.
PER_DECODE = 12


@pytest.mark.parametrize(
    "name, options, per_pass",
    [
        ("ar", {}, 0),  # the number of steps is known: nothing read back per step
        ("sjd", {"window": 8}, 1),  # the pass's slot count (its shape): int(window_len.max())
        ("mc-sjd", {"window": 8}, 1),
        ("mc-sjd", {"window": 8, "coupling": "gumbel"}, 1),
        ("mc-sjd", {"window": 8, "init": "random"}, 1),
        ("zipar", {"s": 3}, 1),  # the pass's width
        ("tree-mc-sjd", {"window": 16, "branch": 3}, 1),  # whether an image is left: the loop's test
        ("sjd-pac", {"window": 16}, 1),
    ],
)
def test_raster_engines_read_back_a_fixed_few_times_per_pass(model, name, options, per_pass):
    params = SamplingParams(guidance_scale=2.0, top_k=20)
    cond = torch.tensor([0, 1, 2], device=model.device)
    with ReadBackCounter() as counter:
        _, stats = get_method(name).fn(Request(model, cond, params, make_generators(3, 4)), **options)
    passes = stats["forward_passes"]
    assert counter.total <= per_pass * passes + PER_DECODE, (dict(counter.by_kind), passes)
    assert counter.total / passes <= 2, (dict(counter.by_kind), passes)  # the target for ar and every window pass


@pytest.mark.slow  # a whole bench: warm-up, timed and counted runs of ar and sjd
def test_bench_reports_read_backs_per_pass():
    from visar.eval.bench import bench, markdown_table

    pipe = visar.load("visar-tiny-random", device=TEST_DEVICE)
    report = bench(pipe, ["sjd"], n=1, progress=False)
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["ar"]["read_backs_per_pass"] <= 0.1 and 0 < rows["sjd"]["read_backs_per_pass"] <= 2
    assert set(rows["sjd"]["read_backs_by_kind"]) <= {"item", "tolist", "bool index", "device to host copy"}
    # ops per pass: the model's step and what the method dispatches around it (a Jacobi pass more than AR's)
    assert 0 < rows["ar"]["ops_per_pass"] < rows["sjd"]["ops_per_pass"]
    assert "| read-backs/pass | ops/pass | auto ran |" in markdown_table(report)


@pytest.mark.parametrize("checkout", ["/home/me/visar", "/home/me/visar-main", "C:\\src\\visar"])
def test_op_sites_names_a_site_from_inside_the_package_wherever_the_checkout_lies(checkout):
    """A site is named from the package's folder on, also in a checkout folder called visar (what
    `git clone` makes), where splitting the path at '/visar/' named it 'visar/accel/...'."""
    op_sites = load_tool("op_sites")
    sep = "\\" if "\\" in checkout else "/"
    package = checkout + sep + "visar"

    def frame_in(relative: str, name: str):
        code = compile(f"def {name}():\n    import sys\n    return sys._getframe()\n", package + sep + relative, "exec")
        scope = {}
        exec(code, scope)
        return scope[name]()

    assert op_sites.site(frame_in("accel/raster/chain.py", "commit"), package) == "accel/raster/chain.py:commit"
    assert op_sites.site(frame_in("pipeline/pipeline.py", "generate"), package) == "pipeline/pipeline.py:generate"
    assert op_sites.site(frame_in("models/llamagen.py", "forward"), package) == op_sites.MODEL
    # the same files under another package root are not visar's
    assert op_sites.site(frame_in("accel/raster/chain.py", "commit"), checkout + sep + "other") == "elsewhere"


def test_op_sites_charge_every_op_once_and_the_models_to_its_forward(model):
    """tools/op_sites.py: the sites' counts add up to every op the counter sees, and the model is
    charged exactly the ops dispatched inside its forward and its cache calls."""
    op_sites = load_tool("op_sites")
    in_model, names = ReadBackCounter(), ["forward", "setup_cache", "truncate_cache"]
    inner = {name: getattr(model, name) for name in names}

    def counted(call):
        def run(*args, **kwargs):
            with in_model:  # nested: both modes see the model's ops
                return call(*args, **kwargs)

        return run

    request = Request(model, torch.tensor([0, 1], device=model.device), SamplingParams(), make_generators(2, 4))
    for name in names:
        setattr(model, name, counted(inner[name]))
    try:
        with op_sites.OpSites() as sites, ReadBackCounter() as counter:
            get_method("mc-sjd").fn(request, window=4)
    finally:
        for name in names:
            delattr(model, name)
    assert sum(sites.sites.values()) == counter.ops
    assert sites.sites[op_sites.MODEL] == in_model.ops > 0
    assert sites.sites["elsewhere"] == 0 and any(name.startswith("accel/raster/chain.py:") for name in sites.sites)
