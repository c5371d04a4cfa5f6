"""kv_keep: the compressed KV cache of raster models (`models/kv_cache.CompressedCache`), on LlamaGen and
on the Hugging Face adapters (Janus-Pro, Emu3, Lumina-mGPT), under both eviction rules (kv_evict).

kv_keep=1 is today's cache; a budget that never evicts gives the same tokens; with eviction, the
evicted slots are the least-attended old image slots, the condition is never evicted and a query sees
exactly the slots held (a full-cache model given that set as its mask returns the same logits); every
raster method runs with kv_keep=0.5; the line rule evicts only at grid-row boundaries, a row's worth of
the slots the last row's queries attended least; bad values and too-small budgets raise one VisarError;
in a running batch a refilled slot's compressed cache starts afresh for its new image.
"""

import copy
import json
import math
from dataclasses import replace

import pytest
import torch
from laws import perturbed, tiny_llamagen, tiny_pipeline

import visar
from visar.accel import METHODS, Request, get_method
from visar.accel.core.sampling import SamplingParams
from visar.apps.cli import main
from visar.errors import VisarError
from visar.families import FAMILIES, hf_janus, hf_lumina
from visar.loading import seeded_init
from visar.models.kv_cache import RECENT_ROWS, CacheKeys, CompressedCache

GRID = 8  # 8 x 8 image tokens, one class position: S = 65 slots, C = 33 at kv_keep=0.5
SMALL = {
    "tree": [[0], [1], [0, 0]],
    "num_iter": 4,
    "window": 8,
    "depth": 2,
    "branch": 3,
}  # passes that fit half of a 65-slot cache


@pytest.fixture(scope="module")
def pipe():
    family = FAMILIES["llamagen"]
    model = family.build_model({**family.tiny_model_args, "block_size": GRID * GRID})
    seeded_init(model, 0, std=0.3)
    torch.manual_seed(0)
    tokenizer = family.build_tokenizer(family.tiny_tokenizer_args)
    return visar.Pipeline(model, tokenizer, name="tiny-llamagen-8x8", defaults={"guidance_scale": 2.0})


def tokens(pipe, method, **kwargs):
    return pipe.generate(class_labels=[0, 1, 2], method=method, seed=3, output_type="tokens", **kwargs).tokens


@pytest.mark.parametrize("method", ["ar", "sjd", "mc-sjd", "tree-mc-sjd", "zipar", "zipar-mc-sjd"])
def test_whole_and_never_evicting_budgets_give_todays_tokens(pipe, method):
    today = tokens(pipe, method)
    assert torch.equal(tokens(pipe, method, kv_keep=1.0), today)
    # ceil(0.999 * S) = S for every cache these methods open: the compressed path, nothing evicted
    assert torch.equal(tokens(pipe, method, kv_keep=0.999), today)


def test_kv_keep_one_builds_todays_cache(pipe):
    model = pipe.model
    model.setup_cache(2, 65, None, kv_keep=1.0)
    assert isinstance(model.cache_keys, CacheKeys) and model.layers[0].attention.kv_cache.table is None
    model.setup_cache(2, 65, None, kv_keep=0.5)
    assert isinstance(model.cache_keys, CompressedCache)
    assert model.layers[0].attention.kv_cache.k_cache.shape[2] == 33  # ceil(0.5 * 65): memory falls with it
    model.clear_cache()


def raster_methods(pipe):
    return [m for m in METHODS.values() if m.model_kind == "raster" and all(hasattr(pipe.model, r) for r in m.requires)]


@pytest.mark.parametrize("kv_evict", ["h2o", "line"])
def test_every_raster_method_runs_compressed(pipe, kv_evict):
    draft = perturbed(pipe.model, seed=1, scale=0.3)
    for method in raster_methods(pipe):
        options = {k: v for k, v in SMALL.items() if k in method.options}
        if method.needs_draft:
            options[method.draft_option] = draft
        out = pipe.generate(
            class_labels=[0, 3], method=method.name, seed=1, output_type="tokens", kv_keep=0.5, kv_evict=kv_evict,
            **options,
        )  # fmt: skip
        assert out.tokens.shape == (2, GRID, GRID), method.name
        assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < pipe.model.vocab_size, method.name
        assert out.stats["kv_keep"] == 0.5 and out.stats["kv_evict"] == kv_evict and out.stats["lossless"] is False


