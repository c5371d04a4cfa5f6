"""Models by Hugging Face Hub name, offline: a Hub cache laid out as huggingface_hub writes it (tests/hub_cache.py)
holds tiny weights under the released file names, and every family loads from it with HF_HUB_OFFLINE=1; each
bad input (missing name, revision, file, gated repository, wrong family) is one sentence, and nothing is written."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants  # submodules the package imports lazily
import huggingface_hub.errors
import pytest
import torch
from conftest import REPO, fixtures_dir
from hub_cache import commit_of, lay_out, lay_out_folder, listing
from laws import random_amused, random_emu3, random_janus, save_emu3_folder, save_janus_folder

import visar
from visar import hub
from visar.errors import CheckpointMismatchError, VisarError
from visar.registry import embedded_models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache, with HF_HUB_CACHE pointing at it and HF_HUB_OFFLINE=1."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def meta(family: str, name: str) -> dict:
    return json.loads((fixtures_dir(family) / f"tiny_{name}.json").read_text())


def llamagen_args():
    gpt, vq = meta("llamagen", "gpt_c2i"), meta("llamagen", "vq")
    return gpt["model_args"], {**vq["model_args"], "ch": vq["encoder_decoder_ch"]}


def var_args():
    var, vq = meta("var", "var"), meta("var", "vqvae")
    return var["constructor_kwargs"], {**vq["constructor_kwargs"], "ch_mult": vq["encoder_decoder_ch_mult"]}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_laid_out_cache_is_what_huggingface_hub_reads(cache):
    lay_out(cache, "FoundationVision/var", {"var_d16.pth": b"abc", "sub/x.json": b"{}"})
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "FoundationVision/var" and repo.nb_files == 2
    assert {r.commit_hash for r in repo.revisions} == {commit_of("FoundationVision/var", "main")}
    path = huggingface_hub.hf_hub_download(
        "FoundationVision/var", "var_d16.pth", cache_dir=cache, local_files_only=True
    )
    assert Path(path).read_bytes() == b"abc"


def test_llamagen_c2i_preset_fetches_its_released_files(cache):
    folder = fixtures_dir("llamagen")
    lay_out(
        cache,
        "FoundationVision/LlamaGen",
        {"c2i_B_256.pt": folder / "tiny_gpt_c2i.pt", "vq_ds16_c2i.pt": folder / "tiny_vq.pt"},
    )
    model_args, vq_args = llamagen_args()
    pipe = visar.load("llamagen-gpt-b-c2i-256", model_args=model_args, vq_args=vq_args, device="cpu")
    direct = visar.load(
        "llamagen",
        checkpoint=folder / "tiny_gpt_c2i.pt",
        model_args=model_args,
        vq_checkpoint=folder / "tiny_vq.pt",
        vq_args=vq_args,
        device="cpu",
    )
    assert same_weights(pipe.model, direct.model) and same_weights(pipe.tokenizer, direct.tokenizer)
    assert pipe.defaults["guidance_scale"] == 4.0  # the preset's (sample_c2i.py's) defaults
    settings = dict(class_labels=[1, 2], top_k=1, guidance_scale=2.0)
    out = pipe.generate(**settings, output_type="np")
    torch.testing.assert_close(out.tokens, direct.generate(**settings, output_type="tokens").tokens)
    assert out.images.shape == (2, 8, 8, 3)


def test_llamagen_t2i_preset_fetches_from_the_t2i_repository(cache):
    folder = fixtures_dir("llamagen")
    lay_out(
        cache,
        "peizesun/llamagen_t2i",
        {"t2i_XL_stage1_256.pt": folder / "tiny_gpt_t2i.pt", "vq_ds16_t2i.pt": folder / "tiny_vq.pt"},
    )
    _, vq_args = llamagen_args()
    pipe = visar.load(
        "llamagen-gpt-xl-t2i-256", model_args=meta("llamagen", "gpt_t2i")["model_args"], vq_args=vq_args, device="cpu"
    )
    assert not pipe.is_class_conditional and pipe.tokenizer is not None


def test_var_preset_and_revisions(cache):
    folder = fixtures_dir("var")
    lay_out(
        cache,
        "FoundationVision/var",
        {"var_d16.pth": folder / "tiny_var.pt", "vae_ch160v4096z32.pth": folder / "tiny_vqvae.pt"},
    )
    # another revision of the repository holds the shared-AdaLN weights under the same name
    lay_out(
        cache,
        "FoundationVision/var",
        {"var_d16.pth": folder / "tiny_var_saln.pt", "vae_ch160v4096z32.pth": folder / "tiny_vqvae.pt"},
        revision="saln",
    )
    model_args, vq_args = var_args()
    pipe = visar.load("var-d16", model_args=model_args, vq_args=vq_args, device="cpu")
    assert hasattr(pipe.model.blocks[0], "ada_lin")
    saln_args = meta("var", "var_saln")["constructor_kwargs"]
    other = visar.load("var-d16", model_args=saln_args, vq_args=vq_args, device="cpu", revision="saln")
    assert other.model.config.shared_aln
    tokens = pipe.generate(class_labels=[0, 3], top_k=1, output_type="tokens").tokens
    assert [t.shape[1:] for t in tokens] == [(1, 1), (2, 2), (4, 4)]
    with pytest.raises(VisarError, match="FoundationVision/var@v9.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        visar.load("var-d16", model_args=model_args, vq_args=vq_args, device="cpu", revision="v9")


def test_mar_presets_say_where_their_release_is(cache):
    with pytest.raises(VisarError, match="Dropbox, not on the Hugging Face Hub.*util/download.py.*checkpoint=PATH"):
        visar.load("mar-base")


def test_an_offline_miss_names_hf_hub_offline_and_the_path_form_and_writes_nothing(cache):
    before = listing(cache)
    miss = r"c2i_B_256.pt of FoundationVision/LlamaGen is not in .*HF_HUB_OFFLINE is set.*checkpoint=PATH"
    with pytest.raises(VisarError, match=miss):
        visar.load("llamagen-gpt-b-c2i-256")
    with pytest.raises(
        VisarError, match=r"someone/no-such-model is not in the Hugging Face cache.*visar.load\(FOLDER\)"
    ):
        visar.load("someone/no-such-model")
    assert listing(cache) == before


def test_a_file_of_another_family_under_a_released_name(cache):
    var = fixtures_dir("var")
    lay_out(
        cache,
        "FoundationVision/LlamaGen",
        {"c2i_B_256.pt": var / "tiny_var.pt", "vq_ds16_c2i.pt": var / "tiny_vqvae.pt"},
    )
    with pytest.raises(CheckpointMismatchError, match="c2i_B_256.pt does not fit the model"):
        visar.load("llamagen-gpt-b-c2i-256", device="cpu")


def test_a_repository_of_loose_files_or_an_unsupported_model(cache):
    lay_out(cache, "FoundationVision/LlamaGen", {"c2i_B_256.pt": b"x"})
    with pytest.raises(VisarError, match="holds no model folder.*load the preset"):
        visar.load("FoundationVision/LlamaGen")
    lay_out(
        cache, "google-bert/bert-base-uncased", {"config.json": json.dumps({"architectures": ["BertModel"]}).encode()}
    )
    with pytest.raises(VisarError, match="transformers BertModel model, which visar cannot generate images with"):
        visar.load("google-bert/bert-base-uncased")


def http_error(cls, message):
    import httpx2

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/x"))
    return cls(message, response=response)


@pytest.mark.parametrize(
    "error, match",
    [
        ("RepositoryNotFoundError", r"no Hub repository 'FoundationVision/LlamaGen' \(or it is private"),
        ("RevisionNotFoundError", "FoundationVision/LlamaGen has no revision 'v0': pass an existing branch"),
        ("GatedRepoError", r"is gated: accept its terms.*checkpoint=PATH"),
        ("RemoteEntryNotFoundError", "FoundationVision/LlamaGen@v0 has no file c2i_B_256.pt"),
    ],
)
def test_online_failures_are_one_sentence(monkeypatch, tmp_path, error, match):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def refuse(*args, **kwargs):
        raise http_error(getattr(huggingface_hub.errors, error), "refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refuse)  # the Hub answers visar's first request
    with pytest.raises(VisarError, match=match) as caught:
        visar.load("llamagen-gpt-b-c2i-256", revision="v0")
    assert "\n" not in str(caught.value)
    if error == "RepositoryNotFoundError":  # a Hub name is also what a mistyped relative folder looks like
        with pytest.raises(VisarError, match="no Hub repository 'models/mine'.*and no folder models/mine on this"):
            visar.load("models/mine")


UNREACHABLE = r"cannot reach the Hugging Face Hub and c2i_B_256.pt of FoundationVision/LlamaGen is not in the cache"


def test_a_hub_that_does_not_answer_is_said_at_once_without_the_download_retries(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    downloads = []

    def no_answer(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_answer)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: downloads.append(a))
    with pytest.raises(VisarError, match=UNREACHABLE + r".*connect and retry, or load by path"):
        visar.load("llamagen-gpt-b-c2i-256")
    with pytest.raises(VisarError, match="config.json of deepseek-community/Janus-Pro-1B is not in the cache"):
        visar.load("deepseek-ai/Janus-Pro-1B")
    assert downloads == []  # huggingface_hub's download would retry for about 24 s first


@pytest.mark.slow  # a fresh interpreter, whose huggingface_hub reads HF_ENDPOINT at import
def test_loading_from_a_hub_that_refuses_connections_fails_in_a_second(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HUB_CACHE": str(tmp_path),
        "PYTHONPATH": str(REPO),
    }
    env.pop("HF_HUB_OFFLINE", None)
    timed = (
        "import time, visar\n"
        "start = time.perf_counter()\n"
        "try:\n    visar.load('llamagen-gpt-b-c2i-256')\n"
        "except visar.VisarError as err:\n    print(f'{time.perf_counter() - start:.2f}', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", timed], env=env, capture_output=True, text=True, timeout=120)
    seconds, message = result.stdout.split(" ", 1)
    assert re.match(UNREACHABLE, message), result.stdout + result.stderr
    assert float(seconds) < 5 and "Retrying" not in result.stderr, result.stderr


def test_revision_is_for_hub_names():
    with pytest.raises(VisarError, match="revision= picks a version of a Hub repository"):
        visar.load("default", revision="main")


# -- visar's own model folders by Hub name -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["visar-tiny-c2i", "visar-tiny-var-c2i"])
def test_an_embedded_model_folder_published_on_the_hub_loads_by_its_repo_id(cache, name):
    """An embedded folder uploaded as is (models--owner--name/snapshots/<commit>/, files as links to blobs)
    loads by repo id offline: nothing in it may name a file beside the folder, which the Hub would not have."""
    snapshot = lay_out_folder(cache, f"someone/{name}", embedded_models()[name])
    assert snapshot.parent.name == "snapshots" and (snapshot / "tokenizer.safetensors").is_symlink()
    by_name = visar.load(f"someone/{name}", device="cpu")
    by_folder = visar.load(name, device="cpu")
    assert same_weights(by_name.tokenizer, by_folder.tokenizer)
    a = by_name.generate(class_labels=[13], seed=5, output_type="np")
    b = by_folder.generate(class_labels=[13], seed=5, output_type="np")
    tokens_a, tokens_b = (t if isinstance(t, list) else [t] for t in (a.tokens, b.tokens))
    assert len(tokens_a) == len(tokens_b) and all(map(torch.equal, tokens_a, tokens_b))
    assert (a.images == b.images).all()


# -- Hugging Face folders by Hub name -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, offline):
    """Tiny random Janus, Emu3 and aMUSEd save_pretrained folders (the hf tests' own models)."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")

    root = tmp_path_factory.mktemp("hf")
    amused = root / "amused"
    random_amused(seed=0).save_pretrained(amused)
    return {
        "janus": Path(save_janus_folder(random_janus(grid=4, image_vocab=16, seed=0), root / "janus")),
        "emu3": Path(save_emu3_folder(random_emu3(image_vocab=16, seed=0), 16, root / "emu3")),
        "amused": amused,
    }


def hub_and_folder_agree(name, folder, prompts, **load):
    by_name = visar.load(name, device="cpu", **load)
    by_folder = visar.load(str(folder), device="cpu", **load)
    assert by_name.name == name
    a = by_name.generate(prompts=prompts, output_type="tokens", seed=3).tokens
    b = by_folder.generate(prompts=prompts, output_type="tokens", seed=3).tokens
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["deepseek-community/Janus-Pro-1B", "deepseek-ai/Janus-Pro-1B"])
def test_janus_by_hub_name(cache, hf_folders, name):
    lay_out_folder(cache, "deepseek-community/Janus-Pro-1B", hf_folders["janus"])
    hub_and_folder_agree(name, hf_folders["janus"], ["a red circle"], model_args={"max_prompt_tokens": 16})


