"""A raster model called on a subset of its cache's rows, and a row freed for a new condition (issue 46's
running batch that refills).

For LlamaGen c2i, LlamaGen t2i with padded captions, and the tiny Janus and Emu3 adapters:
(a) a call for rows [2, 0] of a 3-row cache gives those rows' logits of the same call made on the whole
batch (a copy of the state), and leaves row 1's cache (keys, values, flags) as it was;
(b) `reset_cache_rows` then a prefill of a new condition (with its own padding) in that row gives the
logits of a fresh batch-1 decode of that condition;
(c) `GuidedScorer` with fewer slots than queued images, under CFG: `admit` + `prefill(rows)` gives a
fresh scorer's logits over that image alone;
bad input: rows without a cache, out of range or repeated.
"""

import copy

import pytest
import torch
from laws import tiny_llamagen, tiny_pipeline

from visar.accel.core.sampling import SamplingParams
from visar.accel.core.scoring import GuidedScorer
from visar.models.llamagen import LlamaGen

# a rows call against the same rows of the whole batch's call, bit for bit:
# at one torch thread, where that holds (tests/conftest.py, one_torch_thread)
pytestmark = pytest.mark.one_thread

CASES = ["c2i", "t2i", "hf-janus", "hf-emu3", "hf-lumina-mgpt-2"]


def left_padding(valid_lengths: list[int], length: int) -> torch.Tensor:
    """[B, length] bool: the last valid_lengths[b] positions of row b are valid (prompts are left-padded)."""
    return torch.arange(length)[None, :] >= length - torch.tensor(valid_lengths)[:, None]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # as the engines call the models
        yield


@pytest.fixture(scope="module", params=CASES)
def case(request):
    """(model, four conditions [4, ...], their valid positions [4, T] or None): three fill a batch, the
    fourth is a new one; the paddings differ from row to row."""
    name = request.param
    if name == "c2i":
        return tiny_llamagen(vocab=16, block_size=16), torch.tensor([0, 1, 2, 1]), None
    if name == "t2i":
        model = tiny_llamagen(vocab=16, block_size=16, model_type="t2i", cls_token_num=5, caption_dim=8)
        captions = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))
        return model, captions, left_padding([5, 3, 2, 4], 5)
    pytest.importorskip("transformers")
    pipe = tiny_pipeline(name, 0)
    ids, mask = pipe.text_encoder.encode(["a red circle", "the blue dog on a green square", "a cat", "two dogs"])
    return pipe.model, ids, mask


def cond_rows(cond_mask, index):
    return None if cond_mask is None else cond_mask[index]


def fed_batch(model, cond, cond_mask):
    """A 3-row cache with conditions 0..2 prefilled and image tokens 0..2 fed -> the token ids [3, 3]."""
    num_cond = model.num_condition_tokens
    model.setup_cache(3, model.max_seq_len, cond_rows(cond_mask, slice(0, 3)))
    model(None, cond[:3], input_pos=torch.arange(num_cond))
    tokens = torch.randint(0, model.vocab_size, (3, 3), generator=torch.Generator().manual_seed(1))
    model(tokens, input_pos=num_cond + torch.arange(3))
    return tokens


def cache_row(model, row: int) -> list[torch.Tensor]:
    """Every tensor of the model's cache that holds row `row`, copied."""
    if isinstance(model, LlamaGen):
        kv = [layer.attention.kv_cache for layer in model.layers]
        tensors = [cache.k_cache for cache in kv] + [cache.v_cache for cache in kv]
    else:
        tensors = model.cache.keys + model.cache.values
        if hasattr(model, "row_end_at"):  # Emu3's row ends and prompt starts
            tensors += [model.row_end_at, model.prompt_start]
    tensors += [model.cache_keys.written, model.cache_keys.valid]
    return [t[row].clone() for t in tensors]