@torch.no_grad()
def held_slots_lockstep(compressed, full, cond, cond_mask, kv_keep: float, kv_evict: str) -> int:
    """Lockstep: a compressed model and a full-cache copy fed the same calls (multi-slot passes and
    truncations, as a drafting method makes them); the copy's mask is the set the compressed cache
    holds after each call, so equal logits mean a query saw exactly those slots. The condition stays
    held; under the H2O rule every slot evicted had no more attention than any old image slot that
    stayed -> the slots evicted."""
    batch, num_cond, num_slots = cond.shape[0], compressed.num_condition_tokens, compressed.max_seq_len
    height, width = compressed.grid_size
    compressed.setup_cache(batch, num_slots, cond_mask, kv_keep=kv_keep, kv_evict=kv_evict)
    full.setup_cache(batch, num_slots, cond_mask)
    table = compressed.cache_keys
    prefill = torch.arange(num_cond)
    compressed(None, cond, input_pos=prefill)
    full(None, cond, input_pos=prefill)
    gen = torch.Generator().manual_seed(0)
    committed = torch.zeros(batch, dtype=torch.long)  # image tokens with their KV kept
    evictions = 0
    while int(committed.max()) < height * width - 4:
        size = int(torch.randint(1, 5, (1,), generator=gen))
        input_pos = num_cond + committed[:, None] + torch.arange(size)  # [B, L]
        feed = torch.randint(0, compressed.vocab_size, (batch, size), generator=gen)
        held_before, score_before = table.logical.clone(), table.score.clone()
        out = compressed(feed, input_pos=input_pos)
        held = table.logical.clone()  # [B, C]: what the call's queries could see
        mask = torch.zeros(batch, size, num_slots, dtype=torch.bool)
        for b in range(batch):
            mask[b, :, held[b][held[b] >= 0]] = True
        causal = torch.arange(num_slots)[None, None] <= input_pos[..., None]
        assert torch.allclose(out, full(feed, input_pos=input_pos, mask=mask & causal), atol=1e-5)
        assert bool((table.physical[:, :num_cond] >= 0).all())  # the condition stays
        for b in range(batch):
            before = {int(s): float(v) for s, v in zip(held_before[b], score_before[b], strict=True) if s >= 0}
            after = {int(s) for s in held[b] if s >= 0}
            evicted = set(before) - after
            evictions += len(evicted)
            front = int(input_pos[b].min())
            old_kept = [before[s] for s in after & set(before) if num_cond <= s < front - width * RECENT_ROWS]
            if kv_evict == "h2o" and evicted and old_kept:
                assert max(before[s] for s in evicted) <= min(old_kept)
        # accept a random part of the pass: the rest is forgotten, as a drafting method does
        committed = committed + torch.randint(1, size + 1, (batch,), generator=gen)
        compressed.truncate_cache(num_cond + committed)
        full.truncate_cache(num_cond + committed)
        assert not bool((table.logical >= (num_cond + committed)[:, None]).any())
    assert float(table.score.sum() + table.window.sum()) > 0  # the layers' attention was observed
    return evictions


@torch.no_grad()
def line_rule_evictions(model, cond, cond_mask, kv_keep: float) -> int:
    """AR calls (one token each) on a cache compressed under the line rule: slots are evicted only by
    a call that starts a grid row, as many as make a row's worth of slots free (or every old one), and
    each was attended no more by the last row's queries than any old image slot kept -> the slots evicted."""
    batch, num_cond, num_slots = cond.shape[0], model.num_condition_tokens, model.max_seq_len
    height, width = model.grid_size
    model.setup_cache(batch, num_slots, cond_mask, kv_keep=kv_keep, kv_evict="line")
    table = model.cache_keys
    model(None, cond, input_pos=torch.arange(num_cond))
    gen = torch.Generator().manual_seed(1)
    evictions = 0
    for index in range(height * width - 1):
        pos = num_cond + index
        held_before, window_before = table.logical.clone(), table.window.clone()
        model(torch.randint(0, model.vocab_size, (batch, 1), generator=gen), input_pos=torch.full((batch, 1), pos))
        for b in range(batch):
            before = {int(s): float(v) for s, v in zip(held_before[b], window_before[b], strict=True) if s >= 0}
            kept = {int(s) for s in table.logical[b] if s >= 0}
            evicted = set(before) - kept
            evictions += len(evicted)
            if index % width:
                assert not evicted, (index, evicted)  # mid-row: the row's slots were freed at its start
                continue
            old = [s for s in before if num_cond <= s < pos - width * RECENT_ROWS]
            free = table.num_physical - len(before)
            assert len(evicted) == min(max(width - free, 0), len(old))
            if evicted and len(evicted) < len(old):
                assert max(before[s] for s in evicted) <= min(before[s] for s in set(old) - evicted)
    return evictions


