import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The official-code fixtures (tests/fixtures/README.md); VISAR_FIXTURES points elsewhere.
FIXTURES = Path(os.environ.get("VISAR_FIXTURES", REPO / "tests" / "fixtures"))


def _test_device() -> torch.device:
    """The device the model tests run on: VISAR_TEST_DEVICE (cpu, cuda, cuda:1 ...; default cpu)."""
    name = os.environ.get("VISAR_TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise pytest.UsageError(f"VISAR_TEST_DEVICE={name!r} is not a device: {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"VISAR_TEST_DEVICE={name!r} but CUDA is not available on this machine")
    return device


# What visar caches on disk (auto's tuning, codebook neighbours) goes to a
# folder of this run, so that no test reads what another run (or the user) left there.
if "VISAR_CACHE" not in os.environ:
    import tempfile

    os.environ["VISAR_CACHE"] = tempfile.mkdtemp(prefix="visar-test-cache-")

# Under pytest-xdist (the quick tier's `-n 2`) each worker takes one core: two workers of two OpenMP
# threads each on two cores wait on each other's busy threads (measured: over 10 min for the quick
# tier, 66 s with one thread a worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# VISAR_TEST_SHAPE_NOISE=1e-6: every linear layer run at more than one torch thread is scaled by
# 1 + noise x (a factor of its row count), as a BLAS whose reduction order follows the batch's shape
# rounds (MKL at two threads on AVX-512 CPUs: 1e-6 in the logits). A test that asserts bits across
# batch shapes then fails on any machine unless it runs at one thread (`one_thread`) or decodes each
# image alone (deterministic=True); .ci/run's second quick-tier run sets it.
SHAPE_NOISE = float(os.environ.get("VISAR_TEST_SHAPE_NOISE", "0") or 0)
if SHAPE_NOISE:
    import torch.nn.functional as F

    _linear = F.linear

    def _linear_by_shape(input, weight, bias=None):
        out = _linear(input, weight, bias)
        if torch.compiler.is_compiling():  # a traced pass keeps its graph (tests/accel/raster/test_compile.py)
            return out
        if torch.get_num_threads() == 1 or out.dim() < 2 or not out.is_floating_point():
            return out
        rows = out.numel() // max(out.shape[-1], 1)
        return out * (1 + SHAPE_NOISE * (1 + rows % 5) / 5)

    F.linear = _linear_by_shape

# The conformance suite, the exact-law tests, the fixture tests and the bench tests build their models
# on this device (inputs follow the model); the rest of the suite is device-free or CPU by design.
TEST_DEVICE = _test_device()
ON_ACCELERATOR = TEST_DEVICE.type != "cpu"
if TEST_DEVICE.type == "cuda":
    # The fp32 tests compare with fp32 references at 1e-4 (the official-code fixtures) or exactly;
    # cuDNN's default TF32 convolutions (the VQ decoder) round at 1e-3. Matmuls are fp32 by default.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
# Dtypes the conformance suite runs in: fp32, plus bf16 where VISAR_TEST_DTYPES asks for it (default
# "fp32": on a 2-core CPU bf16 doubles the suite for what the device check covers; tools/device_check.sh
# sets "fp32,bf16").
TEST_DTYPES = [d.strip() for d in os.environ.get("VISAR_TEST_DTYPES", "fp32").split(",") if d.strip()]


def law_samples(n: int) -> int:
    """Draws for an exact-law test: n, on any device (the per-image CPU generators, not the device,
    bound the time), unless VISAR_TEST_LAW_SAMPLES caps it for a short run (tools/device_check.sh: a
    GPU lent for minutes). The tolerances follow the draws (chi-square, and TV against the noise
    floor of the same number of exact draws), so a capped run is a weaker test, not a looser one."""
    cap = os.environ.get("VISAR_TEST_LAW_SAMPLES")
    return min(n, int(cap)) if cap else n


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The test device (VISAR_TEST_DEVICE, default cpu)."""
    return TEST_DEVICE


@pytest.fixture(scope="module")
def offline():
    """HF_HUB_OFFLINE=1 for a module's tests (folders saved with save_pretrained load with nothing fetched)."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    if old is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = old


def fixtures_dir(family: str) -> Path:
    """The official-code fixtures for a family (tests/fixtures/<family>, part of the repository)."""
    folder = FIXTURES / family
    if not folder.is_dir():
        pytest.fail(f"compatibility fixtures not found at {folder}: they are part of the repository (tests/fixtures)")
    return folder


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_bytes(folder: Path, leave_out=(), pattern: str = "**/*") -> dict[str, bytes]:
    """Every file under `folder` matching `pattern` (hidden ones too), but those named in `leave_out`
    -> its bytes, by its path relative to `folder`: two runs wrote the same files when these are equal."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.glob(pattern))
        if p.is_file() and p.name not in leave_out
    }


def run_output_bytes(folder: Path, leave_out=()) -> dict[str, bytes]:
    """`file_bytes` of a command's output folder with the folder's own path (which GenEval's
    results.jsonl names its images by) written as OUT: runs into two folders compare equal."""
    return {name: data.replace(str(folder).encode(), b"OUT") for name, data in file_bytes(folder, leave_out).items()}


@pytest.fixture
def last_error(capsys):
    """() -> the last line a command wrote to stderr ("" when it wrote none); reads capsys, so what was
    captured before is gone."""

    def read() -> str:
        lines = capsys.readouterr().err.strip().splitlines()
        return lines[-1] if lines else ""

    return read


@pytest.fixture(scope="module")
def model16():
    """A tiny LlamaGen of 4 x 4 tokens, vocabulary 32 (tests/laws.py): several windows per image, and
    images of one batch that finish at different passes."""
    from laws import tiny_llamagen

    return tiny_llamagen(vocab=32, block_size=16, seed=3, std=0.3)


@pytest.fixture(scope="module")
def model16_vocab16():
    """`model16`'s 4 x 4 grid on a vocabulary of 16 (the draft-tree tests' model)."""
    from laws import tiny_llamagen

    return tiny_llamagen(vocab=16, block_size=16, seed=3, std=0.3)


@pytest.fixture
def private_neighbour_cache(tmp_path, monkeypatch):
    """Neighbour tables (the relaxed methods' codebook neighbours) go to a fresh cache folder per test,
    never the user's."""
    from visar.accel.core import codebook

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(codebook, "LOADED_TABLES", {})


@contextmanager
def one_torch_thread():
    """One torch thread for a block that asserts bit equality across batch shapes (a row subset, a
    refill, another batch size, a resume, another world size). That equality holds only where every
    reduction runs in the same order for every batch shape: on a CPU at one thread. A multi-threaded
    BLAS (MKL on AVX-512 CPUs) splits a matmul's reduction by the shape, and a GPU picks its kernels
    by shape, so elsewhere only the law is the same (issue 54); `deterministic=True` is what makes
    the bits hold at any thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """A test marked one_thread (it asserts bit equality across batch shapes) sets up its fixtures at one
    torch thread too: a module's reference run made in them is compared bit for bit."""
    with one_torch_thread() if item.get_closest_marker("one_thread") else nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test marked one_thread runs at one torch thread (`one_torch_thread` says why)."""
    with one_torch_thread() if item.get_closest_marker("one_thread") else nullcontext():
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# A skip in CI hides a test the CI command was meant to run: only the machine itself (no CUDA, no GPU
# device) may excuse one; a missing package or file is something the README's install command provides.
MACHINE_REASONS = ("cuda", "gpu", "device")


def ci_skip_allowed(reason: str) -> bool:
    return any(word in reason.lower() for word in MACHINE_REASONS)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def fail_ci_skip(report):
    """Turn a skipped test or module report into a failure under CI, unless the machine is the reason."""
    if not in_ci() or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not ci_skip_allowed(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI ({reason}); only a skip for the machine (no CUDA) is allowed there"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_ci_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level pytest.importorskip skips the whole module at collection
    fail_ci_skip(outcome.get_result())
