"""Lumina-mGPT 1.0 and 2.0 against the official code's own outputs (tests/fixtures/lumina, made by
tools/lumina_fixtures.py running Alpha-VLLM/Lumina-mGPT and Lumina-mGPT-2.0 on tiny seeded models).

A release folder is rebuilt from each fixture (config.json as the official save_pretrained wrote it, the
seeded weights in the official layout, the tokenizer files, the VQ checkpoint as the official loader reads
it) and loaded offline with `visar.load(FOLDER)`:
(a) the load is strict and the weights are the official ones (sha256); the transformer's logits equal the
official forward's (full vocabulary rows within 1e-4), and the adapter's image logits too;
(b) the prompt ids equal the official item processor's, header included;
(c) greedy image codes equal the official vanilla generate's (cfg 1, 3 and 5, the last through 2.0's
schedule; two sizes, one not square) for every lossless method, and a batch of the two prompts equals
the two official calls; 1.0's codes come from the image tokens' names;
(d) the VQ decodes the official codes to the official float pixels within 1e-4 and encodes the official
image to the official indices;
bad input: a size off the grid unit, a prompt too long, no tokenizer, no VQ files offline, unknown options.
The sampling law under every lossless method: tests/models/test_hf_lumina_law.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_tool

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

import visar  # noqa: E402
from visar.errors import VisarError  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "lumina"
VERSIONS = [1, 2]
# ar in the quick tier; the drafting methods (a minute each on 2.0's 12 x 12 cases) in the slow one
EXACT_METHODS = ["ar"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("sjd", "mc-sjd", "sjd-pac", "tree-mc-sjd")]


def cases(version: int) -> dict:
    return json.loads((FIXTURES / f"v{version}" / "cases.json").read_text())


def write_release(version: int, folder: Path) -> Path:
    """A release folder as its authors publish it, plus the tokenizer and VQ files the official code reads
    from elsewhere, rebuilt from the fixtures (the weights checked against their sha256)."""
    return load_tool("lumina_fixtures").release_folder(version, FIXTURES, folder)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lumina")
    return {v: write_release(v, root / f"lumina{v}") for v in VERSIONS}


def load(releases, version: int, width: int = 64, height: int = 64, **options):
    return visar.load(str(releases[version]), device="cpu", model_args={"width": width, "height": height, **options})


@pytest.mark.parametrize("version", VERSIONS)
def test_loads_strictly_with_the_official_defaults(releases, version, offline):
    pipe = load(releases, version)
    assert type(pipe.model).__name__ == "HFLumina" and pipe.model.version == version
    assert pipe.model.hf.model.vqmodel is None  # the releases hold no VQ module; none is built
    assert pipe.defaults["top_k"] == (2000 if version == 1 else 4096) and pipe.defaults["guidance_scale"] == 4.0
    grid = (4, 4) if version == 1 else (8, 8)  # 16 and 8 pixels per token
    assert pipe.model.grid_size == grid and pipe.tokenizer.vocab_size == (8192 if version == 1 else 16384)
    norms = pipe.model.hf.model.layers[0].self_attn.q_norm.weight
    stored = load_file(str(releases[version] / "model.safetensors"))["model.layers.0.self_attn.q_norm.weight"]
    assert norms.shape == (4, 8) and torch.equal(norms, stored.repeat_interleave(4 // stored.shape[0], dim=0))


@pytest.mark.parametrize("version", VERSIONS)
def test_logits_equal_the_official_forward(releases, version, offline):
    data = cases(version)
    io = load_file(str(FIXTURES / f"v{version}" / "logits.safetensors"))
    case = next(c for c in data["cases"] if c["name"] == data["logits_case"])
    pipe = load(releases, version, case["width"], case["height"])
    hf = pipe.model.hf
    with torch.no_grad():
        for side in ("cond", "uncond"):
            ids = io[f"{side}_input_ids"].reshape(1, -1)
            hidden = hf.model(input_ids=ids).last_hidden_state[0, io[f"{side}_positions"]]
            logits = hf.lm_head(hidden).float()
            torch.testing.assert_close(logits.logsumexp(-1), io[f"{side}_logsumexp"], atol=1e-4, rtol=1e-5)
            if version == 1:
                torch.testing.assert_close(logits, io[f"{side}_logits"], atol=1e-4, rtol=1e-5)
            else:
                torch.testing.assert_close(logits[:, 155000:171384], io[f"{side}_logits_image"], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("version", VERSIONS)
def test_prompt_ids_equal_the_official_item_processor(releases, version, offline):
    data = cases(version)["cases"]
    for size in sorted({(c["width"], c["height"]) for c in data}):
        encoder = load(releases, version, *size).text_encoder
        for case in (c for c in data if (c["width"], c["height"]) == size):
            ids, mask = encoder.encode([case["prompt"]])
            assert ids[0][mask[0]].tolist() == case["prompt_ids"], case["name"]


def official_codes(case) -> torch.Tensor:
    return torch.tensor(case["codes"]).reshape(case["grid"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("method", EXACT_METHODS)
def test_greedy_codes_equal_the_official_generate(releases, version, method, offline):
    data = cases(version)["cases"]
    for size in sorted({(c["width"], c["height"]) for c in data}):
        pipe = load(releases, version, *size)
        for cfg in sorted({c["cfg"] for c in data}):
            same = [c for c in data if (c["width"], c["height"]) == size and c["cfg"] == cfg]
            if not same:
                continue
            out = pipe.generate(
                prompts=[c["prompt"] for c in same], method=method, guidance_scale=cfg, top_k=1, output_type="tokens"
            )
            for case, tokens in zip(same, out.tokens, strict=True):  # a batch of prompts of different lengths
                assert torch.equal(tokens.cpu(), official_codes(case)), (case["name"], method)


def test_1_0_reads_codes_from_token_names(releases, offline):
    """The fixture's names are permuted over ids 4..8195: a code taken as id - 4 would be wrong."""
    pipe = load(releases, 1)
    data = cases(1)["cases"][0]
    body = [t for t in data["generated_ids"] if 4 <= t <= 8195]
    ids = pipe.model.visual_ids[official_codes(data).reshape(-1)]
    assert ids.tolist() == body
    assert (torch.tensor(body) - 4 != official_codes(data).reshape(-1)).any()


