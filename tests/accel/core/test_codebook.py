"""The codebook neighbour tables GSD and LANTERN read (visar/accel/core/codebook.py): nearest first,
computed once per codebook, kept on disk and read back by another process and another k."""

import pytest
import torch
from laws import unit_codebook

from visar.accel.core import codebook

pytestmark = pytest.mark.usefixtures("private_neighbour_cache")


def test_neighbour_table_is_computed_once_and_cached_by_codebook(tmp_path, monkeypatch):
    book = unit_codebook(40, 4, 3)
    table = codebook.nearest_codes(book, 5)
    distances = torch.cdist(book.double(), book.double()).pow(2)
    distances.fill_diagonal_(float("inf"))
    assert torch.equal(table, distances.argsort(dim=1, stable=True)[:, :5])
    files = list((tmp_path / "cache" / "neighbours").glob("*.pt"))
    assert [f.name for f in files] == [f"{codebook.codebook_hash(book)}-39.pt"]  # all 39 others stored

    # a new process (empty memory) reads the file, and another k reuses it
    monkeypatch.setattr(codebook, "LOADED_TABLES", {})
    monkeypatch.setattr(codebook, "compute_neighbours", lambda *a, **kw: pytest.fail("recomputed"))
    assert torch.equal(codebook.nearest_codes(book, 12)[:, :5], table)
    monkeypatch.undo()
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    # another codebook gets its own file
    codebook.nearest_codes(unit_codebook(40, 4, 4), 5)
    assert len(list((tmp_path / "cache" / "neighbours").glob("*.pt"))) == 2