def test_emu3_by_hub_name(cache, hf_folders):
    from visar.families.hf_emu3 import TINY_OPTIONS

    lay_out_folder(cache, "BAAI/Emu3-Gen-hf", hf_folders["emu3"])
    hub_and_folder_agree("BAAI/Emu3-Gen-hf", hf_folders["emu3"], ["a red circle"], model_args=TINY_OPTIONS)


def test_amused_by_hub_name(cache, hf_folders):
    lay_out_folder(cache, "amused/amused-256", hf_folders["amused"])
    hub_and_folder_agree("amused/amused-256", hf_folders["amused"], ["a red circle"])


@pytest.mark.slow  # a fresh interpreter
def test_the_cli_reads_hf_home_and_hf_hub_offline_in_a_fresh_process(tmp_path, hf_folders):
    """`--model <Hub name>` on a command, in a new interpreter whose environment names the cache (HF_HOME)."""
    lay_out_folder(tmp_path / "home" / "hub", "deepseek-community/Janus-Pro-1B", hf_folders["janus"])
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "visar", "generate", "--model", "deepseek-ai/Janus-Pro-1B", "--device", "cpu",
               "--prompt", "a red circle", "--n", "1", "--out", str(out),
               "--model-arg", "max_prompt_tokens=16"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(list(out.glob("*.png"))) == 1
    assert hub.CONVERTED["deepseek-ai/Janus-Pro-1B"] == "deepseek-community/Janus-Pro-1B"
