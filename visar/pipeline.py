"""`visar.load` and the `Pipeline` every command, benchmark and demo goes through."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from . import registry
from .accel import get_method
from .accel.sampling import SamplingParams, make_generators
from .checkpoints import load_strict, read_state_dict
from .data.shapes import class_render_options
from .errors import VisarError
from .models.llamagen import GPT_SIZES, LlamaGen, LlamaGenConfig, preset_config
from .models.text import CaptionEncoder, CaptionEncoderConfig
from .tokenizers.vq import VQ_PRESETS, VQConfig, VQModel

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
    except RuntimeError as err:
        raise VisarError(f"unknown device {device!r}: {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VisarError("device 'cuda' was asked for but CUDA is not available on this machine")
    return device


@dataclass
class GenerationOutput:
    images: list[Image.Image] | Tensor | np.ndarray | None
    tokens: Tensor  # [B, h, w]
    stats: dict[str, Any] = field(default_factory=dict)


class Pipeline:
    """A generator (LlamaGen-family) with its tokenizer and default sampling settings."""

    def __init__(
        self,
        model: LlamaGen,
        tokenizer: VQModel | None,
        *,
        name: str,
        defaults: dict | None = None,
        class_names: list[str] | None = None,
        text_encoder=None,
        class_render: dict | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer.eval() if tokenizer is not None else None
        self.name = name
        self.defaults = {"guidance_scale": 1.0, "temperature": 1.0, "top_k": None, "top_p": 1.0, **(defaults or {})}
        self.class_names = class_names
        self.text_encoder = text_encoder
        # render_class options of the shapes-world data the model was trained on (ground truth to compare with)
        self.class_render = dict(class_render or {})

    def compile(self, **compile_kwargs) -> Pipeline:
        """torch.compile the generator in place (`nn.Module.compile`), so every method's forward passes use it.

        Each new input shape (batch size, window, cache length) compiles on its first call; outputs
        match eager mode up to kernel numerics. compile_kwargs go to torch.compile.
        """
        self.model.compile(**compile_kwargs)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.output.weight.dtype

    @property
    def is_class_conditional(self) -> bool:
        return self.model.config.model_type == "c2i"

    @property
    def num_classes(self) -> int:
        return self.model.config.num_classes

    # -- conditions -------------------------------------------------------------------------
    def class_condition(self, class_labels) -> Tensor:
        if not self.is_class_conditional:
            raise VisarError(f"{self.name} is text-conditional: pass prompts=, not class_labels=")
        labels = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1)
        bad = labels[(labels < 0) | (labels >= self.num_classes)]
        if bad.numel():
            raise VisarError(
                f"class id {bad[0].item()} out of range: {self.name} has classes 0..{self.num_classes - 1}"
            )
        return labels.to(self.device)

    def text_condition(self, prompts, caption_embeds, caption_mask) -> tuple[Tensor, Tensor | None]:
        if self.is_class_conditional:
            raise VisarError(f"{self.name} is class-conditional: pass class_labels=, not prompts=")
        if caption_embeds is not None:
            mask = None if caption_mask is None else torch.as_tensor(caption_mask).bool().to(self.device)
            return torch.as_tensor(caption_embeds).to(self.device, self.dtype), mask
        if prompts is None:
            raise VisarError("a text-conditional model needs prompts= (or caption_embeds=)")
        if self.text_encoder is None:
            raise VisarError(
                f"{self.name} has no text encoder: pass caption_embeds= [B, {self.model.config.cls_token_num}, "
                f"{self.model.config.caption_dim}] (for official LlamaGen: flan-t5-xl embeddings, left-padded)"
            )
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        embeds, mask = self.text_encoder.encode(prompts)
        return embeds.to(self.device, self.dtype), mask.to(self.device)

    def condition(self, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None):
        if class_labels is not None:
            return self.class_condition(class_labels), None
        if prompts is not None or caption_embeds is not None:
            return self.text_condition(prompts, caption_embeds, caption_mask)
        raise VisarError("nothing to condition on: pass class_labels= or prompts=")

    def sampling_params(self, guidance_scale=None, temperature=None, top_k=None, top_p=None) -> SamplingParams:
        given = {"guidance_scale": guidance_scale, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        merged = {k: (self.defaults[k] if v is None else v) for k, v in given.items()}
        if merged["top_k"] == 0:  # 0 is the CLI's "off"
            merged["top_k"] = None
        return SamplingParams(**merged)

    # -- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        class_labels=None,
        prompts=None,
        *,
        method: str = "ar",
        seed: int = 0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        guidance_scale: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        output_type: str = "pil",
        caption_embeds=None,
        caption_mask=None,
        progress: bool = False,
        **method_options,
    ) -> GenerationOutput:
        """Generate one image per class label / prompt.

        Sampling settings left None take the model's defaults (`self.defaults`). Image i of the
        batch draws from its own generator, seeded `seed + i` unless `generator` (one per image,
        or a single one for a single image) is given. output_type: "pil" (list of PIL images),
        "pt" (float tensor [B, 3, H, W] in [0, 1]), "np" (uint8 [B, H, W, 3]) or "tokens".
        stats: forward_passes, tokens_per_forward, latency_s (token sampling wall time),
        decode_s, method, lossless, plus what the method reports.
        """
        if output_type not in ("pil", "pt", "np", "tokens"):
            raise VisarError(f"output_type must be 'pil', 'pt', 'np' or 'tokens', got {output_type!r}")
        spec = get_method(method)
        spec.check_options(method_options)
        params = self.sampling_params(guidance_scale, temperature, top_k, top_p)
        cond, cond_mask = self.condition(class_labels, prompts, caption_embeds, caption_mask)
        batch = cond.shape[0]
        if generator is None:
            generators = make_generators(batch, seed)
        else:
            generators = [generator] if isinstance(generator, torch.Generator) else list(generator)
            if len(generators) != batch:
                raise VisarError(f"got {len(generators)} generators for {batch} images: pass one per image")
        if spec.takes_tokenizer:  # methods that compare models (spec's draft) check tokenizers too
            method_options["tokenizer"] = self.tokenizer
        tokens, stats = spec.fn(
            self.model, cond, params, generators, cond_mask=cond_mask, progress=progress, **method_options
        )
        tokens = tokens.reshape(batch, *self.model.grid_size)
        stats = {**stats, "method": method, "lossless": spec.lossless, "batch_size": batch}
        images = None
        if output_type != "tokens":
            start = time.perf_counter()
            images = self.to_output(self.decode(tokens), output_type)
            stats["decode_s"] = time.perf_counter() - start
        return GenerationOutput(images=images, tokens=tokens, stats=stats)

    def decode(self, tokens: Tensor) -> Tensor:
        """tokens [B, h, w] -> images [B, 3, H, W] in [0, 1]."""
        if self.tokenizer is None:
            raise VisarError(f"{self.name} has no tokenizer loaded (pass vq_checkpoint=), or use output_type='tokens'")
        with torch.no_grad():
            images = self.tokenizer.decode(tokens.to(next(self.tokenizer.parameters()).device))
        return ((images.float() + 1) / 2).clamp(0, 1)

    @staticmethod
    def to_output(images: Tensor, output_type: str):
        if output_type == "pt":
            return images
        array = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return array if output_type == "np" else [Image.fromarray(a) for a in array]

    @torch.no_grad()
    def logits(self, tokens: Tensor, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None) -> Tensor:
        """Teacher-forced conditional next-token logits [B, N, V]: row i predicts tokens[:, i]."""
        cond, cond_mask = self.condition(class_labels, prompts, caption_embeds, caption_mask)
        tokens = torch.as_tensor(tokens).reshape(cond.shape[0], -1).to(self.device)
        out = self.model(tokens[:, :-1], cond, cond_mask=cond_mask)
        return out[:, self.model.num_condition_tokens - 1 :]


# -- loading -------------------------------------------------------------------------------------


def build_model(model_args: dict) -> LlamaGen:
    return LlamaGen(LlamaGenConfig.from_dict(model_args))


def gpt_presets(config: LlamaGenConfig) -> dict:
    """Builders of every official size with this config's type, vocabulary and condition layout."""
    shared = dict(
        vocab_size=config.vocab_size,
        num_classes=config.num_classes,
        cls_token_num=config.cls_token_num,
        caption_dim=config.caption_dim,
    )
    return {
        f"llamagen-{size.lower()}-{config.model_type}": (
            lambda size=size: LlamaGen(preset_config(size, config.model_type, config.block_size, **shared))
        )
        for size in GPT_SIZES
    }


