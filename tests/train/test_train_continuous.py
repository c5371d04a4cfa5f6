"""`visar train tokenizer --recipe visar-tiny-kl` and `visar train continuous`: quick runs of the real recipes.

The KL tokenizer records the latent scale it measured and resumes exactly; MAR's mask ratio follows
upstream's truncated normal; the diffusion loss trains eps by MSE alone and the variance by the
bound alone, which an oracle head (true noise, true posterior variance) brings to zero; a few MAR
steps lower the loss; resumed runs end where uninterrupted ones do; the exports load as "mar"
folders that decode with mar, cspd (the draft as draft=) and mar-cache, and ship beside their
shared tokenizer.
"""

import math

import numpy as np
import pytest
import torch

import visar
from visar.apps.commands.train import ship
from visar.errors import VisarError
from visar.models.mar import MAR, MARConfig
from visar.train.continuous import (
    diffusion_loss,
    mask_ratio,
    masked_token_loss,
    train_continuous,
    train_kl,
    training_diffusion,
)
from visar.train.recipes import MAR_RECIPES

QUICK_KL = dict(batch_size=2, eval_images=4, checkpoint_every=1)
QUICK_MAR = dict(batch_size=4, dataset_size=32, checkpoint_every=10, warmup=5)


@pytest.fixture(scope="module")
def quick_kl(tmp_path_factory):
    return train_kl("visar-tiny-kl", tmp_path_factory.mktemp("kl"), steps=3, **QUICK_KL)


@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory, quick_kl):
    target_out = tmp_path_factory.mktemp("mar")
    target = train_continuous("visar-tiny-mar-c2i", target_out, quick_kl, steps=20, **QUICK_MAR)
    draft = train_continuous(
        "visar-tiny-mar-c2i-draft",
        tmp_path_factory.mktemp("draft"),
        quick_kl,
        steps=2,
        distill_from=str(target),
        **QUICK_MAR,
    )
    return target_out, target, draft


def test_the_draft_recipe_is_under_a_quarter_of_the_target():
    sizes = {
        name: sum(p.numel() for p in MAR(MARConfig.from_dict(recipe["model_args"])).parameters())
        for name, recipe in MAR_RECIPES.items()
    }
    assert sizes["visar-tiny-mar-c2i-draft"] <= sizes["visar-tiny-mar-c2i"] / 4


def test_mask_ratio_is_upstreams_truncated_normal():
    gen = torch.Generator().manual_seed(0)
    ratios = np.array([mask_ratio(0.7, gen) for _ in range(4000)])
    assert ratios.min() >= 0.7 and ratios.max() <= 1.0
    # 1 - 0.25 |N| given |N| < 1.2: E|N| = sqrt(2 / pi) (1 - exp(-a^2 / 2)) / erf(a / sqrt 2)
    a = 1.2
    expected = 1 - 0.25 * math.sqrt(2 / math.pi) * (1 - math.exp(-(a**2) / 2)) / math.erf(a / math.sqrt(2))
    assert abs(ratios.mean() - expected) < 4 * ratios.std() / math.sqrt(len(ratios))


