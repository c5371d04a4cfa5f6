"""Model families: how each one builds a model from a config, loads weights strictly, and pairs a tokenizer.

A family is what `config.json`'s "family" key names. It registers here, in its own file
(`families/<name>.py`, imported at the bottom), with:
- `build_model(model_args)` and `load_model_weights(model, path, source)`: the model, and strict
  loading with the family's own key filtering and the presets that name a mismatching file;
- `build_tokenizer(tokenizer_args)` and `load_tokenizer_weights(tokenizer, path, source)`: the
  tokenizer kind it pairs with (`tokenizer_args` are config.json's "vq_args");
- `official_presets`: released checkpoints by name (`visar.load(name, checkpoint=...)`), and
  `generic_name`, a name that loads any checkpoint of the family given its constructor arguments;
- `tiny_model_args` / `tiny_tokenizer_args`: a tiny random instance, so that tests loop over
  every registered family (tests/accel/test_method_conformance.py).

The models a family builds implement the interface of their kind (`visar.models.base`), which is
all the decoding methods see. A new family is new files: its model, its tokenizer, its registration.
"""

from . import amused, hf_emu3, hf_janus, hf_lumina, llamagen, mar, maskgit, proxy, var  # noqa: F401  (each family module registers itself)
from .family import (
    FAMILIES,
    Family,
    FolderParts,
    OfficialPreset,
    folder_formats,
    generic_names,
    get_family,
    hf_family,
    official_presets,
    original_names,
    register_family,
)

__all__ = [
    "FAMILIES",
    "Family",
    "FolderParts",
    "OfficialPreset",
    "folder_formats",
    "generic_names",
    "get_family",
    "hf_family",
    "official_presets",
    "original_names",
    "register_family",
]
