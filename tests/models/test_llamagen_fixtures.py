"""Strict loading of the official-code LlamaGen fixtures and exact reproduction of their outputs."""

import json

import pytest
import torch
from conftest import TEST_DEVICE, fixtures_dir
from safetensors.torch import load_file

import visar
from visar.models.llamagen import LlamaGen, preset_config
from visar.tokenizers.vq import VQ_PRESETS, VQModel


def fixture(name):
    """(folder, meta, io): the io tensors on the test device, where the pipelines run."""
    folder = fixtures_dir("llamagen")
    meta = json.loads((folder / f"tiny_{name}.json").read_text())
    return folder, meta, load_file(str(folder / f"tiny_{name}_io.safetensors"), device=str(TEST_DEVICE))


def vq_args(meta):
    return {**meta["model_args"], "ch": meta["encoder_decoder_ch"]}


@pytest.fixture(scope="module")
def c2i_pipe():
    folder, meta, _ = fixture("gpt_c2i")
    _, vq_meta, _ = fixture("vq")
    return visar.load(
        "llamagen",
        checkpoint=folder / "tiny_gpt_c2i.pt",
        model_args=meta["model_args"],
        vq_checkpoint=folder / "tiny_vq.pt",
        vq_args=vq_args(vq_meta),
        device=TEST_DEVICE,
    )


@pytest.fixture(scope="module")
def t2i_pipe():
    folder, meta, _ = fixture("gpt_t2i")
    checkpoint = folder / "tiny_gpt_t2i.pt"
    return visar.load("llamagen", checkpoint=checkpoint, model_args=meta["model_args"], device=TEST_DEVICE)


def test_c2i_teacher_forced_logits(c2i_pipe):
    _, _, io = fixture("gpt_c2i")
    logits = c2i_pipe.model(io["tokens"][:, :-1], io["labels"], input_pos=io["input_pos"])
    torch.testing.assert_close(logits, io["logits_teacher_forced"], atol=1e-4, rtol=0)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), io["tokens"].reshape(-1))
    torch.testing.assert_close(loss.reshape(1), io["loss"], atol=1e-4, rtol=0)


