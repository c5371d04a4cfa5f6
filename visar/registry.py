"""Model names visar knows: embedded models shipped in the package, and official release presets.

Embedded models live in `visar/weights/<name>/` as `config.json` (+ safetensors weights); a
config with `"init": {"random_seed": S}` and no weights builds a seeded random model. Official
presets need the user's checkpoint files (`checkpoint=`, `vq_checkpoint=`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import VisarError
from .models.llamagen import GPT_SIZES, preset_config

WEIGHTS_DIR = Path(__file__).parent / "weights"

# What `visar.load("default")` and every command without --model use.
DEFAULT_MODEL = "visar-tiny-c2i"


@dataclass(frozen=True)
class OfficialPreset:
    name: str
    description: str
    model_args: dict
    vq_preset: str
    vq_image_size: int
    defaults: dict = field(default_factory=dict)


def _official_presets() -> dict[str, OfficialPreset]:
    presets = {}
    for size in GPT_SIZES:
        for px, tokens in ((256, 256), (384, 576)):
            name = f"llamagen-{size.lower()}-c2i-{px}"
            config = preset_config(size, "c2i", tokens)
            presets[name] = OfficialPreset(
                name,
                f"LlamaGen {size} class-conditional ImageNet {px}px (official checkpoint + VQ-16 required)",
                config.to_dict(),
                "VQ-16",
                px,
                # LlamaGen's sample_c2i.py defaults.
                {"guidance_scale": 4.0, "temperature": 1.0, "top_k": None, "top_p": 1.0},
            )
    for px, tokens in ((256, 256), (512, 1024)):
        presets[f"llamagen-gpt-xl-t2i-{px}"] = OfficialPreset(
            f"llamagen-gpt-xl-t2i-{px}",
            f"LlamaGen GPT-XL text-to-image {px}px (official checkpoint + VQ-16 required; captions as "
            "flan-t5-xl embeddings [B, 120, 2048])",
            preset_config("GPT-XL", "t2i", tokens).to_dict(),
            "VQ-16",
            px,
            {"guidance_scale": 7.5, "temperature": 1.0, "top_k": None, "top_p": 1.0},
        )
    return presets


OFFICIAL_PRESETS = _official_presets()


def embedded_models() -> dict[str, Path]:
    """name -> folder of every model shipped inside the package."""
    if not WEIGHTS_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(WEIGHTS_DIR.iterdir()) if (p / "config.json").is_file()}


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VisarError(f"cannot read {folder / 'config.json'}: {err}") from err


def list_models() -> list[str]:
    return ["default", *embedded_models(), *OFFICIAL_PRESETS, "llamagen"]


def describe_models() -> list[tuple[str, str]]:
    rows = [("default", f"alias of {DEFAULT_MODEL}")]
    rows += [(name, read_config(folder).get("description", "")) for name, folder in embedded_models().items()]
    rows += [(p.name, p.description) for p in OFFICIAL_PRESETS.values()]
    rows.append(("llamagen", "any LlamaGen checkpoint: pass checkpoint=, model_args= (official ModelArgs), vq_*"))
    return rows


def resolve_name(name: str) -> str:
    return DEFAULT_MODEL if name == "default" else name
