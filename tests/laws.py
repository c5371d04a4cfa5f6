"""What the test modules share (a helper module: no tests here): the tiny models and the exact-law machinery.

Tiny models: a LlamaGen whose weights are drawn on the CPU (the same model on every device) and a
perturbed copy of it as a draft, a unit-norm codebook for the relaxed methods, every registered
family's tiny pipeline, a tiny MAR, and tiny random Janus, Emu3 (transformers) and aMUSEd
(diffusers) models for their save_pretrained folders. The callers skip or fail for a missing
transformers / diffusers before they call a builder that needs one (tests/conftest.py says when a skip
is allowed), so importing this module needs neither.

Running batches: an open image source whose later images join between given passes.

Exact laws: the law of a model small enough to enumerate (vocabulary 6 and 2 x 2 image tokens is
1,296 sequences) is computed by scoring every sequence with the model, teacher-forced, through the
shared distribution function (`logits_to_probs`); a method's draws are compared with it by
chi-square and by total variation against the Monte-Carlo noise floor of as many exact draws.
"""

import copy

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import visar
from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, cfg_mix, logits_to_probs, make_generators, split_cfg
from visar.accel.core.source import ImageSource
from visar.families import FAMILIES
from visar.loading import resolve_dtype, seeded_init
from visar.models.llamagen import LlamaGen, LlamaGenConfig

# The enumerated-law model: vocabulary 6, 2 x 2 tokens (tiny_llamagen's defaults), and its draws per test.
VOCAB = 6
SAMPLES = 20_000
CFG_TOPK = SamplingParams(guidance_scale=2.0, top_k=4)
TOPP_TEMP = SamplingParams(top_p=0.8, temperature=1.3)
CFG_TOPK_TOPP = SamplingParams(guidance_scale=1.5, top_k=5, top_p=0.9, temperature=0.9)
# The entropy temperature's target (filters first, then each position's T from their entropy): 179 sequences
# of the 1,296 have mass, and its law is 0.22 in TV from the same settings without it (tolerance ~0.04).
CFG_TOPK_TOPP_ENTROPY = SamplingParams(guidance_scale=1.5, top_k=5, top_p=0.95, entropy_temperature=0.6)


# -- tiny models --------------------------------------------------------------------------------------------