def load_model_weights(model: LlamaGen, path, source: str) -> LlamaGen:
    state = read_state_dict(path)
    # Official files may carry the RoPE table or, saved after generation, KV-cache buffers:
    # neither is a weight (the official loaders drop/ignore them too).
    state = {k: v for k, v in state.items() if k != "freqs_cis" and ".kv_cache." not in k}
    meta = any(p.is_meta for p in model.parameters())  # built on meta: take the loaded tensors
    return load_strict(model, state, source=source, presets=gpt_presets(model.config), assign=meta)


def load_tokenizer_weights(tokenizer: VQModel, path, source: str) -> VQModel:
    presets = {name: (lambda c=c: VQModel(c)) for name, c in VQ_PRESETS.items()}
    return load_strict(tokenizer, read_state_dict(path), source=source, presets=presets)


def seeded_init(module: torch.nn.Module, seed: int, std: float = 0.02):
    """Deterministic random weights (for visar-tiny-random): N(0, std) for linear/embedding."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() >= 2:  # norms keep their ones
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def load(
    name_or_path: str | os.PathLike = "default",
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    checkpoint: str | os.PathLike | None = None,
    vq_checkpoint: str | os.PathLike | None = None,
    model_args: dict | None = None,
    vq_args: dict | None = None,
) -> Pipeline:
    """Load a pipeline by registered name, from a folder with config.json, or from official files.

    - `visar.load("default")`: the embedded default model.
    - `visar.load("llamagen-gpt-b-c2i-256", checkpoint="c2i_B_256.pt", vq_checkpoint="vq_ds16_c2i.pt")`
    - `visar.load("llamagen", checkpoint=..., model_args={...}, vq_checkpoint=..., vq_args={...})` for
      sizes that match no preset (`model_args`: LlamaGen ModelArgs fields; `vq_args`: the VQ
      ModelArgs plus `ch`, the encoder/decoder base width).
    device: default CUDA when available, else CPU. dtype: fp32 (default), bf16 or fp16 for the
    generator; the tokenizer stays in float32.
    """
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    name = registry.resolve_name(str(name_or_path))
    embedded = registry.embedded_models()
    if name in embedded or (Path(name).is_dir() and (Path(name) / "config.json").is_file()):
        folder = embedded.get(name, Path(name))
        pipe = load_folder(folder, checkpoint=checkpoint, vq_checkpoint=vq_checkpoint)
    elif name in registry.OFFICIAL_PRESETS or name == "llamagen":
        pipe = load_official(name, checkpoint, vq_checkpoint, model_args, vq_args)
    elif Path(name).exists():
        raise VisarError(
            f"{name} is not a model folder (no config.json); for a checkpoint file use "
            "visar.load('<preset>', checkpoint=...)"
        )
    else:
        raise VisarError(
            f"unknown model {name!r}: not a registered name nor an existing folder. Known: "
            f"{', '.join(registry.list_models())}"
        )
    pipe.model.to(device=device, dtype=dtype)
    if pipe.tokenizer is not None:
        pipe.tokenizer.to(device=device)
    if pipe.text_encoder is not None:
        pipe.text_encoder.to(device=device)
    return pipe


def load_official(name, checkpoint, vq_checkpoint, model_args, vq_args) -> Pipeline:
    if checkpoint is None:
        raise VisarError(f"{name} needs the official checkpoint file: visar.load({name!r}, checkpoint=PATH, ...)")
    if name == "llamagen":
        if model_args is None:
            raise VisarError("visar.load('llamagen', ...) needs model_args= (the official ModelArgs fields)")
        preset_args, defaults, vq_config = model_args, {}, VQConfig.from_dict(vq_args or {})
    else:
        preset = registry.OFFICIAL_PRESETS[name]
        preset_args, defaults = {**preset.model_args, **(model_args or {})}, preset.defaults
        vq_config = VQConfig.from_dict({**VQ_PRESETS[preset.vq_preset].to_dict(), **(vq_args or {})})
    with torch.device("meta"):
        model = build_model(preset_args)
    model = load_model_weights(model, checkpoint, f"checkpoint {checkpoint}")
    tokenizer = None
    if vq_checkpoint is not None:
        tokenizer = load_tokenizer_weights(VQModel(vq_config), vq_checkpoint, f"VQ checkpoint {vq_checkpoint}")
    return Pipeline(model, tokenizer, name=name, defaults=defaults)


def load_folder(folder: Path, checkpoint=None, vq_checkpoint=None) -> Pipeline:
    """A folder with config.json: model_args, vq_args, defaults, weights (file names), init."""
    config = registry.read_config(folder)
    model = build_model(config["model_args"])
    tokenizer = VQModel(VQConfig.from_dict(config["vq_args"])) if "vq_args" in config else None
    weights = config.get("weights", {})
    init_seed = config.get("init", {}).get("random_seed")
    if init_seed is not None:
        seeded_init(model, init_seed)
        if tokenizer is not None:
            with torch.random.fork_rng(devices=[]):  # PyTorch's default conv init, seeded
                torch.manual_seed(init_seed)
                tokenizer = VQModel(tokenizer.config)
    model_file = checkpoint or (folder / weights["model"] if "model" in weights else None)
    if model_file is not None:
        load_model_weights(model, model_file, f"{folder.name} weights {model_file}")
    vq_file = vq_checkpoint or (folder / weights["tokenizer"] if "tokenizer" in weights else None)
    if vq_file is not None and tokenizer is not None:
        load_tokenizer_weights(tokenizer, vq_file, f"{folder.name} tokenizer {vq_file}")
    if model_file is None and init_seed is None:
        raise VisarError(f"{folder} names no weights and no random init seed in config.json")
    text_encoder = None
    if "text_encoder_args" in config:
        text_encoder = CaptionEncoder(CaptionEncoderConfig.from_dict(config["text_encoder_args"]))
        path = folder / weights["text_encoder"]
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
        class_render=class_render_options(config.get("recipe")),
    )
