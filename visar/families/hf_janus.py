"""The Janus family: transformers' `JanusForConditionalGeneration` (Janus, Janus-Pro) in image-generation mode.

A transformers `save_pretrained` folder (config.json with "architectures":
["JanusForConditionalGeneration"], the safetensors, the processor and tokenizer files, and
generation_config.json) loads with `visar.load(FOLDER)`, offline; transformers is an optional
dependency (`pip install "visar-ar[hf]"`), imported only when such a model is built.

Sampling defaults: the generation config's guidance scale (Janus-Pro ships 5; 5 when unset, as
transformers' image generation defaults), temperature 1, no top-k or top-p (deepseek-ai/Janus's
`generation_inference.py`: cfg_weight 5, temperature 1).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import VisarError
from ..models.hf_janus import HFJanus, split_vq
from ..models.hf_prompts import HFPromptEncoder
from ..tokenizers.hf_vq import HFVQTokenizer
from .family import Family, FolderParts, register_family, transformers_module

ARCHITECTURES = ("JanusForConditionalGeneration",)
# Condition positions for the prompt (chat template and <begin_of_image> included), left-padded.
DEFAULT_MAX_PROMPT_TOKENS = 128
# transformers' image generation defaults guidance_scale to 5 when the generation config has none.
DEFAULT_GUIDANCE = 5.0


def special_ids(generation_config) -> dict:
    """bos, pad and <begin_of_image> ids, from where transformers' image generation reads them."""
    boi = (generation_config.generation_kwargs or {}).get("boi_token_id")
    ids = dict(
        bos_token_id=generation_config.bos_token_id, pad_token_id=generation_config.pad_token_id, boi_token_id=boi
    )
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise VisarError(f"the Janus generation config lacks {', '.join(missing)} (generation_config.json)")
    return ids


def build_model(model_args: dict) -> HFJanus:
    """model_args: "config" (a JanusConfig dict), "max_prompt_tokens", "bos/pad/boi_token_id"."""
    transformers = transformers_module()
    config = transformers.JanusConfig(**model_args["config"])
    hf_model = transformers.JanusForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    split_vq(hf_model)  # the tokenizer builds its own (build_tokenizer)
    ids = {k: model_args[k] for k in ("bos_token_id", "pad_token_id", "boi_token_id")}
    return HFJanus(hf_model.eval(), max_prompt_tokens=model_args.get("max_prompt_tokens", 32), **ids)


def build_tokenizer(tokenizer_args: dict) -> HFVQTokenizer:
    """tokenizer_args: a JanusVQVAEConfig dict."""
    transformers = transformers_module()
    vq = transformers.JanusVQVAE._from_config(transformers.JanusVQVAEConfig(**tokenizer_args))
    return HFVQTokenizer(vq.eval())


def load_weights_elsewhere(module, path, source: str):
    loads = f"{source}: a Janus model loads from its transformers folder, weights included:"
    raise VisarError(f"{loads} visar.load(FOLDER)", cli=f"{loads} --model FOLDER")


def load_folder(folder: os.PathLike, model_args: dict | None = None) -> FolderParts:
    """A transformers save_pretrained folder -> model (float32, sdpa attention), VQ tokenizer, prompt encoder."""
    transformers = transformers_module()
    folder = Path(folder)
    options = dict(model_args or {})
    max_prompt_tokens = int(options.pop("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS))
    if options:
        what = f"{sorted(options)} for a Janus folder; known: ['max_prompt_tokens']"
        raise VisarError(f"unknown model_args {what}", cli=f"unknown --model-arg {what}")
    hf_model = transformers.JanusForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    generation_config = hf_model.generation_config
    ids = special_ids(generation_config)
    tokenizer = HFVQTokenizer(split_vq(hf_model).eval())
    model = HFJanus(hf_model.eval(), max_prompt_tokens=max_prompt_tokens, **ids)
    processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    text_encoder = HFPromptEncoder(processor, max_prompt_tokens, ids["pad_token_id"], {"generation_mode": "image"})
    defaults = {
        "guidance_scale": float(generation_config.guidance_scale or DEFAULT_GUIDANCE),
        "temperature": 1.0,
        "top_k": None,
        "top_p": 1.0,
    }
    return FolderParts(model, tokenizer, text_encoder, defaults)


# -- a tiny random Janus, for the tests (tests/accel/test_method_conformance.py, tests/models/test_hf_janus.py) --

TINY_SPECIAL_TOKENS = [
    "<bos>",
    "<pad>",
    "<unk>",
    "<begin_of_image>",
    "<end_of_image>",
    "<image_placeholder>",
    "<|User|>",
    "<|Assistant|>",
]
TINY_WORDS = [":", "a", "an", "the", "of", "on", "in", "red", "green", "blue", "circle", "square", "triangle", "dog"]
TINY_SPECIAL_IDS = dict(bos_token_id=0, pad_token_id=1, boi_token_id=3)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|User|>: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)


def tiny_config(grid: int = 4, image_vocab: int = 8, text_vocab: int = 32) -> dict:
    """A JanusConfig dict: 2-layer Llama (GQA), grid x grid image tokens, a VQ with image_vocab codes."""
    return dict(
        text_config=dict(
            model_type="llama",
            vocab_size=text_vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=0,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=4 * grid,
            patch_size=4,
            projection_dim=32,
            num_image_tokens=grid * grid,
            mlp_ratio=2.0,
        ),
        vq_config=tiny_vq_config(grid, image_vocab),
        image_token_id=5,
    )


def tiny_vq_config(grid: int = 4, image_vocab: int = 8) -> dict:
    return dict(
        num_patches=grid,
        embed_dim=4,
        num_embeddings=image_vocab,
        latent_channels=32,
        base_channels=32,
        channel_multiplier=[1, 1],
        num_res_blocks=1,
        projection_dim=32,
        image_token_embed_dim=32,
        num_hidden_layers=2,
    )


def tiny_processor():
    """A JanusProcessor over a word-level tokenizer of TINY_SPECIAL_TOKENS + TINY_WORDS (no files)."""
    transformers = transformers_module()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(TINY_SPECIAL_TOKENS + TINY_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(TINY_SPECIAL_TOKENS)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    return transformers.JanusProcessor(
        image_processor=transformers.JanusImageProcessor(), tokenizer=tokenizer, chat_template=TINY_CHAT_TEMPLATE
    )


def build_text_encoder(text_encoder_args: dict) -> HFPromptEncoder:
    """The tiny processor as a prompt encoder (text_encoder_args: max_prompt_tokens)."""
    max_tokens = text_encoder_args.get("max_prompt_tokens", 32)
    return HFPromptEncoder(tiny_processor(), max_tokens, TINY_SPECIAL_IDS["pad_token_id"], {"generation_mode": "image"})


TINY_MODEL_ARGS = dict(config=tiny_config(), max_prompt_tokens=16, **TINY_SPECIAL_IDS)

register_family(
    Family(
        name="hf-janus",
        model_kind="raster",
        build_model=build_model,
        load_model_weights=load_weights_elsewhere,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_weights_elsewhere,
        official_presets={},
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=tiny_vq_config(),
        architectures=ARCHITECTURES,
        title="Janus-Pro",
        hub_names=("deepseek-community/Janus-Pro-1B", "deepseek-community/Janus-Pro-7B"),
        extra="hf",
        load_folder=load_folder,
        build_text_encoder=build_text_encoder,
        tiny_text_encoder_args={"max_prompt_tokens": 16},
    )
)