def test_c2i_pipeline_logits_rows_predict_tokens(c2i_pipe):
    _, _, io = fixture("gpt_c2i")
    # Pipeline.logits takes only real classes; the fixture's third label is the null class.
    logits = c2i_pipe.logits(io["tokens"][:2], class_labels=io["labels"][:2])
    torch.testing.assert_close(logits, io["logits_teacher_forced"][:2], atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", [1.0, 2.0])
def test_c2i_greedy_generation(c2i_pipe, cfg):
    _, meta, io = fixture("gpt_c2i")
    out = c2i_pipe.generate(
        class_labels=meta["generate_kwargs"]["cond"], guidance_scale=cfg, top_k=1, output_type="tokens"
    )
    assert torch.equal(out.tokens.reshape(2, -1), io[f"gen_tokens_cfg{int(cfg)}"])
    assert out.stats["forward_passes"] == 16


def test_c2i_naive_logits_of_generated_sequence(c2i_pipe):
    _, _, io = fixture("gpt_c2i")
    tokens, labels = io["gen_tokens_cfg2"], torch.tensor([3, 7], device=TEST_DEVICE)
    cond = c2i_pipe.model(tokens[:, :-1], labels)
    uncond = c2i_pipe.model(tokens[:, :-1], torch.full_like(labels, 10))
    torch.testing.assert_close(uncond + (cond - uncond) * 2, io["gen_naive_logits_cfg2"], atol=1e-4, rtol=0)


def test_t2i_teacher_forced_logits(t2i_pipe):
    _, _, io = fixture("gpt_t2i")
    logits = t2i_pipe.model(io["tokens"][:, :-1], io["caption"], input_pos=io["input_pos"])
    torch.testing.assert_close(logits, io["logits_teacher_forced"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "key,cfg,masked",
    [("gen_tokens_cfg1", 1.0, True), ("gen_tokens_cfg2", 2.0, True), ("gen_tokens_cfg1_nomask", 1.0, False)],
)
def test_t2i_greedy_generation(t2i_pipe, key, cfg, masked):
    _, _, io = fixture("gpt_t2i")
    mask = io["emb_masks"] if masked else None
    out = t2i_pipe.generate(
        caption_embeds=io["caption"], caption_mask=mask, guidance_scale=cfg, top_k=1, output_type="tokens"
    )
    assert torch.equal(out.tokens.reshape(2, -1), io[key])


def test_vq_codes_and_images(c2i_pipe):
    _, _, io = fixture("vq")
    vq = c2i_pipe.tokenizer
    with torch.no_grad():
        torch.testing.assert_close(vq.pre_quant(io["image"]), io["pre_quant"], atol=1e-4, rtol=1e-4)
        codes = vq.encode(io["image"])
        assert codes.shape == (2, 4, 4)
        assert torch.equal(codes.reshape(2, -1), io["codes"])
        z_q, _, _ = vq.quantize(vq.pre_quant(io["image"]))
        torch.testing.assert_close(z_q, io["quant"], atol=1e-4, rtol=1e-4)
        decoded = vq.decode(io["decode_codes"].reshape(2, 4, 4))
        torch.testing.assert_close(decoded, io["decoded_image"], atol=1e-4, rtol=1e-4)
        reconstruction, _, _ = vq(io["image"])
        torch.testing.assert_close(reconstruction, io["reconstruction"], atol=1e-4, rtol=1e-4)


def test_pipeline_decodes_fixture_tokens_to_images(c2i_pipe):
    _, _, io = fixture("vq")
    images = c2i_pipe.decode(io["decode_codes"].reshape(2, 4, 4))
    torch.testing.assert_close(images, ((io["decoded_image"] + 1) / 2).clamp(0, 1), atol=1e-4, rtol=0)


GPT_MANIFESTS = [
    ("GPT-B_c2i", "GPT-B", "c2i", 256),
    ("GPT-L_c2i", "GPT-L", "c2i", 256),
    ("GPT-XL_c2i", "GPT-XL", "c2i", 256),
    ("GPT-XXL_c2i", "GPT-XXL", "c2i", 576),
    ("GPT-3B_c2i", "GPT-3B", "c2i", 576),
    ("GPT-XL_t2i", "GPT-XL", "t2i", 256),
]


@pytest.mark.parametrize("manifest,size,model_type,tokens", GPT_MANIFESTS)
def test_gpt_preset_matches_manifest(manifest, size, model_type, tokens):
    data = json.loads((fixtures_dir("llamagen") / f"manifest_{manifest}.json").read_text())
    with torch.device("meta"):
        model = LlamaGen(preset_config(size, model_type, tokens))
    ours = [(k, list(v.shape)) for k, v in model.state_dict().items()]
    assert ours == list(data["state_dict"].items())
    assert model.num_parameters() == data["num_parameters"]
    assert model.config.ffn_hidden_dim == data["ffn_hidden_dim"]


def test_vq16_preset_matches_manifest():
    data = json.loads((fixtures_dir("llamagen") / "manifest_VQ-16.json").read_text())
    with torch.device("meta"):
        vq = VQModel(VQ_PRESETS["VQ-16"])
    assert [(k, list(v.shape)) for k, v in vq.state_dict().items()] == list(data["state_dict"].items())
    assert sum(p.numel() for p in vq.parameters()) == data["num_parameters"]


def test_registered_presets_build_on_meta():
    for name, preset in visar.registry.OFFICIAL_PRESETS.items():
        if preset.family != "llamagen":  # other families' presets are tested with their fixtures
            continue
        with torch.device("meta"):
            model = LlamaGen(visar.models.llamagen.LlamaGenConfig(**preset.model_args))
        assert model.num_image_tokens == preset.model_args["block_size"], name
