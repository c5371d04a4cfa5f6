"""Decoding methods: one file per method family, each method registered beside its code with
`registry.register_method`; importing a module registers its methods, in the order below, which is
the order `visar methods` and the demo list them (each kind's reference first)."""

from __future__ import annotations

# isort: off
from . import ar, jacobi, tree_jacobi, auto, relaxed, zipar  # raster models
from . import mar, cspd, mar_cache  # continuous-token models
from . import next_scale  # next-scale models
from . import maskgit, halton, lpd  # masked models

# isort: on
from . import draft_trees, drafts, proposers
from .registry import METHODS, Method, Request, get_method, list_methods, reference_method, register_method

__all__ = [
    "METHODS",
    "Method",
    "Request",
    "get_method",
    "list_methods",
    "reference_method",
    "register_method",
    "ar",
    "auto",
    "cspd",
    "draft_trees",
    "drafts",
    "halton",
    "jacobi",
    "lpd",
    "mar",
    "mar_cache",
    "maskgit",
    "next_scale",
    "proposers",
    "relaxed",
    "tree_jacobi",
    "zipar",
]
