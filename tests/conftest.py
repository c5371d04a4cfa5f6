import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The official-code fixtures (tests/fixtures/README.md); VISAR_FIXTURES points elsewhere.
FIXTURES = Path(os.environ.get("VISAR_FIXTURES", REPO / "tests" / "fixtures"))


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
