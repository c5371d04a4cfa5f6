"""The MaskGIT family: visar's own small masked transformer (`visar.models.maskgit`) with visar's VQ tokenizer.

A visar model folder (config.json with "family": "maskgit", model_args = `MaskGITConfig` fields,
vq_args = the VQ tokenizer's) loads with `visar.load(FOLDER)`; the embedded masked model is
trained by `visar train masked` (visar/train/masked.py) on the shapes world.
"""

from __future__ import annotations

from ..checkpoints import load_strict, read_state_dict
from ..models.maskgit import MaskGIT, MaskGITConfig
from ..tokenizers.vq import VQ_PRESETS, VQConfig, VQModel
from .family import Family, register_family


def build_model(model_args: dict) -> MaskGIT:
    return MaskGIT(MaskGITConfig.from_dict(model_args))


def load_model_weights(model: MaskGIT, path, source: str) -> MaskGIT:
    meta = any(p.is_meta for p in model.parameters())
    return load_strict(model, read_state_dict(path), source=source, assign=meta)


def build_tokenizer(tokenizer_args: dict) -> VQModel:
    return VQModel(VQConfig.from_dict(tokenizer_args))


def load_tokenizer_weights(tokenizer: VQModel, path, source: str) -> VQModel:
    presets = {name: (lambda c=c: VQModel(c)) for name, c in VQ_PRESETS.items()}
    return load_strict(tokenizer, read_state_dict(path), source=source, presets=presets)


# A 4 x 4-token, 8-code model and the raster family's 8 px VQ: enough for every masked method's mechanics.
TINY_MODEL_ARGS = dict(dim=32, n_layer=2, n_head=2, mlp_ratio=2.0, vocab_size=8, num_classes=4, grid_size=4)
TINY_TOKENIZER_ARGS = dict(
    codebook_size=8, codebook_embed_dim=4, ch=32, encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2], z_channels=32
)

register_family(
    Family(
        name="maskgit",
        model_kind="masked",
        build_model=build_model,
        load_model_weights=load_model_weights,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_tokenizer_weights,
        official_presets={},
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=TINY_TOKENIZER_ARGS,
        title="MaskGIT (visar's own)",
    )
)
