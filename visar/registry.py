"""Model names visar knows: embedded models shipped in the package, and the families' official presets.

Embedded models live in `visar/weights/<name>/` as `config.json` (+ safetensors weights, the tokenizer's
among them: each folder is self-contained); a
config with `"init": {"random_seed": S}` and no weights builds a seeded random model. Official
presets (defined by their family, `visar/families/`) fetch their released files from the Hugging
Face Hub (`visar/hub.py`), or take files on disk (`checkpoint=`, `vq_checkpoint=`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import VisarError, install_command
from .families import FAMILIES, folder_formats, generic_names, official_presets, original_names

WEIGHTS_DIR = Path(__file__).parent / "weights"

# What `visar.load("default")` and every command without --model use.
DEFAULT_MODEL = "visar-tiny-c2i"

OFFICIAL_PRESETS = official_presets()


def embedded_models() -> dict[str, Path]:
    """name -> folder of every model shipped inside the package."""
    if not WEIGHTS_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(WEIGHTS_DIR.iterdir()) if (p / "config.json").is_file()}


def proxy_models() -> list[str]:
    """The embedded proxies (`visar.models.proxy`: a trained model's law at a full-size model's cost), for
    speed figures only: their images are their law model's, so the demo and the digests leave them out."""
    return [name for name, folder in embedded_models().items() if read_config(folder).get("family") == "proxy"]


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VisarError(f"cannot read {folder / 'config.json'}: {err}") from err


def is_model_folder(path: Path) -> bool:
    """A folder visar.load reads: config.json (visar's or transformers'), or model_index.json (a diffusers pipeline)."""
    return path.is_dir() and ((path / "config.json").is_file() or (path / "model_index.json").is_file())


def read_model_config(folder: Path) -> dict:
    """config.json, or, in a diffusers pipeline folder (none at the top), model_index.json; a diffusers
    config (one with "_class_name") says which file it came from in "_source"."""
    if not (folder / "config.json").is_file() and (folder / "model_index.json").is_file():
        try:
            return {**json.loads((folder / "model_index.json").read_text()), "_source": "model_index.json"}
        except (OSError, json.JSONDecodeError) as err:
            raise VisarError(f"cannot read {folder / 'model_index.json'}: {err}") from err
    config = read_config(folder)
    return {**config, "_source": "config.json"} if "_class_name" in config else config


def weights_file(folder: Path, weights: dict, key: str) -> Path:
    """The file config.json's "weights" names under `key`, which must lie inside the folder: a folder is
    published (a Hub repository) and copied as a whole, so a path out of it (absolute, or up through "..")
    would name a file its copies lack. Judged on the name as written, not on where links lead (a Hub
    cache's snapshot files are links into its blobs)."""
    name = weights.get(key)
    if key not in weights or not isinstance(name, str) or not name:
        raise VisarError(f"{folder / 'config.json'} names no file for weights {key!r} (got {name!r})")
    if Path(name).is_absolute() or Path(os.path.normpath(name)).parts[:1] == ("..",):
        raise VisarError(
            f"{folder / 'config.json'} names weights {key!r} as {name!r}, outside its folder: a model folder must "
            f"be self-contained, so put the file in the folder and name it by its path there"
        )
    return folder / name


def list_models() -> list[str]:
    return ["default", *embedded_models(), *OFFICIAL_PRESETS, *generic_names()]


def describe_models() -> list[tuple[str, str]]:
    rows = [("default", f"alias of {DEFAULT_MODEL}")]
    rows += [(name, read_config(folder).get("description", "")) for name, folder in embedded_models().items()]
    rows += [(p.name, p.description) for p in OFFICIAL_PRESETS.values()]
    rows += [(name, family.generic_description) for name, family in generic_names().items()]
    return rows


def describe_families() -> list[tuple[str, str, str]]:
    """(title, what of it loads, the folders it reads) of every family a registration lists (`Family.title`),
    from the registrations: its kind, its embedded models, its presets and the repositories their files come
    from, its generic name, the Hub repositories of its folders visar knows (with the original names that
    fetch them) and the extra it needs."""
    embedded: dict[str, list[str]] = {}
    for name, folder in embedded_models().items():
        embedded.setdefault(read_config(folder).get("family", ""), []).append(name)
    rows = []
    listed = [family for family in FAMILIES.values() if family.title is not None]
    # visar's own dependencies first, then the families an extra brings; by title within each
    for family in sorted(listed, key=lambda family: (family.extra is not None, family.title.casefold())):
        parts = [f"{family.model_kind} models"]
        if embedded.get(family.name):
            parts.append(f"embedded {', '.join(embedded[family.name])}")
        if family.official_presets:
            presets = list(family.official_presets.values())
            repos = sorted({p.hub_repo for p in presets if p.hub_repo})
            where = f"files from {', '.join(repos)}" if repos else "files by path"
            parts.append(f"{len(presets)} presets, below ({where})")
        if family.generic_name:
            parts.append(f"any checkpoint: --model {family.generic_name} --checkpoint FILE")
        if family.hub_names:
            originals = original_names(family)
            plural = "s" if len(originals) > 1 else ""
            also = f" (also by the original name{plural} {', '.join(originals)})" if originals else ""
            parts.append(f"Hub {', '.join(family.hub_names)}{also}")
        if family.extra:
            parts.append(f"needs `{install_command(family.extra)}`")
        rows.append((family.title, "; ".join(parts), folder_formats(family)))
    return rows


def resolve_name(name: str) -> str:
    return DEFAULT_MODEL if name == "default" else name