@pytest.mark.parametrize("version", VERSIONS)
def test_the_vq_decodes_and_encodes_as_the_official_one(releases, version, offline):
    io = load_file(str(FIXTURES / f"v{version}" / "vq_io.safetensors"))
    tokenizer = load(releases, version).tokenizer
    height, width = io["decode_pixels"].shape[1:]
    codes = io["decode_codes"].long().reshape(1, height // tokenizer.downsampling, width // tokenizer.downsampling)
    with torch.no_grad():
        pixels = tokenizer.decode(codes)[0]
        torch.testing.assert_close(pixels, io["decode_pixels"], atol=1e-4, rtol=0)
        image = io["encode_image"].permute(2, 0, 1)[None].double() / 255 * 2 - 1
        codes = tokenizer.encode(image.float())
    assert codes.reshape(-1).tolist() == io["encode_indices"].reshape(-1).tolist()


@pytest.mark.parametrize("version", VERSIONS)
def test_8_bit_pixels_are_the_official_ones(releases, version, offline):
    """1.0 truncates ((x + 1) / 2 * 255 as uint8), 2.0 rounds: the pipeline's images are the official bytes."""
    io = load_file(str(FIXTURES / f"v{version}" / "vq_io.safetensors"))
    pipe = load(releases, version)
    height, width = io["decode_pixels"].shape[1:]
    step = pipe.tokenizer.downsampling
    codes = io["decode_codes"].long().reshape(1, height // step, width // step)
    pixels = pipe.to_output(pipe.decode(codes), "np")[0]
    different = (pixels.astype(int) != io["decode_uint8"].numpy().astype(int)).mean()
    assert different <= 1e-3, different  # float noise may tip a pixel that sits on a level's edge


# -- bad input -------------------------------------------------------------------------------------------------


def test_bad_input_is_one_sentence(releases, tmp_path, offline):
    with pytest.raises(VisarError, match="multiple of 32"):
        load(releases, 1, width=100)
    with pytest.raises(VisarError, match="unknown model_args"):
        load(releases, 1, ratio="1:1")
    with pytest.raises(VisarError, match="condition positions"):
        load(releases, 1, max_prompt_tokens=8).generate(prompts=["a red fox"], output_type="tokens")
    with pytest.raises(VisarError, match="context"):
        load(releases, 1, width=2048, height=2048)
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(releases[2], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    with pytest.raises(VisarError, match="no text tokenizer"):
        visar.load(str(no_tokenizer), device="cpu")
    no_vq = tmp_path / "no_vq"
    shutil.copytree(releases[1], no_vq)
    (no_vq / "vqgan.ckpt").unlink()
    with pytest.raises(VisarError, match="vqgan"):
        visar.load(str(no_vq), device="cpu", model_args={"width": 64})


# -- by Hub name: what each release repository holds, the rest from the repositories the official code uses ----


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def test_1_0_by_hub_name_fetches_its_tokenizer_and_vq_from_their_repositories(releases, hub_cache):
    from hub_cache import lay_out, lay_out_files

    release = releases[1]
    lay_out_files(hub_cache, "Alpha-VLLM/Lumina-mGPT-7B-512", release, ["config.json", "model.safetensors"])
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    lay_out_files(hub_cache, "Alpha-VLLM/Lumina-mGPT-7B-768", release, tokenizer_files)
    vq = {f"original_tokenizers/{n}": release / n for n in ("vqgan.yaml", "vqgan.ckpt")}
    lay_out(hub_cache, "Alpha-VLLM/Chameleon_7B_mGPT", vq)
    by_name = visar.load("Alpha-VLLM/Lumina-mGPT-7B-512", device="cpu", model_args={"max_prompt_tokens": 32})
    assert by_name.model.grid_size == (32, 32)  # the repository's size, 512 pixels at 16 per token
    by_name = visar.load("Alpha-VLLM/Lumina-mGPT-7B-512", device="cpu", model_args={"width": 64, "height": 96})
    by_folder = load(releases, 1, 64, 96)
    a = by_name.generate(prompts=["a red fox"], output_type="tokens", seed=3).tokens
    b = by_folder.generate(prompts=["a red fox"], output_type="tokens", seed=3).tokens
    assert torch.equal(a, b)


def test_2_0_by_hub_name_and_a_missing_vq_offline(releases, hub_cache):
    from hub_cache import lay_out_files

    release = releases[2]
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    lay_out_files(hub_cache, "Alpha-VLLM/Lumina-mGPT-2.0", release, names)
    with pytest.raises(VisarError, match="movqgan_270M.ckpt"):  # MoVQGAN's repository is not cached, and offline
        visar.load("Alpha-VLLM/Lumina-mGPT-2.0", device="cpu", model_args={"width": 32})
    lay_out_files(hub_cache, "ai-forever/MoVQGAN", release, ["movqgan_270M.ckpt"])
    pipe = visar.load("Alpha-VLLM/Lumina-mGPT-2.0", device="cpu", model_args={"width": 32, "height": 64})
    case = next(c for c in cases(2)["cases"] if (c["width"], c["height"], c["cfg"]) == (32, 64, 5.0))
    out = pipe.generate(prompts=[case["prompt"]], guidance_scale=5.0, top_k=1, output_type="tokens")
    assert torch.equal(out.tokens[0], official_codes(case))
