"""The VAR family: VAR next-scale transformers (class-conditional ImageNet) with VAR's multi-scale VQVAE.

Official releases (FoundationVision/VAR): var_d16/d20/d24/d30.pth at 256 px and var_d36.pth (shared
AdaLN) at 512 px, all with vae_ch160v4096z32.pth, on the Hub in FoundationVision/var (the VAR
README's links), where `visar.load(preset)` fetches them. They are bare state_dicts and load
strictly; a file of another depth names the preset that fits. Sampling defaults are upstream's FID setting:
cfg 1.5 (guidance_scale 2.5 here, see visar/accel/next_scale/methods.py), top-k 900, top-p 0.96.
"""

from __future__ import annotations

from ..checkpoints import load_strict, read_state_dict
from ..errors import VisarError
from ..models.var import SCALES_256, SCALES_512, VAR, VARConfig, preset_config
from ..tokenizers.msvq import MSVQ_PRESETS, MSVQConfig, MultiScaleVQVAE, fit_training_statistics
from .family import Family, OfficialPreset, register_family

# name -> (depth, shared AdaLN, scale schedule, px) of every release
RELEASES = {
    "var-d16": (16, False, SCALES_256, 256),
    "var-d20": (20, False, SCALES_256, 256),
    "var-d24": (24, False, SCALES_256, 256),
    "var-d30": (30, False, SCALES_256, 256),
    "var-d36": (36, True, SCALES_512, 512),
}
HUB_REPO, VQVAE_FILE = "FoundationVision/var", "vae_ch160v4096z32.pth"
# Upstream's demo / FID setting: cfg 1.5 (a weight of 2.5 on cond at the last scale), top-k 900, top-p 0.96.
VAR_DEFAULTS = {"guidance_scale": 2.5, "temperature": 1.0, "top_k": 900, "top_p": 0.96}


def build_model(model_args: dict) -> VAR:
    return VAR(VARConfig.from_dict(model_args))


def release_config(name: str, like: VARConfig | None = None) -> VARConfig:
    depth, shared, scales, _ = RELEASES[name]
    config = preset_config(depth, shared, scales)
    if like is not None:  # keep what comes from the VQVAE and the data
        args = {**config.to_dict(), "vocab_size": like.vocab_size, "z_channels": like.z_channels}
        config = VARConfig.from_dict({**args, "num_classes": like.num_classes})
    return config


def load_model_weights(model: VAR, path, source: str) -> VAR:
    presets = {name: (lambda name=name: VAR(release_config(name, model.config))) for name in RELEASES}
    meta = any(p.is_meta for p in model.parameters())  # built on meta: take the loaded tensors
    return load_strict(model, read_state_dict(path), source=source, presets=presets, assign=meta)


def args_from_tokenizer(given: dict, model_args: dict, tokenizer_args: dict) -> dict:
    """The vocabulary size and latent width from the VQVAE's arguments, as upstream's VAR reads them from
    the VQVAE it is given (`VAR(vae_local=...)`); model_args may repeat them only with the same values."""
    vq = MSVQConfig.from_dict(tokenizer_args)
    derived = {"vocab_size": vq.vocab_size, "z_channels": vq.z_channels}
    for key, value in derived.items():
        if key in given and given[key] != value:
            raise VisarError(
                f"model_args {key}={given[key]} disagrees with the VQVAE's {key}={value} (vq_args): VAR takes it from "
                f"its VQVAE, so leave {key} out of model_args or make the two equal"
            )
    return {**model_args, **derived}


def build_tokenizer(tokenizer_args: dict) -> MultiScaleVQVAE:
    return MultiScaleVQVAE(MSVQConfig.from_dict(tokenizer_args))


def load_tokenizer_weights(tokenizer: MultiScaleVQVAE, path, source: str) -> MultiScaleVQVAE:
    presets = {name: (lambda c=c: MultiScaleVQVAE(c)) for name, c in MSVQ_PRESETS.items()}
    state = fit_training_statistics(read_state_dict(path), tokenizer)
    meta = any(p.is_meta for p in tokenizer.parameters())
    return load_strict(tokenizer, state, source=source, presets=presets, assign=meta)


def official_presets() -> dict[str, OfficialPreset]:
    presets = {}
    for name, (depth, shared, scales, px) in RELEASES.items():
        tokenizer = MSVQConfig(v_patch_nums=scales)  # the one released VQVAE, on this release's schedule
        presets[name] = OfficialPreset(
            name,
            "var",
            f"VAR-d{depth} class-conditional ImageNet {px}px{' (shared AdaLN)' if shared else ''} "
            f"(var_d{depth}.pth + {VQVAE_FILE} from {HUB_REPO})",
            release_config(name).to_dict(),
            tokenizer.to_dict(),
            dict(VAR_DEFAULTS),
            hub_repo=HUB_REPO,
            hub_files=(f"var_d{depth}.pth", VQVAE_FILE),
        )
    return presets


# Four scales (1, 2, 3, 4) of a 16-code vocabulary and an 8 px VQVAE: every next-scale method's mechanics.
TINY_SCALES = (1, 2, 3, 4)
TINY_MODEL_ARGS = dict(
    vocab_size=16, z_channels=4, num_classes=4, depth=2, embed_dim=32, num_heads=2, attn_l2_norm=True,
    patch_nums=TINY_SCALES,
)  # fmt: skip
TINY_TOKENIZER_ARGS = dict(vocab_size=16, z_channels=4, ch=32, ch_mult=(1, 1), v_patch_nums=TINY_SCALES)

register_family(
    Family(
        name="var",
        model_kind="next-scale",
        build_model=build_model,
        load_model_weights=load_model_weights,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_tokenizer_weights,
        official_presets=official_presets(),
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=TINY_TOKENIZER_ARGS,
        generic_name="var",
        title="VAR",
        generic_description="any VAR checkpoint: --checkpoint FILE, the official VAR constructor arguments as "
        "--model-arg KEY=VALUE, --vq-checkpoint FILE (the VQVAE: the vocabulary size and latent width come from it)",
        args_from_tokenizer=args_from_tokenizer,
    )
)
