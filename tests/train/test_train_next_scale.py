"""`visar train tokenizer --recipe visar-tiny-msvq` and `visar train next-scale`: quick runs of the real recipes.

The training quantiser picks the codes `encode` picks and passes the decoder's gradient to the
encoder (straight-through) and its own loss to the codebook; a few VAR steps lower the next-scale
loss from its start (a zero head: log 512 everywhere); resumed runs end where uninterrupted ones
do; the exports load as "var" folders that decode with var, var-prune and code (the refiner as
refiner=) and ship beside their shared tokenizer.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import visar
from visar.apps.commands.train import ship
from visar.errors import VisarError
from visar.tokenizers.msvq import MSVQConfig, MultiScaleVQVAE
from visar.train.next_scale import (
    quantize_for_training,
    scored_cross_entropy,
    split_scales,
    train_msvq,
    train_next_scale,
)
from visar.train.recipes import MSVQ_RECIPES

pytestmark = pytest.mark.slow  # every test here trains (or needs the module's trained tokenizer)

QUICK_VQ = dict(batch_size=2, eval_images=4, checkpoint_every=1, dead_code_every=1)
QUICK_VAR = dict(batch_size=8, dataset_size=64, checkpoint_every=10, warmup=5)


@pytest.fixture(scope="module")
def quick_msvq(tmp_path_factory):
    return train_msvq("visar-tiny-msvq", tmp_path_factory.mktemp("msvq"), steps=3, **QUICK_VQ)


@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory, quick_msvq):
    drafter_out = tmp_path_factory.mktemp("var")
    drafter = train_next_scale("visar-tiny-var-c2i", drafter_out, quick_msvq, steps=30, **QUICK_VAR)
    refiner = train_next_scale(
        "visar-tiny-var-c2i-refiner", tmp_path_factory.mktemp("refiner"), quick_msvq, steps=3, **QUICK_VAR
    )
    return drafter_out, drafter, refiner


def test_training_quantizer_picks_the_codes_encode_picks_and_passes_gradients():
    torch.manual_seed(0)
    msvq = MultiScaleVQVAE(MSVQConfig.from_dict(MSVQ_RECIPES["visar-tiny-msvq"]["vq_args"]))
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    f = msvq.pre_quant(images)
    f_hat, scale_tokens, vq_loss = quantize_for_training(msvq, f, beta=0.25)
    expected = msvq.encode(images)
    assert [t.shape[-1] for t in scale_tokens] == [1, 2, 3, 4, 6, 8, 10, 13, 16]
    assert all(torch.equal(a, b) for a, b in zip(scale_tokens, expected, strict=True))
    # The straight-through value is the quantised latent; its gradient is the identity into f.
    torch.testing.assert_close(f_hat, msvq.accumulate(expected)[-1], rtol=1e-5, atol=1e-5)
    recon = msvq.decoder(msvq.post_quant_conv(f_hat))
    (F.mse_loss(recon, images) + vq_loss).backward()
    assert msvq.encoder.conv_in.weight.grad.abs().sum() > 0
    assert msvq.quantize.embedding.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in msvq.quantize.quant_resi.parameters())


def test_split_scales_inverts_the_flat_layout():
    maps = [torch.randint(0, 9, (2, s, s)) for s in (1, 2, 3)]
    flat = torch.cat([m.flatten(1) for m in maps], 1)
    assert all(torch.equal(a, b) for a, b in zip(split_scales(flat, (1, 2, 3)), maps, strict=True))


def test_msvq_export_and_resume_is_exact(tmp_path, quick_msvq):
    assert load_file(str(quick_msvq / "tokenizer.safetensors"))["quantize.embedding.weight"].dtype == torch.float16
    whole = train_msvq("visar-tiny-msvq", tmp_path / "whole", steps=2, **QUICK_VQ)
    train_msvq("visar-tiny-msvq", tmp_path / "split", steps=1, **QUICK_VQ)
    split = train_msvq("visar-tiny-msvq", tmp_path / "split", steps=2, **QUICK_VQ)  # resumes at step 1
    a, b = load_file(str(whole / "tokenizer.safetensors")), load_file(str(split / "tokenizer.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_few_steps_lower_the_next_scale_loss(quick_pair):
    out, export, _ = quick_pair
    data = np.load(out / "dataset.npz")
    tokens, labels = torch.from_numpy(data["tokens"].astype(np.int64)), torch.from_numpy(data["labels"])
    assert tokens.shape == (64, 655)
    pipe = visar.load(str(export), device="cpu")
    inputs = pipe.tokenizer.teacher_forcing_inputs(split_scales(tokens, pipe.model.scale_sizes))

    def loss(model) -> float:
        with torch.no_grad():
            logits = model(labels, inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)).item()

    start = visar.load(str(export), device="cpu").model
    torch.nn.init.zeros_(start.head.weight)
    torch.nn.init.zeros_(start.head.bias)  # the recipe's initial head: every code equally likely
    assert loss(start) == pytest.approx(math.log(512), abs=1e-4)
    assert loss(pipe.model) < math.log(512) - 0.5


def test_the_exports_are_var_folders_that_decode_with_every_next_scale_method(quick_pair):
    _, drafter, refiner = quick_pair
    pipe = visar.load(str(drafter), device="cpu")
    assert pipe.model.model_kind == "next-scale" and pipe.class_names[0] == "red circle"
    assert pipe.recipe["name"] == "visar-tiny-var-c2i" and pipe.defaults["guidance_scale"] == 3.0
    runs = {
        "var": {},
        "var-prune": {"keep_fraction": 0.5},
        "code": {"refiner": str(refiner), "draft_scales": 4},
    }
    for method, options in runs.items():
        out = pipe.generate(class_labels=[0, 39], method=method, output_type="np", **options)
        assert out.images.shape == (2, 64, 64, 3) and out.stats["forward_passes"] == 9
    assert out.stats["draft_forward_passes"] == 5


def test_ship_puts_the_var_export_beside_its_multiscale_tokenizer(quick_pair, tmp_path):
    _, drafter, _ = quick_pair
    target = ship(drafter, "visar-tiny-var-c2i", "a VAR model", weights_dir=tmp_path)
    assert (tmp_path / "visar-tiny-msvq" / "tokenizer.safetensors").is_file()
    assert (target / "tokenizer.safetensors").read_bytes() == (drafter / "tokenizer.safetensors").read_bytes()
    pipe = visar.load(str(target), device="cpu")
    assert pipe.model.model_kind == "next-scale" and pipe.name == "visar-tiny-var-c2i"


def test_next_scale_resume_is_exact(tmp_path, quick_msvq):
    quick = {**QUICK_VAR, "checkpoint_every": 1, "dataset_size": 16}
    whole = train_next_scale("visar-tiny-var-c2i-refiner", tmp_path / "whole", quick_msvq, steps=3, **quick)
    train_next_scale("visar-tiny-var-c2i-refiner", tmp_path / "split", quick_msvq, steps=2, **quick)
    split = train_next_scale("visar-tiny-var-c2i-refiner", tmp_path / "split", quick_msvq, steps=3, **quick)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_recipes(tmp_path, quick_msvq):
    with pytest.raises(VisarError, match="unknown recipe"):
        train_msvq("visar-tiny-vq", tmp_path)
    with pytest.raises(VisarError, match="unknown recipe"):
        train_next_scale("visar-tiny-c2i", tmp_path, quick_msvq)


def test_specialised_loss_scores_only_the_later_scales():
    logits, tokens = torch.randn(2, 10, 5), torch.randint(0, 5, (2, 10))
    changed = logits.clone()
    changed[:, :4] += torch.randn(2, 4, 5)
    assert scored_cross_entropy(changed, tokens, 4) == scored_cross_entropy(logits, tokens, 4)
    assert scored_cross_entropy(changed, tokens, 0) != scored_cross_entropy(logits, tokens, 0)
    changed[:, 4:] += 1.0 + torch.randn(2, 6, 5)
    assert scored_cross_entropy(changed, tokens, 4) != scored_cross_entropy(logits, tokens, 4)


def test_a_fine_tuning_recipe_starts_from_the_registered_model(tmp_path):
    from visar.registry import WEIGHTS_DIR

    quick = {**QUICK_VAR, "dataset_size": 16, "lr": 0.0}  # no step moves the weights: the export is the init
    export = train_next_scale(
        "visar-tiny-var-c2i-refiner-s6", tmp_path, WEIGHTS_DIR / "visar-tiny-msvq", steps=1, **quick
    )
    a = load_file(str(export / "model.safetensors"))
    b = load_file(str(WEIGHTS_DIR / "visar-tiny-var-c2i-refiner" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
