"""`visar.load`: a pipeline from a registered name, a Hub name, a model folder or official files.

Loading dispatches on the family (`visar.families`): config.json's "family" key, a Hugging Face
folder's architecture, or an official preset's. It builds the family's model and tokenizer, loads
their weights strictly and hands them to a `Pipeline` on the asked device and dtype.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import hub, registry
from .checkpoints import load_strict, read_state_dict, seeded_init
from .errors import VisarError
from .families import Family, get_family, hf_family
from .models.t5_captions import LazyTextEncoder
from .models.text import CaptionEncoder, CaptionEncoderConfig
from .pipeline import Pipeline, drafts

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise VisarError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise VisarError(f"unknown device {device!r}: use cpu, cuda or cuda:N (torch says: {err})") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VisarError(f"device {str(device)!r} was asked for but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise VisarError(f"device {str(device)!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise VisarError("device 'mps' was asked for but Apple's MPS backend is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise VisarError(f"device {str(device)!r} is not supported: use cpu, cuda or cuda:N")
    return device


def check_dtype(device: torch.device, dtype: torch.dtype):
    """One clear error for a generator dtype the device cannot run: bf16 on a GPU without it (before
    compute capability 8.0)."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise VisarError(f"bf16 is not supported on {name} ({device}): use --dtype fp16 or fp32 (dtype='fp16')")


def load(
    name_or_path: str | os.PathLike = "default",
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    checkpoint: str | os.PathLike | None = None,
    vq_checkpoint: str | os.PathLike | None = None,
    model_args: dict | None = None,
    vq_args: dict | None = None,
    vae_checkpoint: str | os.PathLike | None = None,
    vae_args: dict | None = None,
    revision: str | None = None,
    text_encoder: str | os.PathLike | None = None,
) -> Pipeline:
    """Load a pipeline by registered name, Hugging Face Hub name, folder with config.json, or official files.

    - `visar.load("default")`: the embedded default model.
    - `visar.load("deepseek-community/Janus-Pro-1B")`, `visar.load("BAAI/Emu3-Gen-hf")`,
      `visar.load("amused/amused-256")`: a Hub repository holding one of the folders below, fetched
      through huggingface_hub (its cache, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN; `revision=` a branch, tag
      or commit). Original-format names with a published conversion fetch the conversion
      (deepseek-ai/Janus-Pro-1B -> deepseek-community/Janus-Pro-1B, BAAI/Emu3-Gen -> BAAI/Emu3-Gen-hf).
    - `visar.load("llamagen-gpt-b-c2i-256")`, `visar.load("var-d16")`: an official preset without
      files fetches the released checkpoint and tokenizer from the Hub repository its authors publish
      them in (`visar models` lists them; MAR's releases are not on the Hub: its presets say where).
    - `visar.load(FOLDER)`: a visar folder, or a transformers `save_pretrained` folder of a supported
      architecture (Janus-Pro: JanusForConditionalGeneration; Emu3-Gen: Emu3ForConditionalGeneration),
      offline; `model_args=` then takes its loading options (Janus: `max_prompt_tokens`; Emu3:
      `image_area`, `ratio`, `negative_prompt`, `negative_prompt_format`, `max_prompt_tokens`; a
      negative prompt can also be given per call: `Pipeline.generate(negative_prompt=...)`). A diffusers
      `AmusedPipeline` folder (model_index.json) loads as a masked model (`model_args`: `negative_prompt`,
      `aesthetic_score`, `crop_coord`).
    - `visar.load("llamagen-gpt-b-c2i-256", checkpoint="c2i_B_256.pt", vq_checkpoint="vq_ds16_c2i.pt")`:
      files on disk (with checkpoint= and no vq_checkpoint=, no tokenizer: tokens only)
    - `visar.load("llamagen", checkpoint=..., model_args={...}, vq_checkpoint=..., vq_args={...})` for
      sizes that match no preset (`model_args`: LlamaGen ModelArgs fields; `vq_args`: the VQ
      ModelArgs plus `ch`, the encoder/decoder base width).
    - `visar.load("mar", checkpoint=..., model_args={...}, vae_checkpoint=..., vae_args={...})`: MAR
      (`model_args`: the official MAR constructor's; `vae_*`: the KL VAE, the family's tokenizer,
      the same as `vq_*`). Presets `mar-base`, `mar-large`, `mar-huge` take KL-16.
    - `visar.load("var-d16", checkpoint="var_d16.pth", vq_checkpoint="vae_ch160v4096z32.pth")`, or
      `visar.load("var", ...)` with the VAR constructor arguments (docs/VAR.md).
    text_encoder: for text-to-image LlamaGen (presets and `llamagen`), the T5 encoder that turns
    prompts= into caption embeddings, a folder or a Hub name; the t2i presets default to
    google/flan-t5-xl, fetched when prompts first need it (caption_embeds= never does).
    device: default CUDA when available, else CPU. dtype: fp32 (default), bf16 or fp16 for the
    generator; the tokenizer and text encoder stay in float32.
    """
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    check_dtype(device, dtype)
    vq_checkpoint = vae_checkpoint if vae_checkpoint is not None else vq_checkpoint
    vq_args = vae_args if vae_args is not None else vq_args
    name = registry.resolve_name(str(name_or_path))
    embedded = registry.embedded_models()
    generic = registry.generic_names()
    if revision is not None and not (name in registry.OFFICIAL_PRESETS or hub.is_hub_name(name)):
        what = f"picks a version of a Hub repository; {name!r} is not a Hub name nor a preset"
        raise VisarError(f"revision= {what}", cli=f"--revision {what}")
    if text_encoder is not None and not (name in registry.OFFICIAL_PRESETS or name in generic):
        what = f"names the T5 encoder of a text-to-image LlamaGen preset or `llamagen`; {name!r} is neither"
        raise VisarError(f"text_encoder= {what}", cli=f"--text-encoder {what}")
    if name in embedded or registry.is_model_folder(Path(name)):
        folder = embedded.get(name, Path(name))
        pipe = load_folder(folder, checkpoint=checkpoint, vq_checkpoint=vq_checkpoint, model_args=model_args)
    elif name in registry.OFFICIAL_PRESETS or name in generic:
        pipe = load_official(name, checkpoint, vq_checkpoint, model_args, vq_args, revision, text_encoder)
    elif Path(name).exists():
        what = f"{name} is not a model folder (no config.json, nor a diffusers model_index.json); for a checkpoint file"
        raise VisarError(
            f"{what} use visar.load('<preset>', checkpoint=...)", cli=f"{what} use --model PRESET --checkpoint FILE"
        )
    elif hub.is_hub_name(name):
        folder = hub.fetch_folder(name, revision)
        pipe = load_folder(folder, checkpoint=checkpoint, vq_checkpoint=vq_checkpoint, model_args=model_args)
        pipe.name = name
    else:
        raise VisarError(
            f"unknown model {name!r}: not a registered name, a Hub name (owner/name) nor an existing folder. "
            f"Known: {', '.join(registry.list_models())}"
        )
    pipe.model.to(device=device, dtype=dtype)
    if pipe.tokenizer is not None:
        pipe.tokenizer.to(device=device)
    if pipe.text_encoder is not None:
        pipe.text_encoder.to(device=device)
    return pipe


