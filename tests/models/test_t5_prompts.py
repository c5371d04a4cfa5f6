"""Prompts for text-to-image LlamaGen through transformers' T5EncoderModel, on a tiny random T5 saved to a folder:
visar's caption embeddings are transformers' own encoder states for the same ids, left-padded as LlamaGen's
sample_t2i.py pads them; prompts= generates what caption_embeds= of those embeddings generates."""

import json

import pytest
import torch
from conftest import fixtures_dir
from hub_cache import lay_out, lay_out_folder

import visar
from visar.errors import VisarError

transformers = pytest.importorskip("transformers")

WORDS = ["a", "red", "circle", "blue", "dog", "the", "on", "green", "square"]
PROMPTS = ["A red  circle", "the blue dog on a green square"]


def tiny_t5(folder, d_model: int = 16, seed: int = 0):
    """A 2-layer T5 encoder (flan-t5's gated GELU) and a unigram T5 tokenizer over WORDS, saved to `folder`."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581", -3.0)]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    config = transformers.T5Config(
        vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.T5EncoderModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory, offline):
    return tiny_t5(tmp_path_factory.mktemp("t5"))


def t2i_args():
    return json.loads((fixtures_dir("llamagen") / "tiny_gpt_t2i.json").read_text())["model_args"]


@pytest.fixture(scope="module")
def pipe(t5_folder):
    checkpoint = fixtures_dir("llamagen") / "tiny_gpt_t2i.pt"
    return visar.load("llamagen", checkpoint=checkpoint, model_args=t2i_args(), text_encoder=t5_folder, device="cpu")


def transformers_states(folder, prompts, max_length=120):
    """transformers' own tokenizer and encoder on the same (cleaned) prompts: right-padded ids, mask, states."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(
        [" ".join(p.lower().split()) for p in prompts], max_length=max_length, padding="max_length",
        truncation=True, return_tensors="pt",
    )  # fmt: skip
    encoder = transformers.T5EncoderModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return batch["input_ids"], batch["attention_mask"], states


def test_embeddings_are_transformers_states_left_padded(pipe, t5_folder):
    ids, mask, states = transformers_states(t5_folder, PROMPTS)
    visar_ids, _ = pipe.text_encoder.tokenize(PROMPTS)
    assert torch.equal(visar_ids, ids)
    embeds, visar_mask = pipe.text_encoder.encode(PROMPTS)
    assert embeds.shape == (2, 120, 16) and visar_mask.dtype == torch.bool
    for row, valid in enumerate(mask.sum(dim=1).tolist()):
        assert valid in (4, 8)  # the words and </s>
        torch.testing.assert_close(embeds[row, 120 - valid :], states[row, :valid], atol=0, rtol=0)
        assert not embeds[row, : 120 - valid].any()
        assert visar_mask[row].tolist() == [False] * (120 - valid) + [True] * valid


def test_prompts_generate_what_their_caption_embeddings_generate(pipe):
    embeds, mask = pipe.text_encoder.encode(PROMPTS)
    settings = dict(top_k=1, guidance_scale=3.0, output_type="tokens")
    by_prompt = pipe.generate(prompts=PROMPTS, **settings).tokens
    by_embeds = pipe.generate(caption_embeds=embeds, caption_mask=mask, **settings).tokens
    assert torch.equal(by_prompt, by_embeds)


def test_the_t2i_preset_fetches_flan_t5_only_when_prompts_need_it(tmp_path, monkeypatch, t5_folder):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llamagen = fixtures_dir("llamagen")
    lay_out(
        cache,
        "peizesun/llamagen_t2i",
        {"t2i_XL_stage1_256.pt": llamagen / "tiny_gpt_t2i.pt", "vq_ds16_t2i.pt": llamagen / "tiny_vq.pt"},
    )
    vq = json.loads((llamagen / "tiny_vq.json").read_text())
    vq_args = {**vq["model_args"], "ch": vq["encoder_decoder_ch"]}
    pipe = visar.load("llamagen-gpt-xl-t2i-256", model_args=t2i_args(), vq_args=vq_args, device="cpu")
    assert pipe.text_encoder.loaded is None  # not fetched yet
    embeds = torch.zeros(1, 120, 16)
    pipe.generate(caption_embeds=embeds, top_k=1, output_type="tokens")
    assert pipe.text_encoder.loaded is None
    with pytest.raises(VisarError, match="google/flan-t5-xl is not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        pipe.generate(prompts=PROMPTS[:1], top_k=1, output_type="tokens")
    lay_out_folder(cache, "google/flan-t5-xl", t5_folder)
    out = pipe.generate(prompts=PROMPTS, top_k=1, output_type="np")
    assert out.images.shape == (2, 8, 8, 3)


def test_bad_text_encoders(t5_folder, tmp_path):
    checkpoint = fixtures_dir("llamagen") / "tiny_gpt_t2i.pt"
    narrow = tiny_t5(tmp_path / "narrow", d_model=8)
    with pytest.raises(VisarError, match="gives 8-wide states but the model reads 16-wide captions"):
        visar.load("llamagen", checkpoint=checkpoint, model_args=t2i_args(), text_encoder=narrow, device="cpu")
    with pytest.raises(VisarError, match="cannot load a T5 encoder and its tokenizer"):
        visar.load("llamagen", checkpoint=checkpoint, model_args=t2i_args(), text_encoder=tmp_path, device="cpu")
    c2i = fixtures_dir("llamagen") / "tiny_gpt_c2i.pt"
    c2i_args = json.loads((fixtures_dir("llamagen") / "tiny_gpt_c2i.json").read_text())["model_args"]
    with pytest.raises(VisarError, match="text_encoder= is for text-to-image models"):
        visar.load("llamagen", checkpoint=c2i, model_args=c2i_args, text_encoder=t5_folder, device="cpu")
    with pytest.raises(VisarError, match="text_encoder= names the T5 encoder"):
        visar.load("default", text_encoder=t5_folder)
