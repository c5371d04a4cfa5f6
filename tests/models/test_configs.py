"""`visar.configs.config_from_dict`, the one reading of a config.json dict that every model and tokenizer
config's `from_dict` goes through: unknown keys refused with one sentence, the fixtures' old names
renamed, lists made tuples, each config keeping its own name in the sentence."""

from dataclasses import dataclass

import pytest

from visar.configs import config_from_dict
from visar.errors import VisarError
from visar.models.llamagen import LlamaGenConfig
from visar.models.mar import MARConfig
from visar.models.maskgit import MaskGITConfig
from visar.models.var import VARConfig
from visar.tokenizers.kl import KLConfig
from visar.tokenizers.msvq import MSVQConfig
from visar.tokenizers.vq import VQConfig


@dataclass(frozen=True)
class Toy:
    width: int = 8
    mult: tuple[int, ...] = (1, 2)


def test_an_unknown_key_is_refused_with_one_sentence():
    with pytest.raises(VisarError) as err:
        config_from_dict(Toy, {"width": 4, "zeta": 1, "alpha": 2}, "toy model_args")
    assert str(err.value) == "unknown toy model_args ['alpha', 'zeta']; known fields: ['mult', 'width']"
    with pytest.raises(VisarError, match=r"^unknown toy args \['zeta'\]; known \(upstream's\): \['mult', 'width'\]$"):
        config_from_dict(Toy, {"zeta": 1}, "toy args", known_as="known (upstream's)")


def test_lists_become_tuples_and_old_names_are_renamed():
    args = {"old_width": 4, "mult": [1, 2, 4]}
    config = config_from_dict(Toy, args, "toy", renamed={"old_width": "width"}, convert={"mult": tuple})
    assert config == Toy(width=4, mult=(1, 2, 4)) and isinstance(config.mult, tuple)
    assert args == {"old_width": 4, "mult": [1, 2, 4]}  # the caller's dict is left as it was
    assert config_from_dict(Toy, {}, "toy", convert={"mult": tuple}) == Toy()  # absent keys keep defaults
    with pytest.raises(VisarError, match=r"unknown toy \['old_width'\]"):  # not renamed: refused
        config_from_dict(Toy, {"old_width": 4}, "toy")


@pytest.mark.parametrize(
    "config, sentence",
    [
        (LlamaGenConfig, "unknown LlamaGen model_args ['zeta']; known fields: "),
        (MaskGITConfig, "unknown MaskGIT model_args ['zeta']; known fields: "),
        (VARConfig, "unknown VAR model_args ['zeta']; known fields: "),
        (MARConfig, "unknown MAR model_args ['zeta']; known (the official constructor's): "),
        (VQConfig, "unknown VQ vq_args ['zeta']; known fields: "),
        (KLConfig, "unknown KL VAE vae_args ['zeta']; known fields: "),
        (MSVQConfig, "unknown VAR VQVAE vq_args ['zeta']; known fields: "),
    ],
)
def test_each_config_names_itself_in_the_sentence(config, sentence):
    with pytest.raises(VisarError) as err:
        config.from_dict({"zeta": 1})
    assert str(err.value).startswith(sentence)


def test_each_config_keeps_its_own_conversions():
    assert VQConfig.from_dict({"encoder_decoder_ch": 32, "encoder_ch_mult": [1, 2]}).ch == 32
    assert VQConfig.from_dict({"encoder_ch_mult": [1, 2]}).encoder_ch_mult == (1, 2)
    kl = KLConfig.from_dict({"encoder_decoder_resolution": 32, "ch_mult": [1, 2], "attn_resolutions": []})
    assert (kl.resolution, kl.ch_mult, kl.attn_resolutions) == (32, (1, 2), ())
    assert MSVQConfig.from_dict({"encoder_decoder_ch_mult": [1, 2], "v_patch_nums": [1, 2]}).ch_mult == (1, 2)
    assert MARConfig.from_dict({"num_sampling_steps": 25}).num_sampling_steps == "25"
    assert VARConfig.from_dict({"patch_nums": [1, 2, 4]}).patch_nums == (1, 2, 4)
    with pytest.raises(VisarError, match="VAR embed_dim must be a multiple of num_heads"):
        VARConfig.from_dict({"embed_dim": 100, "num_heads": 3})
