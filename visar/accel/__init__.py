"""Decoding methods: one file per method, registered here by name.

A method is a function `fn(model, cond, params, generators, *, cond_mask=None, progress=False,
**options) -> (tokens [B, N], stats)`; its keyword options are what `Pipeline.generate` and the
CLI accept for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import VisarError
from . import ar, drafts, jacobi, relaxed, zipar


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable
    lossless: bool
    description: str

    @property
    def options(self) -> list[str]:
        # `tokenizer` is handed over by the caller when a method compares tokenizers (spec), not set by users.
        common = {"model", "cond", "params", "generators", "cond_mask", "progress", "tokenizer"}
        return [p for p in inspect.signature(self.fn).parameters if p not in common]

    @property
    def takes_tokenizer(self) -> bool:
        return "tokenizer" in inspect.signature(self.fn).parameters

    def check_options(self, options: dict):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise VisarError(f"unknown option(s) {unknown} for method {self.name!r}; its options: {known}")


METHODS: dict[str, Method] = {}


def register_method(name: str, fn: Callable, *, lossless: bool, description: str):
    METHODS[name] = Method(name, fn, lossless, description)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise VisarError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def list_methods() -> list[str]:
    return sorted(METHODS)


register_method("ar", ar.generate, lossless=True, description="plain next-token sampling (the reference)")
register_method(
    "sjd",
    jacobi.sjd,
    lossless=True,
    description="speculative Jacobi decoding (Teng et al. 2024), per-image commits, exact at any batch size",
)
register_method(
    "mc-sjd",
    jacobi.mc_sjd,
    lossless=True,
    description="coupled speculative Jacobi decoding (So et al. 2025): maximal or Gumbel coupling of drafts",
)
register_method(
    "spec",
    jacobi.spec,
    lossless=True,
    description="speculative sampling with a draft model of the same family (draft=name, folder or module)",
)
register_method(
    "gsd",
    relaxed.gsd,
    lossless=False,
    description="grouped speculative Jacobi decoding (So et al. 2025): accepts a draft by its group of "
    "visually equivalent tokens (lossy)",
)
register_method(
    "lantern",
    relaxed.lantern,
    lossless=False,
    description="LANTERN relaxed speculative decoding (Jang et al. 2025): mass of the draft's codebook "
    "neighbours moved onto it, output within TV delta of the target per position (lossy)",
)
register_method(
    "lantern++",
    relaxed.lantern_pp,
    lossless=False,
    description="LANTERN++ (Jang et al. 2025): a static draft tree from a draft model (draft=), verified in one "
    "pass with tree attention, LANTERN's relaxed test with a multiplicative cap (lambda_cap=1: exact)",
)

# 2-D draft initialisers (token above / to the left) for every Jacobi-style method's `init` option.
jacobi.INITIALISERS.update(drafts.SPATIAL_INITIALISERS)

register_method(
    "zipar",
    zipar.zipar,
    lossless=False,
    description="ZipAR next-set decoding (He et al. 2025): row r+1 starts once row r has s tokens, every row "
    "front advances in one pass, W + (H-1)s passes (lossy for s < W: unfinished rows above are not seen)",
)
register_method(
    "zipar-sjd",
    zipar.zipar_sjd,
    lossless=False,
    description="zipar whose row fronts each run a speculative Jacobi window (lossy as zipar; exact for s >= W)",
)
register_method(
    "zipar-mc-sjd",
    zipar.zipar_mc_sjd,
    lossless=False,
    description="zipar whose row fronts each run a coupled speculative Jacobi window (lossy as zipar)",
)
register_method(
    "zipar-gsd",
    zipar.zipar_gsd,
    lossless=False,
    description="zipar whose row fronts each run a GSD window (grouped acceptance; lossy even for s >= W)",
)
register_method(
    "wavefront",
    zipar.wavefront,
    lossless=True,
    description="exact wavefront decoding for a model that declares local dependence (model.dependency_reach)",
)
