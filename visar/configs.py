"""A config dataclass from its `config.json` dict, written once for the models' and tokenizers' configs.

The frozen configs of the model and tokenizer files (`LlamaGenConfig`, `VQConfig`, ...) read their
arguments the same way: the fixtures' older names are renamed, unknown keys are refused with one
sentence naming the known fields, and JSON lists become the tuples a frozen dataclass holds. What
differs per config (which names, which conversions, a check of its own) stays at its `from_dict`.
(`CaptionEncoderConfig`, visar's own caption encoder, only makes its vocabulary a tuple.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

from .errors import VisarError

Config = TypeVar("Config")


def config_from_dict(
    cls: type[Config],
    args: dict,
    what: str,
    *,
    renamed: dict[str, str] | None = None,
    convert: dict[str, Callable] | None = None,
    known_as: str = "known fields",
) -> Config:
    """cls(**args), after renaming `renamed`'s old keys to new ones, refusing keys that are not
    fields ("unknown {what} [...]; {known_as}: [...]") and applying `convert`'s function to each
    key present (`tuple` for a list from JSON)."""
    args = dict(args)
    for old, new in (renamed or {}).items():
        if old in args:
            args[new] = args.pop(old)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise VisarError(f"unknown {what} {unknown}; {known_as}: {sorted(known)}")
    for key, function in (convert or {}).items():
        if key in args:
            args[key] = function(args[key])
    return cls(**args)
