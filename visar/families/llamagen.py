"""The LlamaGen family: LlamaGen GPT (class- and text-conditional raster AR) with LlamaGen's VQ tokenizer.

Official releases (FoundationVision/LlamaGen): GPT-B .. GPT-3B class-conditional at 256 and 384
px, GPT-XL text-to-image at 256 and 512 px, each with VQ-16. Their files load strictly; the
RoPE table or KV-cache buffers some files carry are not weights and are dropped, as the
official loaders do. `visar.load(preset)` fetches the released files from the Hub repositories the
LlamaGen README links: FoundationVision/LlamaGen (c2i_B_256.pt ... c2i_3B_384.pt, vq_ds16_c2i.pt)
and peizesun/llamagen_t2i (t2i_XL_stage1_256.pt, t2i_XL_stage2_512.pt, vq_ds16_t2i.pt).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import hub
from ..checkpoints import load_strict, read_state_dict
from ..errors import VisarError
from ..models.llamagen import GPT_SIZES, LlamaGen, LlamaGenConfig, preset_config
from ..models.t5_captions import T5CaptionEncoder, check_caption_width
from ..tokenizers.vq import VQ_PRESETS, VQConfig, VQModel
from .family import Family, OfficialPreset, register_family, transformers_module


def build_model(model_args: dict) -> LlamaGen:
    return LlamaGen(LlamaGenConfig.from_dict(model_args))


def size_presets(config: LlamaGenConfig) -> dict:
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
    return load_strict(model, state, source=source, presets=size_presets(model.config), assign=meta)


def build_tokenizer(tokenizer_args: dict) -> VQModel:
    return VQModel(VQConfig.from_dict(tokenizer_args))


def load_tokenizer_weights(tokenizer: VQModel, path, source: str) -> VQModel:
    presets = {name: (lambda c=c: VQModel(c)) for name, c in VQ_PRESETS.items()}
    return load_strict(tokenizer, read_state_dict(path), source=source, presets=presets)


# The prompt encoder of the t2i releases (LlamaGen's language/README: google/flan-t5-xl), and the files of
# its Hub repository a T5EncoderModel and its tokenizer need.
T5_ENCODER = "google/flan-t5-xl"
T5_FILES = ["*.json", "*.safetensors", "spiece.model"]


def load_text_encoder(name_or_folder, model: LlamaGen) -> T5CaptionEncoder:
    """A T5 encoder (folder or Hub name) giving the model's captions: its condition length (120) as max length."""
    transformers = transformers_module()
    name = str(name_or_folder)
    folder = Path(name)
    if not folder.is_dir():
        if not hub.is_hub_name(name):
            raise VisarError(f"text encoder {name!r} is neither a folder nor a Hub name (owner/name)")
        folder = hub.fetch_folder(name, allow_patterns=T5_FILES)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        encoder = transformers.T5EncoderModel.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VisarError(f"cannot load a T5 encoder and its tokenizer from {folder}: {reason}") from err
    layout = model.condition_layout
    captions = T5CaptionEncoder(tokenizer, encoder, max_length=layout.num_tokens)
    check_caption_width(captions, layout.embed_dim, name)
    return captions


# Where the LlamaGen README publishes each release: (size, px) -> file in C2I_REPO; t2i files in T2I_REPO.
C2I_REPO, T2I_REPO = "FoundationVision/LlamaGen", "peizesun/llamagen_t2i"
C2I_FILES = {
    ("GPT-B", 256): "c2i_B_256.pt",
    ("GPT-B", 384): "c2i_B_384.pt",
    ("GPT-L", 256): "c2i_L_256.pt",
    ("GPT-L", 384): "c2i_L_384.pt",
    ("GPT-XL", 384): "c2i_XL_384.pt",
    ("GPT-XXL", 384): "c2i_XXL_384.pt",
    ("GPT-3B", 384): "c2i_3B_384.pt",
}
T2I_FILES = {256: "t2i_XL_stage1_256.pt", 512: "t2i_XL_stage2_512.pt"}


def official_presets() -> dict[str, OfficialPreset]:
    presets = {}
    vq16 = VQ_PRESETS["VQ-16"].to_dict()
    for size in GPT_SIZES:
        for px, tokens in ((256, 256), (384, 576)):
            name = f"llamagen-{size.lower()}-c2i-{px}"
            released = C2I_FILES.get((size, px))
            where = f"{released} + vq_ds16_c2i.pt from {C2I_REPO}" if released else "no release: --checkpoint FILE"
            presets[name] = OfficialPreset(
                name,
                "llamagen",
                f"LlamaGen {size} class-conditional ImageNet {px}px ({where})",
                preset_config(size, "c2i", tokens).to_dict(),
                vq16,
                # LlamaGen's sample_c2i.py defaults.
                {"guidance_scale": 4.0, "temperature": 1.0, "top_k": None, "top_p": 1.0},
                hub_repo=C2I_REPO if released else None,
                hub_files=(released, "vq_ds16_c2i.pt") if released else None,
                release_note="" if released else f"LlamaGen released no {size} model at {px} px",
            )
    for px, tokens in ((256, 256), (512, 1024)):
        name = f"llamagen-gpt-xl-t2i-{px}"
        presets[name] = OfficialPreset(
            name,
            "llamagen",
            f"LlamaGen GPT-XL text-to-image {px}px ({T2I_FILES[px]} + vq_ds16_t2i.pt from {T2I_REPO}; prompts "
            f"through {T5_ENCODER}, fetched on first use)",
            preset_config("GPT-XL", "t2i", tokens).to_dict(),
            vq16,
            {"guidance_scale": 7.5, "temperature": 1.0, "top_k": None, "top_p": 1.0},
            hub_repo=T2I_REPO,
            hub_files=(T2I_FILES[px], "vq_ds16_t2i.pt"),
            text_encoder=T5_ENCODER,
        )
    return presets


# A 4x4-token, 8-code model and a matching 8 px VQ: enough for every raster method's mechanics.
TINY_MODEL_ARGS = dict(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=8, num_classes=4, block_size=16)
TINY_TOKENIZER_ARGS = dict(
    codebook_size=8, codebook_embed_dim=4, ch=32, encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2], z_channels=32
)

register_family(
    Family(
        name="llamagen",
        model_kind="raster",
        build_model=build_model,
        load_model_weights=load_model_weights,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_tokenizer_weights,
        official_presets=official_presets(),
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=TINY_TOKENIZER_ARGS,
        generic_name="llamagen",
        title="LlamaGen",
        generic_description="any LlamaGen checkpoint: --checkpoint FILE, the official ModelArgs as --model-arg "
        "KEY=VALUE, --vq-checkpoint FILE; t2i: --text-encoder (a T5 folder or Hub name) for prompts",
        load_text_encoder=load_text_encoder,
    )
)
