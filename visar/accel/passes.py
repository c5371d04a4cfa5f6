"""The raster pass loop: every raster decode that drafts is this one loop over passes.

A pass plans which slots each image scores (a chain window after its committed prefix, a draft
tree, its row fronts, a static tree), proposes their drafts, scores them in one target forward,
verifies them under the acceptance rule, and commits what holds (tokens, statistics, carried
drafts, the cache). What differs between the shapes of pass is a `PassEngine`: `ChainPasses`
(jacobi.py: sjd, mc-sjd, spec, gsd, lantern), `TreePasses` (tree_jacobi.py: sjd-pac,
tree-mc-sjd), `StaticTreePasses` (tree.py: lantern++) and `FrontPasses` (zipar/engine.py: the zipar
family, wavefront). The pass policy is the `budget` an engine is handed: None for its fixed size,
a budget that chooses each pass's size from what earlier passes committed, or a probe that times
the engine and then stops it (`visar.accel.budget`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from ..progress import progress_bar


class PassEngine(Protocol):
    """One shape of pass, with the state it carries from pass to pass.

    `with engine:` holds what a decode holds open (the KV cache, a draft model's); `plan()` is the
    next pass's shape, asking the budget for its size (None: every image is done, or a probe has
    timed its passes); `commit` writes the pass's tokens and statistics, tells the budget what it
    committed, carries drafts over and trims the cache.
    """

    desc: str  # the progress bar's label
    total: int  # image tokens, for the progress bar

    def __enter__(self) -> PassEngine: ...

    def __exit__(self, *exc) -> None: ...

    def plan(self) -> Any | None: ...

    def propose(self, plan) -> Any: ...

    def score(self, plan, drafts) -> Tensor: ...

    def verify(self, plan, drafts, probs: Tensor) -> Any: ...

    def commit(self, plan, drafts, probs: Tensor, verdict) -> None: ...

    def least_done(self) -> Tensor:
        """The fewest tokens any image has committed (a 0-d tensor; read only for a progress bar)."""
        ...

    def finish(self) -> tuple[Tensor, dict]:
        """-> (tokens [B, N], stats)."""
        ...


def run_pass(engine: PassEngine, plan) -> None:
    """One pass of a planned shape: propose, score, verify, commit. Only `plan` reads the device
    back (the pass's shape); this part traces as one graph (tests/test_compile.py)."""
    drafts = engine.propose(plan)
    probs = engine.score(plan, drafts)
    verdict = engine.verify(plan, drafts, probs)
    engine.commit(plan, drafts, probs, verdict)


@torch.no_grad()
def decode_passes(engine: PassEngine, progress: bool = False) -> tuple[Tensor, dict]:
    """Run `engine`'s passes until its plan says stop."""
    bar = progress_bar(total=engine.total, enabled=progress, desc=engine.desc)
    try:
        with engine:
            while (plan := engine.plan()) is not None:
                run_pass(engine, plan)
                if progress:  # a read-back, so only when a bar shows
                    bar.update(int(engine.least_done()) - bar.n)
    finally:
        bar.close()
    return engine.finish()
