"""Safe, strict checkpoint loading with clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import visar
from visar.errors import CheckpointMismatchError, VisarError
from visar.families.llamagen import load_model_weights
from visar.models.llamagen import LlamaGen, LlamaGenConfig, preset_config
from visar.registry import embedded_models

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)


def tiny_state(**kw):
    torch.manual_seed(0)
    return LlamaGen(LlamaGenConfig(**{**TINY, **kw})).state_dict()


@pytest.mark.parametrize("wrapper", ["model", "module", "state_dict", None])
def test_wrappers_and_extra_rope_key(tmp_path, wrapper):
    state = tiny_state()
    saved = {**state, "freqs_cis": torch.zeros(17, 8, 2)}
    torch.save(saved if wrapper is None else {wrapper: saved, "args": {"lr": 1.0}}, tmp_path / "ckpt.pt")
    pipe = visar.load("llamagen", checkpoint=tmp_path / "ckpt.pt", model_args=TINY, device="cpu")
    for key, value in state.items():
        assert torch.equal(pipe.model.state_dict()[key], value)


def test_safetensors_checkpoint(tmp_path):
    state = tiny_state()
    save_file(state, tmp_path / "model.safetensors")
    pipe = visar.load("llamagen", checkpoint=tmp_path / "model.safetensors", model_args=TINY, device="cpu")
    assert torch.equal(pipe.model.tok_embeddings.weight, state["tok_embeddings.weight"])


def test_wrong_shape_names_keys_and_fitting_preset(tmp_path):
    with torch.device("meta"):
        gpt_b = LlamaGen(preset_config("GPT-B", "c2i", 256))
    # stride-0 views of one zero: the file holds GPT-B's shapes without GPT-B's size in zeros
    state = {k: torch.zeros(()).expand(v.shape) for k, v in gpt_b.state_dict().items()}
    path = tmp_path / "b.pt"
    torch.save({"model": state}, path)
    with pytest.raises(CheckpointMismatchError) as err:
        visar.load("llamagen-gpt-l-c2i-256", checkpoint=path, device="cpu")
    message = str(err.value)
    assert "expected [1001, 1024], found [1001, 768]" in message
    assert "llamagen-gpt-b-c2i" in message


def test_missing_and_unexpected_keys_are_named_and_nothing_is_loaded():
    model = LlamaGen(LlamaGenConfig(**TINY))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = tiny_state()
    state.pop("layers.1.ffn_norm.weight")
    state["extra.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointMismatchError, match="missing layers.1.ffn_norm.weight.*unexpected extra.weight"):
        from visar.checkpoints import load_strict

        load_strict(model, state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), "a failed load must leave the model untouched"


def test_corrupt_truncated_and_missing_files(tmp_path):
    model = LlamaGen(LlamaGenConfig(**TINY))
    good = tmp_path / "good.pt"
    torch.save({"model": tiny_state()}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(VisarError, match="corrupt, truncated"):
        load_model_weights(model, truncated, "x")
    with pytest.raises(VisarError, match="not found"):
        load_model_weights(model, tmp_path / "absent.pt", "x")
    not_state = tmp_path / "list.pt"
    torch.save([1, 2, 3], not_state)
    with pytest.raises(VisarError, match="no state_dict"):
        load_model_weights(model, not_state, "x")


def test_unknown_model_args_field():
    with pytest.raises(VisarError, match="unknown LlamaGen model_args"):
        LlamaGenConfig.from_dict({"dim": 64, "n_layers": 2})


@pytest.mark.parametrize("key", ["model", "tokenizer", "text_encoder"])
@pytest.mark.parametrize("where", ["sibling", "absolute"])
def test_a_folder_naming_a_file_outside_itself_is_refused(tmp_path, key, where):
    """A config.json whose weights name a file out of its folder is refused with one sentence, even where
    that file exists (as the shipped folders' ../visar-tiny-vq/ did): a copy of the folder alone, or its
    Hub repository, would lack it. The unchanged copy loads (control)."""
    folder = tmp_path / "models" / "t2i"
    shutil.copytree(embedded_models()["visar-tiny-t2i"], folder)
    visar.load(str(folder), device="cpu")
    config = json.loads((folder / "config.json").read_text())
    file = config["weights"][key]
    outside = tmp_path / "models" / "shared" / file
    outside.parent.mkdir()
    (folder / file).rename(outside)
    config["weights"][key] = "../shared/" + file if where == "sibling" else str(outside)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        VisarError, match=rf"names weights '{key}' as .*outside its folder: a model folder must be self-contained"
    ):
        visar.load(str(folder), device="cpu")


def test_a_path_that_stays_in_the_folder_is_allowed(tmp_path):
    folder = tmp_path / "c2i"
    shutil.copytree(embedded_models()["visar-tiny-c2i"], folder)
    (folder / "vq").mkdir()
    (folder / "tokenizer.safetensors").rename(folder / "vq" / "tokenizer.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["weights"]["tokenizer"] = "vq/../vq/tokenizer.safetensors"
    (folder / "config.json").write_text(json.dumps(config))
    assert visar.load(str(folder), device="cpu").name == "visar-tiny-c2i"
