"""Proxy models: a trained embedded model's law at a full-size LlamaGen's cost (`visar.models.proxy`).

`visar-proxy-gpt-b`, `-gpt-l` and `-gpt-xl` are folders in visar/weights whose config.json reads

    {"family": "proxy", "law": "visar-tiny-c2i", "cost": "GPT-B", "init": {"random_seed": 0}}

"law": a LlamaGen folder with trained weights (an embedded model's name, or a path), whose logits,
tokenizer, sampling defaults and class names the proxy takes whole; "cost": a LlamaGen size
(`GPT_SIZES`) or a dict of LlamaGen model_args (vocabulary and classes by default the official
16,384 codes and 1,000 classes), over the law's sequence (its condition layout and image tokens),
its weights drawn from `init.random_seed`. No weights are shipped for a proxy: the law's are the embedded model's, the
cost model's are seeded.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoints import load_strict, read_state_dict, seeded_init
from ..errors import VisarError
from ..models.llamagen import GPT_SIZES, LlamaGen, LlamaGenConfig
from ..models.proxy import LawCostProxy
from . import llamagen
from .family import Family, FolderParts, register_family

# registry.WEIGHTS_DIR, and read_json below its read_config: registry imports the families, so a family
# cannot import it (tests/test_architecture.py)
WEIGHTS_DIR = Path(__file__).parents[1] / "weights"

# What the official releases read beside their size: LlamaGen's VQ-16 codes and ImageNet's classes.
OFFICIAL_VOCAB, OFFICIAL_CLASSES = 16384, 1000


def cost_config(law: LlamaGenConfig, cost: str | dict) -> LlamaGenConfig:
    """The cost model: a LlamaGen size or model_args, over the law's sequence (condition and image tokens)."""
    if isinstance(cost, str):
        if cost not in GPT_SIZES:
            raise VisarError(f"a proxy's cost {cost!r} is no LlamaGen size; known: {', '.join(GPT_SIZES)}")
        cost = GPT_SIZES[cost]
    sequence = {key: getattr(law, key) for key in ("model_type", "block_size", "cls_token_num", "caption_dim")}
    args = {"vocab_size": OFFICIAL_VOCAB, "num_classes": max(OFFICIAL_CLASSES, law.num_classes), **cost, **sequence}
    return LlamaGenConfig.from_dict(args)


def build_model(model_args: dict) -> LawCostProxy:
    """model_args {"law": LlamaGen model_args, "cost": a size or model_args} -> the proxy, both models untrained."""
    law = llamagen.build_model(model_args["law"])
    return LawCostProxy(law, LlamaGen(cost_config(law.config, model_args["cost"])))


def load_model_weights(model: LawCostProxy, path, source: str) -> LawCostProxy:
    """A whole proxy's state_dict (law.* and cost.* keys), strictly."""
    return load_strict(model, read_state_dict(path), source=source)


def law_folder(law: str) -> Path:
    folder = WEIGHTS_DIR / law if (WEIGHTS_DIR / law / "config.json").is_file() else Path(law)
    if not (folder / "config.json").is_file():
        raise VisarError(f"a proxy's law {law!r} is neither an embedded model nor a folder with config.json")
    return folder


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VisarError(f"cannot read {path}: {err}") from err


def load_folder(folder, model_args: dict | None) -> FolderParts:
    """A proxy folder: the law's trained model and tokenizer from its folder, the cost model seeded."""
    folder = Path(folder)
    config = read_json(folder / "config.json")
    if model_args:
        raise VisarError(f"{folder.name} is a proxy: its models' arguments are its config's, not model_args=")
    missing = [key for key in ("law", "cost") if key not in config]
    if "random_seed" not in config.get("init", {}):
        missing.append("init.random_seed")
    if missing:
        raise VisarError(f"{folder / 'config.json'} is a proxy's config without {', '.join(missing)}")
    source = law_folder(config["law"])
    law_config = read_json(source / "config.json")
    if law_config.get("family", "llamagen") != "llamagen" or "model" not in law_config.get("weights", {}):
        raise VisarError(f"a proxy's law must be a trained LlamaGen folder; {source} is not one")
    law = llamagen.build_model(law_config["model_args"])
    llamagen.load_model_weights(law, source / law_config["weights"]["model"], f"{source.name} weights")
    tokenizer = None
    if "vq_args" in law_config and "tokenizer" in law_config["weights"]:
        tokenizer = llamagen.build_tokenizer(law_config["vq_args"])
        path = source / law_config["weights"]["tokenizer"]
        llamagen.load_tokenizer_weights(tokenizer, path, f"{source.name} tokenizer")
    cost = LlamaGen(cost_config(law.config, config["cost"]))
    seeded_init(cost, config["init"]["random_seed"])
    return FolderParts(
        LawCostProxy(law, cost).float(),
        tokenizer,
        defaults=law_config.get("defaults", {}),
        class_names=law_config.get("class_names"),
    )


register_family(
    Family(
        name="proxy",
        model_kind="raster",
        build_model=build_model,
        load_model_weights=load_model_weights,
        build_tokenizer=llamagen.build_tokenizer,
        load_tokenizer_weights=llamagen.load_tokenizer_weights,
        official_presets={},
        # the tiny LlamaGen as the law, a second one twice as wide as the cost (a small head: the tests that
        # loop over families stay quick; tests/models/test_proxy.py runs the official head)
        tiny_model_args={
            "law": llamagen.TINY_MODEL_ARGS,
            "cost": dict(dim=64, n_layer=2, n_head=2, multiple_of=32, vocab_size=64),
        },
        tiny_tokenizer_args=llamagen.TINY_TOKENIZER_ARGS,
        load_folder=load_folder,
        title="visar proxies (a trained model's law at a LlamaGen size's cost, for speed figures)",
    )
)