@pytest.mark.parametrize("kv_evict", ["h2o", "line"])
def test_queries_see_exactly_the_held_slots_and_evict_the_least_attended(kv_evict):
    grid = 6  # kv_keep 0.5: C = 19 of 37 slots: the condition, two rows, 6 more
    models = [tiny_llamagen(vocab=8, block_size=grid * grid, seed=2, std=0.3) for _ in range(2)]
    assert held_slots_lockstep(*models, torch.tensor([0, 1, 2]), None, 0.5, kv_evict) > 0


def test_the_line_rule_evicts_at_row_starts_by_the_last_rows_attention():
    model = tiny_llamagen(vocab=8, block_size=64, seed=2, std=0.3)
    assert line_rule_evictions(model, torch.tensor([0, 1, 2]), None, 0.5) > 0


def test_the_line_rule_scores_by_the_last_row_only():
    """Row 0 draws most attention early, row 2's queries attend slots 3 and 4 only: at row 3's start
    the line rule frees a row (4 slots) among rows 0 and 1 and keeps 3 and 4, which H2O's accumulated
    sum (in the same calls) would not."""

    def attention(slots: list[int], mass: float) -> torch.Tensor:  # [B, H, L, C] over physical slots
        probs = torch.zeros(1, 1, 1, 13)
        probs[..., slots] = mass
        return probs

    for rule in ("line", "h2o"):  # a 4 x 4 grid after one condition slot, 13 physical slots, one recent row
        table = CompressedCache(1, 17, 13, None, 1, 4, "cpu", line_width=4 if rule == "line" else None)
        table.write(torch.tensor([[0]]), torch.tensor([[0]]), 0)
        for row, (slots, mass) in enumerate([([1, 2], 50.0), ([5, 6, 7, 8], 0.5), ([3, 4], 1.0)]):
            pos = torch.arange(1 + 4 * row, 5 + 4 * row)[None]  # the row's slots, in one pass
            table.write(pos, pos, 4)
            table.observe(attention(slots, mass))  # what the row's queries attend
        kept_before = set(table.logical[0].tolist())
        table.write(torch.tensor([[13]]), torch.tensor([[13]]), 1)  # row 3 starts: the cache is full
        evicted = kept_before - set(table.logical[0].tolist())
        if rule == "line":
            assert evicted == {1, 2, 5, 6} and int((table.logical < 0).sum()) == 3  # a row's room, one taken
        else:
            assert len(evicted) == 1 and evicted < {5, 6, 7, 8}  # the least summed attention, one slot


def test_eviction_takes_free_slots_then_the_least_attended_old_ones():
    table = CompressedCache(1, 20, 8, None, num_condition=1, recent=2, device="cpu")
    for pos in (torch.arange(5)[None], torch.arange(5, 8)[None]):
        table.write(pos, pos, pos.shape[1])  # slots 0..7 fill the 8 physical slots
    table.score.copy_(torch.tensor([[9.0, 5, 1, 7, 3, 8, 0, 0]]))
    table.truncate(torch.tensor([7]))  # slot 7 forgotten: its physical slot is free again
    new = torch.tensor([[7, 8]])
    taken, key_pos, key_ok = table.write(new, new, 2)
    held = set(key_pos[0].tolist())
    # slot 7 took the free physical slot; slot 8 evicted slot 2 (score 1); slots 5, 6 are recent (>= 7 - 2)
    assert held == {0, 1, 3, 4, 5, 6, 7, 8} and bool(key_ok.all())
    assert table.physical[0, 2] == -1 and table.score[0, taken[0]].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), "half", True, None])
def test_bad_kv_keep_is_one_sentence(pipe, value):
    with pytest.raises(VisarError, match="kv_keep must be a number in"):
        tokens(pipe, "ar", kv_keep=value)