def tiny_llamagen(
    vocab=VOCAB, block_size=4, seed=0, std=0.5, cls=LlamaGen, device="cpu", dtype=torch.float32, **kw
) -> LlamaGen:
    """A 2-layer LlamaGen (a subclass with `cls`), N(0, std) matrices. Weights drawn on the CPU,
    then moved: the same model on every device."""
    torch.manual_seed(seed)
    args = dict(dim=16, n_layer=2, n_head=2, multiple_of=16, vocab_size=vocab, num_classes=3, block_size=block_size)
    model = cls(LlamaGenConfig(**{**args, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model.to(device=device, dtype=dtype)


def perturbed(model: LlamaGen, seed: int, scale: float) -> LlamaGen:
    """A draft model: the target's weights plus noise (same vocabulary and layout)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))
    return draft


def unit_codebook(vocab: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(vocab, dim, generator=gen), dim=-1)


def tiny_pipeline(
    family_name: str, seed: int = 0, device="cpu", dtype: str = "fp32", model_args=None, text_encoder_args=None
) -> visar.Pipeline:
    """The family's tiny random model and tokenizer, as a pipeline (what `visar.load` would build): weights
    drawn on the CPU in fp32, then the generator moved to `device` in `dtype` (as `visar.load` does) and
    the tokenizer to `device`. model_args / text_encoder_args: in place of the family's tiny ones."""
    family = FAMILIES[family_name]
    if family.architectures or family.pipeline_classes:  # a family over a transformers / diffusers model
        pytest.importorskip("transformers")
    if family.pipeline_classes:
        pytest.importorskip("diffusers")
    model = family.build_model(model_args or family.tiny_model_args)
    seeded_init(model, seed, std=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = family.build_tokenizer(family.tiny_tokenizer_args)
    text_encoder_args = text_encoder_args or family.tiny_text_encoder_args
    text_encoder = family.build_text_encoder(text_encoder_args) if family.build_text_encoder else None
    model.to(device=device, dtype=resolve_dtype(dtype))
    tokenizer.to(device)
    if text_encoder is not None:
        text_encoder.to(device)
    return visar.Pipeline(
        model, tokenizer, name=f"tiny-{family_name}", defaults={"guidance_scale": 2.0}, text_encoder=text_encoder
    )


def tiny_mar(seed, std=0.05, **overrides):
    family = FAMILIES["mar"]
    model = family.build_model({**family.tiny_model_args, **overrides})
    seeded_init(model, seed, std=std)
    return model


def random_janus(grid: int, image_vocab: int, seed: int, std: float = 0.3):
    """A tiny JanusForConditionalGeneration, N(0, std) weights (diverse greedy tokens), Janus's generation config."""
    import transformers

    from visar.families import hf_janus

    config = transformers.JanusConfig(**hf_janus.tiny_config(grid=grid, image_vocab=image_vocab))
    torch.manual_seed(seed)
    model = transformers.JanusForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, pad_token_id=1, guidance_scale=5.0, generation_kwargs={"boi_token_id": 3}
    )
    return model


def save_janus_folder(model, folder) -> str:
    from visar.families import hf_janus

    model.save_pretrained(folder)
    hf_janus.tiny_processor().save_pretrained(folder)
    return str(folder)


def random_emu3(image_vocab: int, seed: int, std: float = 0.3):
    """A tiny Emu3ForConditionalGeneration, N(0, std) weights (diverse greedy tokens)."""
    import transformers

    from visar.families import hf_emu3

    config = transformers.Emu3Config(**hf_emu3.tiny_config(image_vocab))
    torch.manual_seed(seed)
    model = transformers.Emu3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def save_emu3_folder(model, image_vocab: int, folder) -> str:
    from visar.families import hf_emu3

    model.save_pretrained(folder)
    hf_emu3.tiny_processor(image_vocab).save_pretrained(folder)
    return str(folder)


def random_amused(seed: int, std: float = 0.3):
    """A tiny AmusedPipeline with N(0, std) weights (diverse tokens), mask id 8 after 8 codes."""
    import diffusers
    import transformers

    from visar.families import amused

    torch.manual_seed(seed)
    transformer = diffusers.UVit2DModel(**amused.tiny_transformer_config())
    vqvae = diffusers.VQModel(**amused.tiny_vq_config())
    config = transformers.CLIPTextConfig(**amused.tiny_text_config())
    text_encoder = transformers.CLIPTextModelWithProjection(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (transformer, text_encoder):
            for param in module.parameters():
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
    return diffusers.AmusedPipeline(
        vqvae=vqvae,
        tokenizer=amused.tiny_tokenizer(),
        text_encoder=text_encoder,
        transformer=transformer,
        scheduler=diffusers.AmusedScheduler(mask_token_id=8),
    )


# -- running batches ---------------------------------------------------------------------------------------


class JoinsBetweenPasses(ImageSource):
    """An open source (`core.source.ImageSource`) whose later images are added before given passes (the
    loop asks its count once before each pass): `conditions(images: range) -> (cond [R], generators)`
    makes images `images`; `joins` is {pass: images added before it}, and the source closes after
    the last addition. `asked` counts the loop's questions."""

    def __init__(self, conditions, first: int, joins: dict[int, int]):
        cond, generators = conditions(range(first))
        super().__init__(cond, None, generators, closed=False)
        self.conditions, self.joins, self.asked = conditions, dict(joins), 0

    def count(self) -> int:
        self.asked += 1
        if self.asked in self.joins:
            have = super().count()
            cond, generators = self.conditions(range(have, have + self.joins.pop(self.asked)))
            self.add(cond, None, generators)
            if not self.joins:
                self.close()
        return super().count()


# -- exact laws ---------------------------------------------------------------------------------------------


def all_sequences(vocab: int, length: int) -> torch.Tensor:
    grids = torch.meshgrid(*[torch.arange(vocab)] * length, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], 1)  # [V^N, N], row m = base-V digits of m


@torch.no_grad()
def exact_law(model: LlamaGen, label: int, params: SamplingParams) -> np.ndarray:
    """P(sequence) for every sequence, from teacher-forced logits through the shared distribution function."""
    seqs = all_sequences(model.vocab_size, model.num_image_tokens).to(model.device)
    cond = torch.full((len(seqs),), label, device=model.device)
    if params.uses_cfg:
        seqs_in, cond = torch.cat([seqs, seqs]), torch.cat([cond, model.null_condition(cond)])
    else:
        seqs_in = seqs
    logits = model(seqs_in[:, :-1], cond)[:, model.num_condition_tokens - 1 :]  # [M(x2), N, V]
    probs = logits_to_probs(split_cfg(logits, params), params)
    law = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1).cpu().numpy()
    assert abs(law.sum() - 1) < 1e-5
    return law


def sequence_index(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    weights = vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens.cpu() * weights).sum(1).numpy()


def compare_laws(index: np.ndarray, law: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """-> (chi-square p-value, TV, TV tolerance). Cells expected below 5 are pooled; a draw in a
    zero-probability cell fails at once. The TV tolerance is the mean + 5 sd of the TV of exact
    multinomial samples of the same size (the Monte-Carlo noise floor)."""
    n = len(index)
    counts = np.bincount(index, minlength=len(law)).astype(float)
    assert counts[law == 0].sum() == 0, "a zero-probability sequence was drawn"
    expected = law * n
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    pvalue = chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    tv = 0.5 * np.abs(counts / n - law).sum()
    null = np.random.default_rng(seed).multinomial(n, law / law.sum(), size=200) / n
    null_tv = 0.5 * np.abs(null - law).sum(1)
    return pvalue, tv, null_tv.mean() + 5 * null_tv.std()


def draw(method, model, label, params, n, seed=0, **options):
    """n images of class `label` from a registered method, image i seeded with seed + i."""
    cond = torch.full((n,), label, device=model.device)
    return get_method(method).fn(Request(model, cond, params, make_generators(n, seed)), **options)


def greedy_under_guidance(pipe, tokens: torch.Tensor, prompts, unconditional_prompts, scale: float) -> bool:
    """Are tokens [B, H, W] greedy under CFG at `scale` with these prompts as the unconditional branch
    (encoded as prompts are)? Teacher-forced: each token is the argmax of uncond + scale * (cond - uncond)."""
    flat = tokens.reshape(len(prompts), -1)
    cond, uncond = pipe.logits(flat, prompts=prompts), pipe.logits(flat, prompts=unconditional_prompts)
    return torch.equal(cfg_mix(cond, uncond, scale).argmax(-1), flat)


@torch.no_grad()
def prompt_law(model, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """P(sequence) of one prompt [T] (mask [T]) for every sequence, teacher-forced without a cache."""
    seqs = all_sequences(model.vocab_size, model.num_image_tokens)
    cond, cond_mask = ids.expand(len(seqs), -1), mask.expand(len(seqs), -1)
    seqs_in = seqs
    if params.uses_cfg:
        seqs_in = torch.cat([seqs, seqs])
        null, null_mask = model.null_condition(cond), model.null_condition_mask(cond_mask)
        cond, cond_mask = torch.cat([cond, null]), torch.cat([cond_mask, null_mask])
    logits = model(seqs_in[:, :-1], cond, cond_mask=cond_mask)[:, model.num_condition_tokens - 1 :]
    probs = logits_to_probs(split_cfg(logits, params), params)
    law = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1).numpy()
    assert abs(law.sum() - 1) < 1e-5
    return law


def sample_each_prompt_s_law(model, ids, mask, method, options, params, vocab: int, samples: int):
    """`samples` images of the two prompts interleaved in one batch; each prompt's images follow its
    enumerated law (chi-square and TV). -> (tokens, stats, which prompt each image had)."""
    which = torch.arange(samples) % 2
    tokens, stats = get_method(method).fn(
        Request(model, ids[which], params, make_generators(samples, 100), cond_mask=mask[which]), **options
    )
    for prompt in (0, 1):
        law = prompt_law(model, ids[prompt], mask[prompt], params)
        pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == prompt], vocab), law)
        print(f"{method} prompt {prompt}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
        assert pvalue > 1e-3 and tv < tolerance, (prompt, pvalue, tv, tolerance)
    if method != "ar":
        assert stats["tokens_per_forward"] > 1.0
    return tokens, stats, which


class LocalLlamaGen(LlamaGen):
    """A LlamaGen whose token (r, c) depends only on (r-1, c-1), (r-1, c), (r-1, c+1) and (r, c-1).

    The query predicting (r, c) attends to the condition and to those neighbours only; the query
    predicting a row start sits at (r - 1, W - 1), whose own input would leak into it, so a row's
    last token is fed as token 0 (a model that never reads it).
    """

    dependency_reach = 1

    def forward(self, tokens=None, cond=None, *, input_pos=None, mask=None, cond_mask=None, cache_pos=None, rows=None):
        num_cond = self.num_condition_tokens
        height, width = self.grid_size
        batch = (tokens if tokens is not None else cond).shape[0]
        length = (tokens.shape[1] if tokens is not None else 0) + (num_cond if cond is not None else 0)
        if input_pos is None:
            start = 0 if cond is not None else num_cond
            input_pos = torch.arange(start, start + length)
        if input_pos.dim() == 1:
            input_pos = input_pos[None].expand(batch, -1)
        cached = self.layers[0].attention.kv_cache is not None
        key_pos = torch.arange(self.cache_keys.valid.shape[1])[None].expand(batch, -1) if cached else input_pos
        if mask is None:
            key_valid = None if not cached else self.cache_keys.valid if rows is None else self.cache_keys.valid[rows]
            mask = self.default_mask(input_pos, key_pos, key_valid)
        target = input_pos - num_cond + 1  # image index each query predicts
        key = key_pos - num_cond
        up = target[..., None] // width - key[:, None, :] // width  # rows between target and key
        side = key[:, None, :] % width - target[..., None] % width
        neighbour = ((up == 1) & (side.abs() <= 1)) | ((up == 0) & (side == -1))
        mask = mask & ((key < 0)[:, None, :] | (neighbour & (key >= 0)[:, None, :]))
        if tokens is not None:
            token_pos = input_pos[:, -tokens.shape[1] :] - num_cond
            tokens = torch.where(token_pos % width == width - 1, 0, tokens)
        return super().forward(tokens, cond, input_pos=input_pos, mask=mask, cache_pos=cache_pos, rows=rows)
