"""A VQ model's codebook and each code's nearest codes: the latent proximity that GSD's grouped test
and LANTERN's relaxed target read (raster/methods/relaxed.py).

A neighbour table ([V, width], each code's nearest other codes, nearest first) is computed once per
codebook and kept in memory and on disk (`<cache>/neighbours/<codebook hash>-<width>.pt`, under
`cache.cache_root`), wide enough (TABLE_MIN_WIDTH) that another k reads the same file.
"""

from __future__ import annotations

import hashlib
import math
import os

import torch
from torch import Tensor

from ...errors import VisarError
from ...tokenizers.base import TokenGridTokenizer
from .cache import cache_root

TABLE_MIN_WIDTH = 256  # neighbours stored per code, so that other k reuse the same file


def codebook_of(tokenizer, vocab_size: int, method: str) -> Tensor:
    """The code vectors [V, C] (float32, CPU) a VQ tokenizer decodes with; `tokenizer` may also be
    that tensor itself. One clear error for a missing tokenizer, one without a codebook, or a
    codebook that does not match the model's vocabulary."""
    if tokenizer is None:
        raise VisarError(
            f"method {method!r} compares tokens by their code vectors: make the Request with tokenizer= (the "
            "model's VQ tokenizer, or its codebook [V, C]; Pipeline.generate passes its own)"
        )
    if isinstance(tokenizer, Tensor):
        book = tokenizer
    else:
        if not isinstance(tokenizer, TokenGridTokenizer):
            raise VisarError(
                f"method {method!r} needs a VQ tokenizer with a codebook; {type(tokenizer).__name__} has none "
                "(a continuous tokenizer has no code neighbours to relax towards)"
            )
        with torch.no_grad():
            book = tokenizer.codebook()
    book = book.detach().float().cpu()
    if book.dim() != 2 or book.shape[0] != vocab_size:
        raise VisarError(
            f"codebook of shape {tuple(book.shape)} does not fit the model's {vocab_size}-token vocabulary: "
            "pass the model's own tokenizer"
        )
    return book


def codebook_hash(codebook: Tensor) -> str:
    data = codebook.detach().float().cpu().contiguous()
    digest = hashlib.sha256(str(tuple(data.shape)).encode())
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:20]


def compute_neighbours(codebook: Tensor, width: int, chunk: int = 256) -> Tensor:
    """[V, width] ids of each code's nearest other codes, nearest first (squared L2 of the code
    vectors, float64; ties by id), as LANTERN's `generate_codebook.py` (diagonal excluded)."""
    book = codebook.double()
    norms = book.pow(2).sum(1)
    rows = []
    for start in range(0, book.shape[0], chunk):
        part = book[start : start + chunk]
        dist = (norms[start : start + chunk, None] + norms[None] - 2 * part @ book.t()).clamp(min=0)
        dist[torch.arange(len(part)), torch.arange(start, start + len(part))] = math.inf
        rows.append(dist.sort(dim=1, stable=True).indices[:, :width])
    return torch.cat(rows)


LOADED_TABLES: dict[str, Tensor] = {}  # codebook hash -> the widest table seen in this process


def nearest_codes(codebook: Tensor, k: int) -> Tensor:
    """[V, k] nearest codes of every code (int64, CPU), from memory, the disk cache, or computed
    once and stored as `<cache>/neighbours/<codebook hash>-<width>.pt`."""
    vocab = codebook.shape[0]
    if not 1 <= k <= vocab - 1:
        raise VisarError(f"a codebook of {vocab} codes has 1..{vocab - 1} neighbours per code, asked for {k}")
    key = codebook_hash(codebook)
    table = LOADED_TABLES.get(key)
    if table is None or table.shape[1] < k:
        table = load_or_build_table(codebook, key, k)
        LOADED_TABLES[key] = table
    return table[:, :k]


def load_or_build_table(codebook: Tensor, key: str, k: int) -> Tensor:
    folder = cache_root() / "neighbours"
    stored = sorted(folder.glob(f"{key}-*.pt"), key=lambda path: int(path.stem.rsplit("-", 1)[1]))
    for path in stored:
        if int(path.stem.rsplit("-", 1)[1]) >= k:
            try:
                table = torch.load(path, weights_only=True).long()
            except (OSError, RuntimeError, ValueError):
                continue  # unreadable (a partial write from another process): rebuild below
            if table.shape[0] == codebook.shape[0] and table.shape[1] >= k:
                return table
    vocab = codebook.shape[0]
    table = compute_neighbours(codebook, min(vocab - 1, max(k, TABLE_MIN_WIDTH)))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{key}-{table.shape[1]}.pt"
        scratch = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(table.to(torch.int16 if vocab <= 2**15 else torch.int32), scratch)
        scratch.replace(path)  # atomic: readers never see half a file
    except OSError:
        pass  # a read-only cache only costs the recomputation next time
    return table
