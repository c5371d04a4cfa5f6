"""Decoding methods: one file per method family, each method registered beside its code with
`registry.register_method`; importing a module registers its methods."""

from __future__ import annotations

from . import ar, cspd, drafts, halton, jacobi, lpd, mar, mar_cache, maskgit, next_scale, relaxed, tree_jacobi, zipar
from .registry import METHODS, Method, get_method, list_methods, reference_method, register_method

__all__ = [
    "METHODS",
    "Method",
    "get_method",
    "list_methods",
    "reference_method",
    "register_method",
    "ar",
    "cspd",
    "drafts",
    "halton",
    "jacobi",
    "lpd",
    "mar",
    "mar_cache",
    "maskgit",
    "next_scale",
    "relaxed",
    "tree_jacobi",
    "zipar",
]