class OracleHead(torch.nn.Module):
    """Returns [eps | v] from a table: the true noise (replayed from the loss's generator) and v = -1
    (log-variance = the true posterior's), or any other value the test sets."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, x, t, z):
        return self.out


def replay(seed: int, count: int, channels: int):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 1000, (count,), generator=gen)
    return t, torch.randn(count, channels, generator=gen)


def test_an_oracle_head_scores_zero_and_the_bound_trains_only_the_variance():
    constants = training_diffusion("cpu")
    count, channels, seed = 256, 3, 1
    t, noise = replay(seed, count, channels)
    assert bool((t > 0).all())  # this seed draws no t = 0 (a Gaussian likelihood of x0 there, not a KL)
    x0, z = torch.randn(count, channels), torch.zeros(count, 1)
    oracle = torch.cat([noise, -torch.ones(count, channels)], 1)
    loss = diffusion_loss(OracleHead(oracle), x0, z, constants, torch.Generator().manual_seed(seed))
    assert loss.item() == pytest.approx(0.0, abs=1e-5)
    off = torch.cat([noise, torch.full((count, channels), -9.0)], 1)  # the right mean, a wrong variance
    assert diffusion_loss(OracleHead(off), x0, z, constants, torch.Generator().manual_seed(seed)).item() > 1e-3

    out = torch.cat([noise + 0.3, torch.zeros(count, channels)], 1).requires_grad_()
    diffusion_loss(OracleHead(out), x0, z, constants, torch.Generator().manual_seed(seed)).backward()
    # eps learns from the MSE alone: its gradient is exactly d/d eps of mean((eps - noise)^2).
    torch.testing.assert_close(out.grad[:, :channels], torch.full((count, channels), 2 * 0.3 / channels / count))
    assert out.grad[:, channels:].abs().sum() > 0  # the bound reaches the variance channels


def test_distillation_adds_the_distance_to_the_teachers_head():
    torch.manual_seed(0)
    model = MAR(MARConfig.from_dict(MAR_RECIPES["visar-tiny-mar-c2i-draft"]["model_args"]))
    other = MAR(MARConfig.from_dict(MAR_RECIPES["visar-tiny-mar-c2i-draft"]["model_args"]))
    tokens, labels, constants = torch.randn(2, 64, 16), torch.tensor([0, 5]), training_diffusion("cpu")

    def loss(teacher) -> float:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(4)
            return masked_token_loss(model, tokens, labels, gen, constants, teacher, weight=1.0).item()

    assert loss(model) == pytest.approx(loss(None), abs=1e-6)  # a teacher that agrees adds nothing
    assert loss(other) > loss(None) + 1e-3


@pytest.mark.slow  # needs the module's trained MAR pair
def test_a_few_steps_lower_the_mar_loss(quick_pair):
    out, export, _ = quick_pair
    data = np.load(out / "dataset.npz")
    latents, labels = torch.from_numpy(data["tokens"].astype(np.float32)), torch.from_numpy(data["labels"])
    assert latents.shape == (32, 4, 16, 16)
    pipe = visar.load(str(export), device="cpu")
    constants = training_diffusion("cpu")

    def loss(model) -> float:
        model.train()
        with torch.no_grad():
            tokens = model.patchify(latents)
            return masked_token_loss(model, tokens, labels, torch.Generator().manual_seed(3), constants).item()

    start = visar.load(str(export), device="cpu").model
    net = start.diffloss.net
    for layer in (net.final_layer.adaLN_modulation[-1], net.final_layer.linear):
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)  # the recipe's initial head: eps = 0, v = 0
    assert loss(pipe.model) < loss(start) - 0.1


@pytest.mark.slow  # needs the module's trained MAR pair
def test_the_exports_are_mar_folders_that_decode_with_every_continuous_method(quick_pair):
    _, target, draft = quick_pair
    pipe = visar.load(str(target), device="cpu")
    assert pipe.model.model_kind == "continuous" and pipe.class_names[0] == "red circle"
    assert pipe.recipe["name"] == "visar-tiny-mar-c2i" and pipe.defaults["guidance_scale"] == 3.0
    assert pipe.tokenizer.config.scale_factor != 0.2325  # measured on the tokenizer's held-out renders
    runs = {"mar": {}, "cspd": {"draft": str(draft)}, "mar-cache": {}}
    for method, options in runs.items():
        out = pipe.generate(class_labels=[0, 39], method=method, output_type="np", num_iter=4, **options)
        assert out.images.shape == (2, 64, 64, 3)
    assert out.stats["num_iter"] == 4
    default = pipe.generate(class_labels=[1], method="mar", output_type="tokens")
    assert default.stats["num_iter"] == 16  # a quarter of the 64 tokens, as upstream's 64 for 256


@pytest.mark.slow  # needs the module's trained MAR pair
def test_ship_puts_the_mar_export_beside_its_kl_tokenizer(quick_pair, tmp_path):
    _, target, _ = quick_pair
    shipped = ship(target, "visar-tiny-mar-c2i", "a MAR model", weights_dir=tmp_path)
    assert (tmp_path / "visar-tiny-kl" / "tokenizer.safetensors").is_file()
    assert (shipped / "tokenizer.safetensors").read_bytes() == (target / "tokenizer.safetensors").read_bytes()
    pipe = visar.load(str(shipped), device="cpu")
    assert pipe.model.model_kind == "continuous" and pipe.name == "visar-tiny-mar-c2i"


@pytest.mark.slow  # trains a KL tokenizer and a MAR, whole and resumed
def test_kl_and_mar_resume_is_exact(tmp_path, quick_kl):
    from safetensors.torch import load_file

    whole = train_kl("visar-tiny-kl", tmp_path / "kl-whole", steps=2, **QUICK_KL)
    train_kl("visar-tiny-kl", tmp_path / "kl-split", steps=1, **QUICK_KL)
    split = train_kl("visar-tiny-kl", tmp_path / "kl-split", steps=2, **QUICK_KL)
    a, b = load_file(str(whole / "tokenizer.safetensors")), load_file(str(split / "tokenizer.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    quick = {**QUICK_MAR, "checkpoint_every": 1, "dataset_size": 8}
    whole = train_continuous("visar-tiny-mar-c2i", tmp_path / "whole", quick_kl, steps=3, **quick)
    train_continuous("visar-tiny-mar-c2i", tmp_path / "split", quick_kl, steps=2, **quick)
    split = train_continuous("visar-tiny-mar-c2i", tmp_path / "split", quick_kl, steps=3, **quick)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_teacher_over_other_tokens_is_refused(tmp_path, quick_kl):
    with pytest.raises(VisarError, match="not a MAR over the recipe's tokens"):
        train_continuous(
            "visar-tiny-mar-c2i-draft", tmp_path, quick_kl, steps=1, distill_from="visar-tiny-c2i", **QUICK_MAR
        )


def test_unknown_recipes(tmp_path, quick_kl):
    with pytest.raises(VisarError, match="unknown recipe"):
        train_kl("visar-tiny-vq", tmp_path)
    with pytest.raises(VisarError, match="unknown recipe"):
        train_continuous("visar-tiny-var-c2i", tmp_path, quick_kl)
