"""Janus through transformers: a tiny random `JanusForConditionalGeneration`, saved with save_pretrained and
loaded offline through `visar.load(FOLDER)`, against transformers' own image generation.

(a) greedy image tokens equal `generate(..., generation_mode="image", do_sample=False)` at CFG 1 and
at CFG 5 (the model's default), for a batch of left-padded prompts of different lengths;
(b) teacher-forced image-token logits equal those of transformers' own decoder call (2-D padding
mask, its own mask builder, no cache);
(c) ar, sjd and mc-sjd on the adapter sample the enumerated joint law (image vocabulary 6, 2 x 2
tokens) of each prompt, in one batch that mixes two prompts of different lengths, and an image
decoded alone equals its tokens in that batch;
bad input: folders of models that generate no images, prompts too long, a draft of another family.
Every raster method on the tiny Janus: tests/accel/test_method_conformance.py (the family registers tiny args).
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from laws import (  # noqa: E402
    greedy_under_guidance,
    prompt_law,
    random_janus,
    sample_each_prompt_s_law,
    save_janus_folder,
    tiny_llamagen,
)

import visar  # noqa: E402
from visar.accel import Request, get_method  # noqa: E402
from visar.accel.core.sampling import SamplingParams, make_generators  # noqa: E402
from visar.errors import VisarError  # noqa: E402

PROMPTS = ["a red circle", "the blue dog on a green square"]  # 9 and 13 tokens with the template


@pytest.fixture(scope="module")
def janus_folder(tmp_path_factory, offline):
    return save_janus_folder(random_janus(grid=4, image_vocab=16, seed=0), tmp_path_factory.mktemp("janus"))


@pytest.fixture(scope="module")
def reference(janus_folder):
    """transformers' own model, loaded from the same folder."""
    return transformers.JanusForConditionalGeneration.from_pretrained(janus_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pipe(janus_folder):
    return visar.load(janus_folder, device="cpu", model_args={"max_prompt_tokens": 16})


def test_loads_as_janus_with_its_defaults(pipe):
    assert type(pipe.model).__name__ == "HFJanus" and pipe.model.model_kind == "raster"
    assert pipe.model.grid_size == (4, 4) and pipe.model.vocab_size == 16 == pipe.tokenizer.vocab_size
    assert pipe.defaults["guidance_scale"] == 5.0 and pipe.defaults["temperature"] == 1.0
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    assert ids.shape == mask.shape == (2, 16)
    assert mask.sum(1).tolist() == [9, 13] and not mask[:, 0].any()  # left-padded
    assert (ids[:, -1] == 3).all() and (ids[mask][:1] == 0).all()  # ends with <begin_of_image>, starts with BOS
    out = pipe.generate(prompts=PROMPTS, output_type="np", seed=0)
    assert out.images.shape == (2, 8, 8, 3)  # the tiny VQ upsamples its 4x4 latent once


class ConditionalHalf(transformers.LogitsProcessor):
    """CFG at scale 1: the conditional half of transformers' doubled batch (see test_greedy_equals_transformers)."""

    def __call__(self, input_ids, scores):
        return scores[: scores.shape[0] // 2]


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_greedy_equals_transformers(pipe, reference, guidance_scale):
    """visar's greedy tokens = transformers' greedy image generation, prompts left-padded to the same length.

    transformers 5.24 cannot run its image generation at guidance_scale 1 (<= 1 adds no CFG processor,
    and the doubled [cond ; uncond] scores then fill a batch of half their size: a shape error), so at
    CFG 1 its loop is given the processor that CFG at scale 1 amounts to (the conditional half).
    """
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    kwargs = dict(generation_mode="image", do_sample=False, guidance_scale=guidance_scale)
    if guidance_scale == 1.0:
        kwargs["logits_processor"] = transformers.LogitsProcessorList([ConditionalHalf()])
    expected = reference.generate(input_ids=ids, attention_mask=mask.long(), **kwargs)
    assert len(set(expected.flatten().tolist())) > 4  # random weights that do not collapse to one token
    for method in ("ar", "sjd", "mc-sjd"):
        greedy = dict(top_k=1, guidance_scale=guidance_scale, output_type="tokens")
        out = pipe.generate(prompts=PROMPTS, method=method, **greedy)
        assert torch.equal(out.tokens.flatten(1), expected), method


@pytest.mark.parametrize("negative", ["the blue dog", ["the blue dog", "a green square"]])
def test_a_negative_prompt_is_the_unconditional_context(pipe, negative):
    """visar's extension (transformers' and deepseek-ai/Janus's image generation take no negative prompt): the
    negative prompt, formatted as a prompt (chat template, <begin_of_image>) with its own padding, replaces the
    padded prompt as the unconditional context: greedy tokens under CFG 5 are the argmax of the mix of the
    prompt's and the negative prompt's teacher-forced logits, for lossless methods alike."""
    negatives = [negative] * 2 if isinstance(negative, str) else negative
    greedy = dict(top_k=1, output_type="tokens")  # the folder's guidance, 5
    out = pipe.generate(prompts=PROMPTS, negative_prompt=negative, **greedy)
    assert greedy_under_guidance(pipe, out.tokens, PROMPTS, negatives, 5.0)
    fast = pipe.generate(prompts=PROMPTS, negative_prompt=negative, method="mc-sjd", **greedy)
    assert torch.equal(fast.tokens, out.tokens)
    default = pipe.generate(prompts=PROMPTS, **greedy)  # negative control: Janus's own padded prompt
    assert not torch.equal(default.tokens, out.tokens) and pipe.model.negative is None


def test_teacher_forced_logits_equal_transformers(pipe, reference):
    ids, mask = pipe.text_encoder.encode(PROMPTS)
    tokens = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = pipe.logits(tokens, prompts=PROMPTS)  # [B, N, V], through visar's cache and 4-D masks
    with torch.no_grad():
        embeds = torch.cat(
            [
                reference.get_input_embeddings()(ids),
                reference.prepare_embeddings_for_image_generation(tokens[:, :-1]),
            ],
            dim=1,
        )
        attention_mask = torch.cat([mask.long(), torch.ones(2, 15, dtype=torch.long)], dim=1)
        hidden = reference.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
        theirs = reference.model.generation_head(hidden)[:, 15:].float()
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    # the unconditional prompt is Janus's: BOS and <begin_of_image> kept, every other token the pad id
    null = pipe.model.null_condition(ids)
    assert torch.equal(null[mask], torch.where((ids[mask] == 0) | (ids[mask] == 3), ids[mask], 1))


# -- (c) the enumerated law --------------------------------------------------------------------------

VOCAB, SAMPLES = 6, 12_000
LAW_CASES = [
    ("ar", {}, SamplingParams(guidance_scale=2.0)),
    ("sjd", {"window": 4}, SamplingParams(guidance_scale=2.0, top_k=4)),
    ("mc-sjd", {"window": 4, "coupling": "gumbel"}, SamplingParams(guidance_scale=2.0, top_p=0.9)),
]


@pytest.fixture(scope="module")
def law_pipe(tmp_path_factory, offline):
    folder = save_janus_folder(random_janus(grid=2, image_vocab=VOCAB, seed=1, std=0.3), tmp_path_factory.mktemp("law"))
    return visar.load(folder, device="cpu", model_args={"max_prompt_tokens": 16})


@pytest.mark.slow
@pytest.mark.parametrize("method, options, params", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_joint_law_with_left_padded_prompts(law_pipe, method, options, params):
    model = law_pipe.model
    ids, mask = law_pipe.text_encoder.encode(PROMPTS)
    tokens, _, which = sample_each_prompt_s_law(model, ids, mask, method, options, params, VOCAB, SAMPLES)
    # batch 1: an image decoded alone (its own prompt, its own seed) has its tokens from the big batch
    for index in (0, 1, 7):
        alone, _ = get_method(method).fn(
            Request(
                model,
                ids[which[index : index + 1]],
                params,
                make_generators(1, 100 + index),
                cond_mask=mask[which[index : index + 1]],
            ),
            **options,
        )
        assert torch.equal(alone[0], tokens[index])
    # negative controls: the prompt reaches the image tokens (the two laws differ), and so does the
    # padding mask (prompt 0 with its padding visible has another law), so agreement above checks both
    laws = [prompt_law(model, ids[p], mask[p], params) for p in (0, 1)]
    assert 0.5 * np.abs(laws[0] - laws[1]).sum() > 0.05
    unmasked = prompt_law(model, ids[0], torch.ones_like(mask[0]), params)
    assert 0.5 * np.abs(laws[0] - unmasked).sum() > 0.05


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32},
        {"architectures": ["ChameleonForConditionalGeneration"], "model_type": "chameleon"},
    ],
    ids=["llama", "chameleon"],
)
def test_folder_of_a_model_without_image_generation(tmp_path, config):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = "visar loads transformers folders of ChameleonXLLMXForConditionalGeneration, Emu3ForConditional"
    with pytest.raises(VisarError, match=expected) as err:
        visar.load(str(tmp_path), device="cpu")
    assert config["architectures"][0] in str(err.value) and "\n" not in str(err.value)


def test_prompt_too_long_and_foreign_draft(pipe):
    with pytest.raises(VisarError, match="more than this model's 16 condition positions"):
        pipe.generate(prompts=["a red circle on the green square of the blue dog"], output_type="tokens")
    with pytest.raises(VisarError, match="condition"):
        pipe.generate(prompts=PROMPTS[:1], method="spec", draft=tiny_llamagen(vocab=16, block_size=16), top_k=1)


def test_cli_generates_from_the_folder(janus_folder, tmp_path, capsys):
    from visar.apps.cli import main

    out = tmp_path / "out"
    args = ["generate", "--model", janus_folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--method", "sjd"]
    assert main([*args, "--device", "cpu", "--out", str(out)]) == 0
    files = ["00000.png", "00001.png", "images.jsonl", "settings.json", "stats.json"]
    assert sorted(p.name for p in out.iterdir()) == files
    # a text-only transformers folder: one line, exit 2
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    assert main(["generate", "--model", str(llama), "--prompt", "a", "--out", str(out)]) == 2
    assert "JanusForConditionalGeneration" in capsys.readouterr().err
