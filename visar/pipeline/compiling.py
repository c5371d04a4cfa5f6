"""torch.compile of a pipeline's generator, and the eager forward again where compiling fails."""

from __future__ import annotations

import warnings

import torch

from ..accel.raster.pass_loop import compile_failure

# Input shapes a compiled generator compiles before new ones run eagerly (torch's default is 8).
COMPILED_SHAPES = 32


def warn_eager(module: torch.nn.Module, err: Exception):
    warnings.warn(
        f"torch.compile failed on this platform ({compile_failure(err)}); {type(module).__name__} runs "
        "eagerly instead (the same outputs, without the compiled speed-up)",
        RuntimeWarning,
        stacklevel=3,
    )


class EagerFallback:
    """A module's forward compiled with torch.compile, and its eager forward again once compiling fails.

    torch.compile is lazy: a platform where compilation cannot work fails at the first call (or at
    the first call of a new shape), not at torch.compile. That call is rerun eagerly; if the eager
    run succeeds the failure was the compiler's, so the module gets its own forward back, with one
    warning; if it fails too, the error is the model's, and the eager run's error is raised.
    """

    def __init__(self, module: torch.nn.Module, **compile_kwargs):
        self.module, self.eager = module, module.forward
        self.compiled = torch.compile(self.eager, **compile_kwargs)

    def __call__(self, *args, **kwargs):
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            out = self.eager(*args, **kwargs)
            if self.module.__dict__.get("forward") is self:
                del self.module.forward  # the class's forward again, for every later call
            warn_eager(self.module, err)
            return out
