"""Strict loading of the official-code MAR fixtures (LTH14/mar) and reproduction of their outputs."""

import json

import pytest
import torch
from conftest import fixtures_dir
from safetensors.torch import load_file

import visar
from visar.accel.continuous.mar import BatchNoise, denoise, sample_tokens
from visar.families import FAMILIES
from visar.models.diffusion import DiffusionSchedule, diffusion_step, respaced_timesteps
from visar.models.mar import MAR, MARConfig, preset_config
from visar.tokenizers.kl import KL16, AutoencoderKL


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def fixture(name):
    folder = fixtures_dir("mar")
    meta = json.loads((folder / f"tiny_{name}.json").read_text())
    return folder, meta, load_file(str(folder / f"tiny_{name}_io.safetensors"))


def vae_args(meta):
    return {
        **meta["constructor_kwargs"],
        "ch": meta["encoder_decoder_ch"],
        "resolution": meta["encoder_decoder_resolution"],
    }


@pytest.fixture(scope="module")
def pipe():
    folder, meta, _ = fixture("mar")
    _, vae_meta, _ = fixture("vae_kl")
    return visar.load(
        "mar",
        checkpoint=folder / "tiny_mar.pt",
        model_args=meta["constructor_kwargs"],
        vae_checkpoint=folder / "tiny_vae_kl.pt",
        vae_args=vae_args(vae_meta),
        device="cpu",
    )


def close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=atol)


def close_to_max(actual, expected, rel=1e-5):
    """Long sampling chains reach 1e4..2e5 with random weights: compare relative to max-abs."""
    scale = expected.abs().max()
    assert float((actual - expected).abs().max() / scale) < rel


def test_diffusion_schedules_match():
    schedules = json.loads((fixtures_dir("mar") / "diffusion_schedules.json").read_text())["schedules"]
    for steps, expected in schedules.items():
        schedule = DiffusionSchedule.cosine(int(steps))
        assert list(schedule.timestep_map) == expected["timestep_map"]
        assert torch.equal(torch.from_numpy(schedule.betas), torch.tensor(expected["betas"], dtype=torch.float64))


def test_respacing_strings_as_upstream_reads_them():
    """guided-diffusion's space_timesteps (MAR's copy): "N" as N, sections, and the DDIM stride."""
    assert respaced_timesteps(1000, "100") == respaced_timesteps(1000, 100)
    assert respaced_timesteps(1000, "ddim25") == list(range(0, 1000, 40))
    # two sections of 10 steps: strides 9 and 4.5 (4.5 rounds half to even: 4)
    assert respaced_timesteps(20, "2,3") == [0, 9, 10, 14, 19]
    with pytest.raises(ValueError, match="exactly 999"):
        respaced_timesteps(1000, "ddim999")  # no integer stride gives 999 steps of 1000
    model = MAR(MARConfig.from_dict({**FAMILIES["mar"].tiny_model_args, "num_sampling_steps": "ddim25"}))
    assert model.num_sampling_steps == 25 and model.diffusion_schedule().timestep_map[-1] == 960


def test_ema_weights_load_and_encoder_decoder_match(pipe):
    _, _, io = fixture("mar")
    model = pipe.model
    labels, mask, tokens = io["labels"], io["mask"], io["tokens"]
    encoded = model.forward_mae_encoder(tokens, mask, model.embed_condition(labels))
    close(encoded, io["encoder_out"])
    close(model.forward_mae_decoder(encoded, mask), io["z"])
    fake = model.forward_mae_encoder(tokens, mask, model.null_embedding(2))
    close(model.forward_mae_decoder(fake, mask), io["z_fake_latent"])
    # the interface's one call gives the same z
    close(model.condition_features(tokens, mask == 0, model.embed_condition(labels)), io["z"])


def test_diffusion_head_matches(pipe):
    _, _, io = fixture("mar")
    net = pipe.model.diffloss.net
    close(pipe.model.diffusion_head(io["diff_x"], io["diff_t"], io["diff_c"]), io["diff_net_out"])
    half = io["diff_x"][:3]
    close(
        net.forward_with_cfg(torch.cat([half, half]), io["diff_t"], io["diff_c"], 2.5),
        io["diff_net_forward_with_cfg_out"],
    )


