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

import warnings
from collections.abc import Callable
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


# compile options -> run_pass under torch.compile (False once compiling failed on this platform): one
# compiled function for every engine and decode, so a later decode reuses the code compiled for its shapes
COMPILED_PASSES: dict[tuple, Callable | bool] = {}


def options_key(compile_options: dict) -> tuple:
    return tuple(sorted(compile_options.items()))


def pass_runner(compile_options: dict | None) -> Callable:
    """run_pass, or run_pass under torch.compile with these options (Pipeline.compile's)."""
    if compile_options is None:
        return run_pass
    key = options_key(compile_options)
    if key not in COMPILED_PASSES:
        # dynamic=None whatever the model's setting: a Python number a pass reads or counts (the
        # scorer's forward passes) becomes an input after it first changes, instead of a new graph
        # for each of its values; the few shapes of pass are still compiled once each
        COMPILED_PASSES[key] = torch.compile(run_pass, **{**compile_options, "dynamic": None})
    return COMPILED_PASSES[key] or run_pass


@torch.no_grad()
def decode_passes(
    engine: PassEngine, progress: bool = False, compile_options: dict | None = None
) -> tuple[Tensor, dict]:
    """Run `engine`'s passes until its plan says stop; compile_options (a compiled pipeline's): each
    pass, bookkeeping and model call, under torch.compile (on a GPU with mode="reduce-overhead", one
    CUDA graph per shape of pass). Where compiling fails, the pass runs eagerly from then on, with one
    warning (torch.compile fails before it runs anything, so the pass is not run twice)."""
    step = pass_runner(compile_options)
    bar = progress_bar(total=engine.total, enabled=progress, desc=engine.desc)
    try:
        with engine:
            while (plan := engine.plan()) is not None:
                try:
                    step(engine, plan)
                except Exception as err:
                    if step is run_pass:
                        raise
                    run_pass(engine, plan)  # an error of the pass itself is raised here, as eagerly
                    COMPILED_PASSES[options_key(compile_options)] = False
                    step = run_pass
                    warn_compile_failed(err)
                if progress:  # a read-back, so only when a bar shows
                    bar.update(int(engine.least_done()) - bar.n)
    finally:
        bar.close()
    return engine.finish()


def compile_failure(err: Exception) -> str:
    """What made torch.compile fail, in one line: torch wraps the compiler's own error
    (BackendCompilerFailed.inner_exception), which is the one worth reading."""
    root = err
    while isinstance(inner := root.__cause__ or getattr(root, "inner_exception", None), Exception):
        root = inner
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    reason = f"{type(root).__name__}: {lines[0][:300] if lines else ''}"
    return reason if root is err else f"{type(err).__name__}, {reason}"


def warn_compile_failed(err: Exception):
    warnings.warn(
        f"torch.compile failed on this platform ({compile_failure(err)}); a decode's passes run eagerly "
        "instead (the same outputs, without the compiled speed-up)",
        RuntimeWarning,
        stacklevel=3,
    )