@pytest.mark.parametrize("explicit_mask", [False, True], ids=["causal", "mask"])
def test_a_rows_call_is_those_rows_of_the_whole_batch_call(case, explicit_mask):
    model, cond, cond_mask = case
    num_cond = model.num_condition_tokens
    fed_batch(model, cond, cond_mask)
    twin = copy.deepcopy(model)
    # per-row positions: row 2 goes on at token 3 (a row end on a 4 x 4 grid), row 0 writes token 2 again
    input_pos = num_cond + torch.tensor([[3, 4], [3, 4], [2, 3]])  # rows 0, 1, 2
    tokens = torch.randint(0, model.vocab_size, (3, 2), generator=torch.Generator().manual_seed(2))
    mask = None
    if explicit_mask:
        mask = torch.arange(model.max_seq_len)[None, None, :] <= input_pos[..., None]  # [3, 2, S]
    rows = torch.tensor([2, 0])
    row_1 = cache_row(model, 1)

    part = model(tokens[rows], input_pos=input_pos[rows], mask=None if mask is None else mask[rows], rows=rows)
    whole = twin(tokens, input_pos=input_pos, mask=mask)
    torch.testing.assert_close(part, whole[rows], rtol=0, atol=0)  # exact on a CPU at one thread: the same rows
    for before, after in zip(row_1, cache_row(model, 1), strict=True):
        assert torch.equal(before, after)
    for row in (0, 2):  # the rows written are as the whole call wrote them
        for written, twin_written in zip(cache_row(model, row), cache_row(twin, row), strict=True):
            assert torch.equal(written, twin_written)
    model.clear_cache()


def test_a_reset_row_decodes_a_new_condition_as_a_fresh_batch(case):
    model, cond, cond_mask = case
    num_cond = model.num_condition_tokens
    fed_batch(model, cond, cond_mask)
    row_0 = cache_row(model, 0)
    rows = torch.tensor([1])
    new = torch.tensor([3])
    tokens = torch.randint(0, model.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    model.reset_cache_rows(rows, cond_rows(cond_mask, new))
    refilled = [
        model(None, cond[new], input_pos=torch.arange(num_cond), rows=rows),
        model(tokens, input_pos=(num_cond + torch.arange(5))[None], rows=rows),
    ]
    for before, after in zip(row_0, cache_row(model, 0), strict=True):
        assert torch.equal(before, after)
    model.setup_cache(1, model.max_seq_len, cond_rows(cond_mask, new))
    fresh = [
        model(None, cond[new], input_pos=torch.arange(num_cond)),
        model(tokens, input_pos=num_cond + torch.arange(5)),
    ]
    model.clear_cache()
    for got, want in zip(refilled, fresh, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_admitted_image_is_scored_as_by_a_scorer_of_its_own(case):
    model, cond, cond_mask = case
    num_cond = model.num_condition_tokens
    params = SamplingParams(guidance_scale=3.0)
    tokens = torch.randint(0, model.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    queued = GuidedScorer(model, cond[:3], cond_rows(cond_mask, slice(0, 3)), params, slots=2)
    assert queued.batch == 2 and queued.cond.shape[0] == 4
    with queued.cache(model.max_seq_len):
        queued.prefill()
        queued.logits(tokens, num_cond + torch.arange(3))
        queued.admit(torch.tensor([0]), torch.tensor([2]))  # slot 0's image is done: image 2 takes it
        admitted = [
            queued.prefill(rows=torch.tensor([0])),
            queued.logits(tokens[:1], (num_cond + torch.arange(3))[None], rows=torch.tensor([0])),
        ]
    alone = GuidedScorer(model, cond[2:3], cond_rows(cond_mask, slice(2, 3)), params)
    with alone.cache(model.max_seq_len):
        fresh = [alone.prefill(), alone.logits(tokens[:1], num_cond + torch.arange(3))]
    for got, want in zip(admitted, fresh, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(queued.cond[[0, 2]], alone.cond)


def test_bad_rows_are_refused(case):
    model, cond, cond_mask = case
    positions = torch.arange(model.num_condition_tokens)
    with pytest.raises(ValueError, match="setup_cache"):
        model(None, cond[:1], input_pos=positions, rows=torch.tensor([0]))
    fed_batch(model, cond, cond_mask)
    try:
        for rows in ([0, 3], [1, 1], [-1, 0]):
            with pytest.raises(ValueError, match="distinct cache rows"):
                model(None, cond[:2], input_pos=positions, rows=torch.tensor(rows))
        with pytest.raises(ValueError, match="distinct cache rows"):
            model.reset_cache_rows(torch.tensor([2, 2]))
    finally:
        model.clear_cache()
    with pytest.raises(ValueError, match="slots"):
        GuidedScorer(model, cond[:2], cond_rows(cond_mask, slice(0, 2)), SamplingParams(), slots=3)