def test_one_reverse_step_matches(pipe):
    _, _, io = fixture("mar")
    model = pipe.model
    constants = model.diffusion_schedule(10).constants("cpu")
    x, z = io["sample_noise"], io["sample_z"]
    z3 = io["diffloss_sample_cfg3_input_z"]
    for i in range(9):  # the last index (t = 999) is ill-conditioned by design
        step = torch.full((4,), i)
        mean, log_var, x0 = diffusion_step(
            constants, step, x, model.diffusion_head(x, constants["timestep_map"][step], z)
        )
        close(mean, io["pmv_mean"][i])
        close(log_var, io["pmv_log_variance"][i])
        close(x0, io["pmv_pred_xstart"][i])
        guided = model.diffloss.net.forward_with_cfg(
            torch.cat([x, x]), constants["timestep_map"][step].repeat(2), z3, 3.0
        )
        mean, log_var, _ = diffusion_step(constants, step.repeat(2), torch.cat([x, x]), guided)
        close(mean, io["pmv_cfg3_mean"][i])
        close(log_var, io["pmv_cfg3_log_variance"][i])


def test_diffusion_sampling_chains_match(pipe):
    _, _, io = fixture("mar")
    model = pipe.model
    constants = model.diffusion_schedule().constants("cpu")
    z, start = io["sample_z"], io["sample_noise"]
    out = denoise(model, constants, start, z, None, 1.0, 0.0, lambda i: torch.zeros(4, 4))
    close_to_max(out, io["p_sample_loop_temp0"])
    gen = torch.Generator().manual_seed(123)
    out = denoise(model, constants, start, z, None, 1.0, 1.0, lambda i: torch.randn(4, 4, generator=gen))
    close_to_max(out, io["p_sample_loop_temp1_seeded"])
    gen = torch.Generator().manual_seed(123)
    noise = BatchNoise(gen, 4, guided=False)
    rows = torch.arange(4)
    out = denoise(model, constants, noise.start(rows, rows), z, None, 1.0, 1.0, lambda i: noise.step(rows, rows, i))
    close_to_max(out, io["diffloss_sample_cfg1_seeded"])
    gen = torch.Generator().manual_seed(123)
    noise = BatchNoise(gen, 4, guided=True)
    z3 = io["diffloss_sample_cfg3_input_z"]
    out = denoise(
        model, constants, noise.start(rows, rows), z3[:4], z3[4:], 3.0, 1.0, lambda i: noise.step(rows, rows, i)
    )
    close_to_max(out, io["diffloss_sample_cfg3_seeded"][:4])


@pytest.mark.parametrize(
    "name,cfg,schedule", [("cfg1", 1.0, "linear"), ("cfg3", 3.0, "linear"), ("cfg3_constant", 3.0, "constant")]
)
def test_sample_tokens_match(pipe, name, cfg, schedule):
    _, meta, io = fixture("mar")
    model = pipe.model
    orders = io[f"sample_tokens_orders_{name.split('_')[0]}"]
    noise = BatchNoise(torch.Generator().manual_seed(123), model.token_dim, guided=cfg != 1.0)
    tokens = sample_tokens(
        model, io["labels"], num_iter=4, cfg=cfg, cfg_schedule=schedule, temperature=1.0, orders=orders, noise=noise
    )
    close_to_max(model.unpatchify(tokens), io[f"sample_tokens_{name}"])


def test_kl_vae_matches():
    folder, _, io = fixture("vae_kl")
    _, vae_meta, _ = fixture("vae_kl")
    pipe = visar.load(
        "mar",
        checkpoint=folder / "tiny_mar.pt",
        model_args=fixture("mar")[1]["constructor_kwargs"],
        vae_checkpoint=folder / "tiny_vae_kl.pt",
        vae_args=vae_args(vae_meta),
        device="cpu",
    )
    vae = pipe.tokenizer
    with torch.no_grad():
        posterior = vae.encode(io["image"])
        close(posterior.mean, io["posterior_mean"])
        close(posterior.logvar, io["posterior_logvar"])
        close(posterior.std, io["posterior_std"])
        close(vae.decode_latent(io["latent"]), io["decoded"])
        close(vae.decode(io["mar_tokens"]), io["mar_tokens_decoded"])


def test_manifests_match_the_presets():
    folder = fixtures_dir("mar")
    for size in ("base", "large", "huge"):
        manifest = json.loads((folder / f"manifest_mar_{size}.json").read_text())
        with torch.device("meta"):
            model = MAR(preset_config(size))
        shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
        assert shapes == manifest["state_dict"], size
        assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters"]
    manifest = json.loads((folder / "manifest_vae_kl16.json").read_text())
    with torch.device("meta"):
        vae = AutoencoderKL(KL16)
    assert {k: list(v.shape) for k, v in vae.state_dict().items()} == manifest["state_dict"]


def test_config_round_trip():
    _, meta, _ = fixture("mar")
    assert MARConfig.from_dict(meta["constructor_kwargs"]).to_dict()["encoder_embed_dim"] == 32