@pytest.mark.parametrize("value", ["lru", "H2O", "", 1, None])
def test_bad_kv_evict_is_one_sentence(pipe, value):
    with pytest.raises(VisarError, match="kv_evict must be 'h2o' .* or 'line' .*, not"):
        tokens(pipe, "ar", kv_keep=0.5, kv_evict=value)
    with pytest.raises(VisarError, match="kv_evict must be 'h2o'"):
        pipe.open_batch("mc-sjd", 2, kv_evict=value)


def test_budgets_too_small_are_refused(pipe):
    with pytest.raises(VisarError, match="fewer than a pass needs"):  # not even the condition and two rows
        tokens(pipe, "ar", kv_keep=0.1)
    with pytest.raises(VisarError, match="fewer than a pass needs"):  # C = 20: the condition, two rows, 3 slots
        tokens(pipe, "mc-sjd", kv_keep=0.3, window=16)


def test_other_kinds_refuse_kv_keep():
    masked = tiny_pipeline("maskgit")
    with pytest.raises(VisarError, match="compresses a raster model's KV cache"):
        masked.generate(class_labels=[0], kv_keep=0.5, output_type="tokens")


def test_cli_kv_keep(tmp_path, capsys):
    out = tmp_path / "gen"
    args = ["generate", "--model", "visar-tiny-random", "--method", "ar", "--class", "3", "--quiet"]
    assert main([*args, "--kv-keep", "0.5", "--out", str(out)]) == 0
    assert json.loads((out / "settings.json").read_text())["kv_keep"] == 0.5
    assert main([*args, "--kv-keep", "2", "--out", str(tmp_path / "bad")]) == 2
    assert "kv_keep must be a number in" in capsys.readouterr().err
    out = tmp_path / "line"
    assert main([*args, "--kv-keep", "0.5", "--kv-evict", "line", "--out", str(out)]) == 0
    assert json.loads((out / "settings.json").read_text())["kv_evict"] == "line"
    assert main([*args, "--kv-keep", "0.5", "--kv-evict", "lru", "--out", str(tmp_path / "bad")]) == 2
    assert "kv_evict must be 'h2o'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_scores_decay_per_position_the_front_advances():
    """A pass of many tokens decays the scores as far as AR's steps over the same positions, so
    the held set follows the attention of late queries instead of freezing on the first rows."""
    table = CompressedCache(1, 20, 12, None, num_condition=1, recent=2, device="cpu", decay=0.5)
    pos = torch.arange(4)[None]
    table.write(pos, pos, 3)
    table.score.fill_(8.0)
    pos = torch.arange(4, 7)[None]  # the front moves 0 -> 4: scores * 0.5**4
    table.write(pos, pos, 3)
    assert table.score[0, :4].tolist() == [0.5] * 4
    # a front going back (a redrafted slot) does not decay again
    table.write(torch.tensor([[3, 4, 5]]), torch.tensor([[3, 4, 5]]), 3)
    assert table.score[0, :3].tolist() == [0.5] * 3


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_a_running_batch_with_a_compressed_kv_cache_starts_each_image_afresh(model16):
    """kv_keep < 1 (lossy): a refilled slot's compressed cache (slot table, attention scores) starts
    empty for its new image: with one-slot windows (no padding, whose inputs would take cache room
    in a batch and not alone) each image is its decode alone, evictions included. Wider windows
    refill too."""
    guided = SamplingParams(guidance_scale=2.0, temperature=1.1)
    labels, seeds = [0, 1, 2, 1, 0], [21, 22, 23, 24, 25]
    cond = torch.tensor(labels)
    request = Request(model16, cond, guided, [torch.Generator().manual_seed(s) for s in seeds], kv_keep=0.8)
    tokens, stats = get_method("sjd").fn(replace(request, slots=2), window=1)
    assert stats["refills"] == 3
    for i in range(5):
        alone = Request(model16, cond[i : i + 1], guided, [torch.Generator().manual_seed(seeds[i])], kv_keep=0.8)
        assert torch.equal(tokens[i], get_method("sjd").fn(alone, window=1)[0][0]), i
    request = replace(request, generators=[torch.Generator().manual_seed(s) for s in seeds], slots=2)
    tokens, stats = get_method("mc-sjd").fn(request, window=4)
    assert stats["refills"] == 3 and tokens.shape == (5, 16) and int(tokens.max()) < model16.vocab_size


# -- the Hugging Face adapters: the same cache, the same rules ------------------------------------------------

HF_KEEP = 0.75  # C = 60 of 80 slots (Janus-Pro, Emu3), 45 of 60 (Lumina-mGPT): the prompt, two rows and a pass
PROMPTS = ["a red circle", "the blue dog", "a green square"]


