import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("VISAR_FIXTURES", REPO.parent / "shared" / "fixtures"))


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
    """The official-code fixtures for a family; skip (outside CI) when ../shared is absent."""
    folder = FIXTURES / family
    if not folder.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"fixtures missing in CI: {folder} (CI must have ../shared beside the clone)")
        pytest.skip(f"compatibility fixtures not found at {folder}: clone with ../shared or set VISAR_FIXTURES")
    return folder


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
