"""torch.compile of a pipeline's generator (`Pipeline.compile`), and the eager forward again where compiling fails.

Static shapes by default (`dynamic=False`): each input shape compiles once, on its first call, and
the engines keep to few shapes (the prefill, one token, Jacobi windows padded to 1, 2, 4, 8 or 16
slots); zipar's passes vary in width and recompile per width up to `COMPILED_SHAPES`, then run
eagerly. Outputs match eager mode up to kernel numerics. compile_kwargs go to torch.compile (e.g.
mode="reduce-overhead" for CUDA graphs on a GPU).
whole_passes (the pipeline's `compile_options`): the raster engines that draft
(`visar.accel.raster.pass_loop`: chains, trees, zipar's fronts, lantern++'s static trees) also run
each whole pass, their bookkeeping with the model call, under torch.compile with these options: one
graph a pass (tests/accel/raster/test_engine_conformance.py), windows and front passes padded to
powers of two, so that on a GPU a pass can replay as one CUDA graph. Off by default: on a CPU it
measured slower than eager passes (docs/SPEED.md), and it is not yet measured on a GPU.
Where compiling fails (no C++ compiler, an unsupported platform or Python), the generator runs
eagerly from that call on, rerunning it, with one warning saying why (`EagerFallback`).
"""

from __future__ import annotations

import warnings

import torch

from ..accel.raster.pass_loop import compile_failure

# Input shapes a compiled generator compiles before new ones run eagerly (torch's default is 8).
COMPILED_SHAPES = 32


def warn_eager(module: torch.nn.Module, err: Exception, stacklevel: int = 3):
    """One warning that `module` runs eagerly, pointing `stacklevel` frames up: at the caller of the
    forward, or of `Pipeline.compile`."""
    warnings.warn(
        f"torch.compile failed on this platform ({compile_failure(err)}); {type(module).__name__} runs "
        "eagerly instead (the same outputs, without the compiled speed-up)",
        RuntimeWarning,
        stacklevel=stacklevel,
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


def compile_forward(model: torch.nn.Module, compile_kwargs: dict):
    """torch.compile `model`'s forward in place (`EagerFallback`), room made for `COMPILED_SHAPES` input
    shapes; where torch.compile refuses outright (e.g. a Python it does not support), one warning."""
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), COMPILED_SHAPES))
    try:
        model.forward = EagerFallback(model, **compile_kwargs)
    except Exception as err:
        warn_eager(model, err, stacklevel=4)  # at the caller of Pipeline.compile