def fetch_release(name: str, preset, vq_checkpoint, revision):
    """A preset's released checkpoint (and its tokenizer, unless given) from its Hub repository."""
    if preset is None or preset.hub_files is None:
        note = f"{preset.release_note}; " if preset is not None and preset.release_note else ""
        raise VisarError(
            f"{note}{name} needs the checkpoint file: visar.load({name!r}, checkpoint=PATH, ...)",
            cli=f"{note}{name} needs the checkpoint file: --model {name} --checkpoint FILE ...",
        )
    model_file, tokenizer_file = preset.hub_files
    local = hub.LocalForm(
        f"by path: visar.load({name!r}, checkpoint=PATH, vq_checkpoint=PATH)",
        f"by path: --model {name} --checkpoint FILE --vq-checkpoint FILE",
    )
    checkpoint = hub.fetch_file(preset.hub_repo, model_file, revision, local)
    if vq_checkpoint is None:
        vq_checkpoint = hub.fetch_file(preset.hub_repo, tokenizer_file, revision, local)
    return checkpoint, vq_checkpoint


def load_official(name, checkpoint, vq_checkpoint, model_args, vq_args, revision=None, text_encoder=None) -> Pipeline:
    """An official preset, or a family's generic name with the official constructor arguments; a preset
    without checkpoint= fetches its release from the Hub."""
    presets = registry.OFFICIAL_PRESETS
    if checkpoint is None:
        checkpoint, vq_checkpoint = fetch_release(name, presets.get(name), vq_checkpoint, revision)
    elif revision is not None:
        raise VisarError(
            "revision= picks the Hub version of a preset's files; with checkpoint= the files are yours",
            cli="--revision picks the Hub version of a preset's files; with --checkpoint the files are yours",
        )
    if name in presets:
        preset = presets[name]
        family = get_family(preset.family)
        preset_args, defaults = {**preset.model_args, **(model_args or {})}, preset.defaults
        tokenizer_args = {**preset.tokenizer_args, **(vq_args or {})}
    else:
        family = registry.generic_names()[name]
        if model_args is None:
            raise VisarError(
                f"visar.load({name!r}, ...) needs model_args= (the official constructor arguments)",
                cli=f"--model {name} needs the official constructor arguments, each as --model-arg KEY=VALUE",
            )
        preset_args, defaults, tokenizer_args = model_args, {}, vq_args or {}
    if vq_args is not None and family.args_from_tokenizer is not None:
        preset_args = family.args_from_tokenizer(model_args or {}, preset_args, tokenizer_args)
    with torch.device("meta"):  # official files are large: take their tensors instead of initialising
        model = family.build_model(preset_args)
    model = family.load_model_weights(model, checkpoint, f"checkpoint {checkpoint}")
    tokenizer = None
    if vq_checkpoint is not None:
        tokenizer = family.load_tokenizer_weights(
            family.build_tokenizer(tokenizer_args), vq_checkpoint, f"tokenizer checkpoint {vq_checkpoint}"
        )
        if family.check_tokenizer is not None:
            family.check_tokenizer(model, tokenizer)
    preset = presets.get(name)
    return Pipeline(
        model, tokenizer, name=name, defaults=defaults, text_encoder=prompt_encoder(family, model, preset, text_encoder)
    )


