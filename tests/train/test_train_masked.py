"""`visar train masked`: a few steps of the real recipe (visar-tiny-maskgit-c2i) on the shipped tokenizer.

The masked-token loss falls from its start (a zero output head: log 512 for every position), a
resumed run ends with the same weights as an uninterrupted one, and the export loads as a
"maskgit" folder that generates with every masked method and names its training data.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import visar
from visar.accel import methods_for
from visar.apps.commands.train import ship
from visar.errors import VisarError
from visar.registry import WEIGHTS_DIR
from visar.train.masked import masked_inputs, train_masked

TOKENIZER = WEIGHTS_DIR / "visar-tiny-vq"
QUICK = dict(batch_size=8, dataset_size=64, checkpoint_every=10, warmup=5)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("masked")
    return out, train_masked("visar-tiny-maskgit-c2i", out, TOKENIZER, steps=40, **QUICK)


def masked_loss(model, tokens, labels, seed=0) -> float:
    inputs, masked = masked_inputs(tokens, model.mask_token_id, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(inputs, labels)
    return F.cross_entropy(logits[masked], tokens[masked]).item()


@pytest.mark.slow
def test_a_few_steps_lower_the_masked_token_loss(quick_run):
    out, export = quick_run
    data = np.load(out / "dataset.npz")
    tokens, labels = torch.from_numpy(data["tokens"].astype(np.int64)), torch.from_numpy(data["labels"])
    pipe = visar.load(str(export), device="cpu")
    start = visar.load(str(export), device="cpu").model
    torch.nn.init.zeros_(start.output.weight)
    torch.nn.init.zeros_(start.output.bias)  # the recipe's initial head: every code equally likely
    assert masked_loss(start, tokens, labels) == pytest.approx(math.log(512), abs=1e-4)
    assert masked_loss(pipe.model, tokens, labels) < math.log(512) - 0.3  # 5.59 against 6.24 on this CPU


@pytest.mark.slow
def test_the_export_is_a_maskgit_folder_that_generates(quick_run):
    _, export = quick_run
    pipe = visar.load(str(export), device="cpu")
    assert pipe.model.model_kind == "masked" and pipe.class_names[0] == "red circle"
    assert pipe.recipe["name"] == "visar-tiny-maskgit-c2i"
    for method in ("maskgit", "halton", "lpd-order", "lpd-confidence"):
        out = pipe.generate(class_labels=[0, 39], method=method, steps=8, output_type="np")
        assert out.images.shape == (2, 64, 64, 3) and out.stats["forward_passes"] == 8


@pytest.mark.slow
def test_generate_command_and_demo_take_a_masked_model(quick_run, tmp_path, capsys):
    from visar.apps.cli import main
    from visar.apps.demo import ModelCache, compare

    _, export = quick_run
    # no --method: the masked kind's reference, maskgit
    assert (
        main(["generate", "--model", str(export), "--class", "0", "-n", "2", "--out", str(tmp_path / "a"), "--quiet"])
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "a" / "images.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["maskgit", "maskgit"] and records[0]["forward_passes"] == 12
    args = ["--method", "halton", "--opt", "steps=8", "--out", str(tmp_path / "b"), "--quiet"]
    assert main(["generate", "--model", str(export), "--class", "0", *args]) == 0
    assert main(["generate", "--model", str(export), "--class", "0", "--method", "ar", "--out", str(tmp_path / "c")])
    error = capsys.readouterr().err  # the model named as the user gave it (its folder), not by its class
    assert "method 'ar' decodes raster models; " in error and " is a masked model" in error and "MaskGIT" not in error
    cache = ModelCache(device="cpu")
    pipe = cache.get(str(export))
    assert methods_for(pipe.model) == ["maskgit", "halton", "lpd-order", "lpd-confidence"]
    texts = ["8"] + [""] * 10  # halton's steps
    *_, summary, _, _, stats = compare(cache, str(export), "red circle", "", "", "halton", 0, 2.0, 1.0, 0, 1.0, texts)
    assert stats["ar"]["method"] == "maskgit" and stats["method"]["forward_passes"] == 8
    assert "| maskgit (the reference) | halton |" in summary


@pytest.mark.slow
def test_ship_puts_the_masked_export_beside_the_shared_tokenizer(quick_run, tmp_path):
    _, export = quick_run
    target = ship(export, "visar-tiny-maskgit-c2i", "a masked model", weights_dir=tmp_path)
    assert (tmp_path / "visar-tiny-vq" / "tokenizer.safetensors").is_file()
    assert (target / "tokenizer.safetensors").read_bytes() == (export / "tokenizer.safetensors").read_bytes()
    pipe = visar.load(str(target), device="cpu")
    assert pipe.model.model_kind == "masked" and pipe.name == "visar-tiny-maskgit-c2i"


@pytest.mark.slow
def test_masked_resume_is_exact(tmp_path):
    whole = train_masked(
        "visar-tiny-maskgit-c2i", tmp_path / "whole", TOKENIZER, steps=3, **{**QUICK, "checkpoint_every": 1}
    )
    train_masked("visar-tiny-maskgit-c2i", tmp_path / "split", TOKENIZER, steps=2, **{**QUICK, "checkpoint_every": 1})
    split = train_masked(
        "visar-tiny-maskgit-c2i", tmp_path / "split", TOKENIZER, steps=3, **{**QUICK, "checkpoint_every": 1}
    )
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_masked_inputs_follow_the_cosine_ratio():
    tokens = torch.arange(256).repeat(4, 1)
    inputs, masked = masked_inputs(tokens, 512, torch.Generator().manual_seed(0))
    assert masked.any(1).all() and torch.equal(inputs[masked], torch.full_like(inputs[masked], 512))
    assert torch.equal(inputs[~masked], tokens[~masked])


def test_unknown_masked_recipe(tmp_path):
    with pytest.raises(VisarError, match="unknown recipe"):
        train_masked("visar-tiny-c2i", tmp_path, TOKENIZER)
