"""The MAR family: MAR-B / L / H (class-conditional ImageNet 256, continuous tokens) with the KL-16 VAE.

Official releases (LTH14/mar): `{'model': ..., 'model_ema': ...}` files; the demo samples with
`model_ema`, loaded strictly, and so does visar. A file without `model_ema` loads `model` (the
training weights) with a warning that says so. KL-16 is `{'model': state_dict}`; upstream loads it
with strict=False, visar strictly (its keys match exactly). The MAR README publishes the releases
on Dropbox, not on the Hugging Face Hub: `visar.load("mar-base")` says where, and the files load by
path (`checkpoint=`, `vae_checkpoint=`).
"""

from __future__ import annotations

import warnings

from ..checkpoints import load_strict, read_state_dict
from ..errors import VisarError
from ..models.mar import MAR, MAR_SIZES, MARConfig, preset_config
from ..tokenizers.kl import KL16, AutoencoderKL, KLConfig
from .family import Family, OfficialPreset, register_family


def build_model(model_args: dict) -> MAR:
    return MAR(MARConfig.from_dict(model_args))


def read_ema_state(path) -> dict:
    """`model_ema` of an official file, else its `model` (saying so), else a bare state_dict."""
    try:
        return read_state_dict(path, wrapper_keys=("model_ema",))
    except VisarError:
        state = read_state_dict(path)
    warnings.warn(
        f"{path} has no 'model_ema' (the EMA weights the official demo samples with): loading its "
        "'model' weights (the training weights) instead",
        stacklevel=3,
    )
    return state


def load_model_weights(model: MAR, path, source: str) -> MAR:
    state = read_ema_state(path)
    config = model.config
    shared = dict(
        img_size=config.img_size,
        vae_stride=config.vae_stride,
        patch_size=config.patch_size,
        vae_embed_dim=config.vae_embed_dim,
        class_num=config.class_num,
        buffer_size=config.buffer_size,
    )
    presets = {f"mar-{size}": (lambda size=size: MAR(preset_config(size, **shared))) for size in MAR_SIZES}
    meta = any(p.is_meta for p in model.parameters())
    return load_strict(model, state, source=source, presets=presets, assign=meta)


def build_tokenizer(tokenizer_args: dict) -> AutoencoderKL:
    return AutoencoderKL(KLConfig.from_dict(tokenizer_args))


def load_tokenizer_weights(tokenizer: AutoencoderKL, path, source: str) -> AutoencoderKL:
    return load_strict(tokenizer, read_state_dict(path), source=source, presets={"kl-16": lambda: AutoencoderKL(KL16)})


def check_tokenizer(model: MAR, tokenizer: AutoencoderKL):
    """The VAE's latent must be what the model's tokens are made of."""
    config = model.config
    if tokenizer.latent_dim != config.vae_embed_dim or tokenizer.downsample != config.vae_stride:
        raise VisarError(
            f"the VAE does not fit the MAR model: its latents have {tokenizer.latent_dim} channels at stride "
            f"{tokenizer.downsample}, the model's tokens are made of {config.vae_embed_dim} channels at stride "
            f"{config.vae_stride} (vae_embed_dim / vae_stride)"
        )


# Not on the Hub: the MAR README links Dropbox files, which LTH14/mar's util/download.py fetches.
RELEASE_NOTE = (
    "the MAR README publishes {model} on Dropbox, not on the Hugging Face Hub: run `python util/download.py` in a "
    "clone of LTH14/mar (it writes pretrained_models/mar/mar_{size}/checkpoint-last.pth and "
    "pretrained_models/vae/kl16.ckpt), then load them by path"
)


def official_presets() -> dict[str, OfficialPreset]:
    guidance = {"base": 2.9, "large": 3.0, "huge": 3.2}  # the README's FID settings (linear schedule)
    return {
        f"mar-{size}": OfficialPreset(
            f"mar-{size}",
            "mar",
            f"MAR-{size[0].upper()} class-conditional ImageNet 256px, continuous tokens (official checkpoint + "
            "KL-16 VAE by path: LTH14/mar's util/download.py fetches them)",
            preset_config(size).to_dict(),
            KL16.to_dict(),
            {"guidance_scale": guidance[size], "temperature": 1.0, "top_k": None, "top_p": 1.0},
            release_note=RELEASE_NOTE.format(model=f"MAR-{size[0].upper()}", size=size),
        )
        for size in MAR_SIZES
    }


# A 4 x 4-token MAR with a 2-layer head and a matching 8 px VAE: every continuous method's mechanics.
TINY_MODEL_ARGS = dict(
    img_size=8,
    vae_stride=2,
    encoder_embed_dim=16,
    encoder_depth=1,
    encoder_num_heads=2,
    decoder_embed_dim=16,
    decoder_depth=1,
    decoder_num_heads=2,
    vae_embed_dim=2,
    class_num=4,
    buffer_size=2,
    diffloss_d=1,
    diffloss_w=16,
    num_sampling_steps="8",
)
TINY_TOKENIZER_ARGS = dict(embed_dim=2, ch_mult=[1, 1], ch=32, resolution=8, attn_resolutions=[4])

register_family(
    Family(
        name="mar",
        model_kind="continuous",
        build_model=build_model,
        load_model_weights=load_model_weights,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_tokenizer_weights,
        official_presets=official_presets(),
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=TINY_TOKENIZER_ARGS,
        generic_name="mar",
        title="MAR",
        generic_description="any MAR checkpoint: --checkpoint FILE, the official MAR constructor arguments as "
        "--model-arg KEY=VALUE, --vq-checkpoint FILE (the KL VAE)",
        check_tokenizer=check_tokenizer,
    )
)