def prompt_encoder(family: Family, model, preset, text_encoder):
    """The prompt encoder of a text-conditional official model: text_encoder= (loaded now), else the
    preset's own (loaded when prompts first need it), else none (caption_embeds= only)."""
    text_model = model.condition_layout.kind == "text"
    if text_encoder is not None:
        if family.load_text_encoder is None or not text_model:
            what = "is for text-to-image models; this one is class-conditional"
            raise VisarError(f"text_encoder= {what}", cli=f"--text-encoder {what}")
        return family.load_text_encoder(text_encoder, model)
    default = preset.text_encoder if preset is not None else None
    if default is None or family.load_text_encoder is None or not text_model:
        return None
    return LazyTextEncoder(lambda: family.load_text_encoder(default, model), default)


def folder_family(config: dict) -> Family:
    """config.json's "family"; a transformers config (no "family" nor "model_args", but "architectures" or
    "model_type") names its family by architecture, a diffusers model_index.json by pipeline class
    ("_class_name"); a folder without either holds LlamaGen arguments (the one family visar loaded
    before the key was read), so folders written then still load."""
    foreign = "architectures" in config or "model_type" in config or "_class_name" in config
    if "family" not in config and "model_args" not in config and foreign:
        return hf_family(config)
    return get_family(config.get("family", "llamagen"))


def load_folder(folder: Path, checkpoint=None, vq_checkpoint=None, model_args=None) -> Pipeline:
    """A folder with config.json: family, model_args, vq_args, defaults, weights (file names), init.

    A family that reads a whole folder its own way (a transformers save_pretrained folder) loads it
    itself; model_args then carries its loading options (e.g. max_prompt_tokens).
    """
    config = registry.read_model_config(folder)
    family = folder_family(config)
    if family.load_folder is not None:
        if checkpoint is not None or vq_checkpoint is not None:
            what = f"{folder} is read whole by the {family.name} family: its weights load from it, not from"
            raise VisarError(f"{what} checkpoint=", cli=f"{what} --checkpoint / --vq-checkpoint")
        parts = family.load_folder(folder, model_args)
        return Pipeline(
            parts.model,
            parts.tokenizer,
            name=folder.name,
            defaults=parts.defaults,
            text_encoder=parts.text_encoder,
            class_names=parts.class_names,
        )
    model = family.build_model(config["model_args"])
    tokenizer = family.build_tokenizer(config["vq_args"]) if "vq_args" in config else None
    weights = config.get("weights", {})
    init_seed = config.get("init", {}).get("random_seed")
    if init_seed is not None:
        seeded_init(model, init_seed)
        if tokenizer is not None:
            with torch.random.fork_rng(devices=[]):  # PyTorch's default conv init, seeded
                torch.manual_seed(init_seed)
                tokenizer = family.build_tokenizer(config["vq_args"])
    model_file = checkpoint or (registry.weights_file(folder, weights, "model") if "model" in weights else None)
    if model_file is not None:
        family.load_model_weights(model, model_file, f"{folder.name} weights {model_file}")
    vq_file = vq_checkpoint or (registry.weights_file(folder, weights, "tokenizer") if "tokenizer" in weights else None)
    if vq_file is not None and tokenizer is not None:
        family.load_tokenizer_weights(tokenizer, vq_file, f"{folder.name} tokenizer {vq_file}")
    if tokenizer is not None and family.check_tokenizer is not None:
        family.check_tokenizer(model, tokenizer)
    if model_file is None and init_seed is None:
        raise VisarError(f"{folder} names no weights and no random init seed in config.json")
    text_encoder = None
    if "text_encoder_args" in config:
        text_encoder = CaptionEncoder(CaptionEncoderConfig.from_dict(config["text_encoder_args"]))
        path = registry.weights_file(folder, weights, "text_encoder")
        load_strict(text_encoder, read_state_dict(path), source=f"{folder.name} text encoder {path}")
        text_encoder.float().eval()
    model.float()
    return Pipeline(
        model,
        tokenizer,
        name=config.get("name", folder.name),
        defaults=config.get("defaults"),
        class_names=config.get("class_names"),
        text_encoder=text_encoder,
        recipe=config.get("recipe"),
    )


drafts.DRAFT_LOADER = load  # drafts given by name (Pipeline.resolve_draft) load as visar.load does
