"""Decoding methods, laid out by what they decode:

- `core/`: what every kind shares: the method registry (`Request`, `register_method`), sampling,
  guided scoring, the acceptance rules, tree verification, decode statistics, option checks;
- `raster/`: next-token models: the pass loop (`pass_loop.py`), its engines (`chain.py`,
  `tree_passes.py`, `static_tree.py`, `zipar/`), drafts, proposers and draft trees, and the
  registered raster methods (`raster/methods/`, `zipar/methods.py`);
- `next_scale/`, `masked/`, `continuous/`: the methods of VAR, MaskGIT / aMUSEd and MAR models;
- `policy/`: `auto`, which times candidate methods on a call and keeps the winner.

Importing a module registers its methods, in the order below, which is the order `visar methods`
and the demo list them (each kind's reference first)."""

from __future__ import annotations

# isort: off
from .raster.methods import ar, jacobi, trees  # raster models
from .policy import auto
from .raster.methods import relaxed
from .raster import zipar
from .continuous import mar, cspd, mar_cache  # continuous-token models
from .next_scale import methods as next_scale  # next-scale models
from .masked import maskgit, halton, lpd  # masked models

# isort: on
from .core.method_registry import (
    METHODS,
    Method,
    Request,
    get_method,
    list_methods,
    methods_for,
    reference_method,
    register_method,
)

__all__ = [
    "METHODS",
    "Method",
    "Request",
    "get_method",
    "list_methods",
    "methods_for",
    "reference_method",
    "register_method",
    "ar",
    "auto",
    "cspd",
    "halton",
    "jacobi",
    "lpd",
    "mar",
    "mar_cache",
    "maskgit",
    "next_scale",
    "relaxed",
    "trees",
    "zipar",
]