def hf_grid_args(name: str) -> dict:
    """tiny_pipeline's arguments for a family's tiny model on a grid whose cache compresses: 8 x 8 after a
    16-position prompt (Janus-Pro, Emu3), 6 x 6 after Lumina-mGPT's 24."""
    if name == "hf-janus":
        return {"model_args": {**hf_janus.TINY_MODEL_ARGS, "config": hf_janus.tiny_config(grid=8)}}
    if name == "hf-emu3":
        family, area = FAMILIES[name], {"image_area": (8 * 8) ** 2}  # 8 pixels per token side
        return {"model_args": family.tiny_model_args | area, "text_encoder_args": family.tiny_text_encoder_args | area}
    args = hf_lumina.tiny_model_args(1, 96, 96)  # 16 pixels per token side
    return {"model_args": args, "text_encoder_args": args}


@pytest.fixture(scope="module", params=["hf-janus", "hf-emu3", "hf-lumina-mgpt"])
def hf_pipe(request):
    return tiny_pipeline(request.param, **hf_grid_args(request.param))


def hf_tokens(pipe, method, **kwargs):
    return pipe.generate(prompts=PROMPTS[:2], method=method, seed=3, output_type="tokens", **kwargs).tokens


def test_hf_kv_keep_builds_a_cache_of_c_slots(hf_pipe):
    model = hf_pipe.model
    model.setup_cache(2, model.max_seq_len, None, kv_keep=1.0)
    assert isinstance(model.cache_keys, CacheKeys) and model.cache.table is None
    whole = model.cache.keys[0].shape[2]
    model.setup_cache(2, model.max_seq_len, None, kv_keep=HF_KEEP, kv_evict="line")
    table = model.cache_keys
    assert isinstance(table, CompressedCache) and table.num_physical == math.ceil(HF_KEEP * model.max_seq_len)
    # C slots for visar's S, besides a family's own (Emu3's and Lumina-mGPT's row ends, one a row, kept whole)
    assert model.cache.keys[0].shape[2] == whole - model.max_seq_len + table.num_physical
    model.clear_cache()


@pytest.mark.parametrize("method, options", [("ar", {}), ("mc-sjd", {"window": 4})])
def test_hf_whole_and_never_evicting_budgets_give_todays_tokens(hf_pipe, method, options):
    today = hf_tokens(hf_pipe, method, **options)
    assert torch.equal(hf_tokens(hf_pipe, method, kv_keep=1.0, **options), today)
    # ceil(0.999 * S) = S: the compressed path (eager attention, observed), nothing evicted
    assert torch.equal(hf_tokens(hf_pipe, method, kv_keep=0.999, **options), today)
    assert hf_pipe.model.decoder.config._attn_implementation == "sdpa"  # the compressed calls put it back


@pytest.mark.parametrize("kv_evict", ["h2o", "line"])
def test_hf_queries_see_exactly_the_held_slots_and_evict_the_least_attended(hf_pipe, kv_evict):
    cond, cond_mask = hf_pipe.condition(prompts=PROMPTS)
    full = copy.deepcopy(hf_pipe.model)
    assert held_slots_lockstep(hf_pipe.model, full, cond, cond_mask, HF_KEEP, kv_evict) > 0


def test_hf_line_rule_evicts_at_row_starts_by_the_last_rows_attention(hf_pipe):
    cond, cond_mask = hf_pipe.condition(prompts=PROMPTS)
    assert line_rule_evictions(hf_pipe.model, cond, cond_mask, HF_KEEP) > 0


@pytest.mark.parametrize("kv_evict", ["h2o", "line"])
def test_hf_ar_and_mc_sjd_decode_compressed_in_a_running_batch(hf_pipe, kv_evict):
    for method, options in [("ar", {}), ("mc-sjd", {"window": 4})]:
        out = hf_pipe.generate(
            prompts=PROMPTS, method=method, seed=1, output_type="tokens", kv_keep=HF_KEEP, kv_evict=kv_evict,
            batch_size=2, **options,
        )  # fmt: skip
        assert out.tokens.shape == (3, *hf_pipe.model.grid_size), method
        assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < hf_pipe.model.vocab_size, method
        assert out.stats["kv_keep"] == HF_KEEP and out.stats["kv_evict"] == kv_evict and not out.stats["lossless"]
