"""kv_keep: the compressed KV cache of raster models (`models/kv_cache.CompressedCache`, LlamaGen).

kv_keep=1 is today's cache; a budget that never evicts gives the same tokens; with eviction, the
evicted slots are the least-attended old image slots and a query sees exactly the slots held (a
full-cache model given that set as its mask returns the same logits); every raster method runs
with kv_keep=0.5; bad values and too-small budgets raise one VisarError; in a running batch a refilled
slot's compressed cache starts afresh for its new image.
"""

import json
from dataclasses import replace

import pytest
import torch
from laws import perturbed, tiny_llamagen, tiny_pipeline

import visar
from visar.accel import METHODS, Request, get_method
from visar.accel.core.sampling import SamplingParams
from visar.apps.cli import main
from visar.errors import VisarError
from visar.families import FAMILIES
from visar.loading import seeded_init
from visar.models.kv_cache import CacheKeys, CompressedCache

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


def test_every_raster_method_runs_compressed(pipe):
    draft = perturbed(pipe.model, seed=1, scale=0.3)
    for method in raster_methods(pipe):
        options = {k: v for k, v in SMALL.items() if k in method.options}
        if method.needs_draft:
            options[method.draft_option] = draft
        out = pipe.generate(
            class_labels=[0, 3], method=method.name, seed=1, output_type="tokens", kv_keep=0.5, **options
        )
        assert out.tokens.shape == (2, GRID, GRID), method.name
        assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < pipe.model.vocab_size, method.name
        assert out.stats["kv_keep"] == 0.5 and out.stats["lossless"] is False


@torch.no_grad()
def test_queries_see_exactly_the_held_slots_and_evict_the_least_attended():
    """Lockstep: a compressed model and a full-cache copy fed the same calls (multi-slot passes and
    truncations, as a drafting method makes them); the copy's mask is the set the compressed cache
    holds after each call, so equal logits mean a query saw exactly those slots. Every slot evicted
    had no more attention than any old image slot that stayed."""
    grid, batch = 6, 3
    compressed = tiny_llamagen(vocab=8, block_size=grid * grid, seed=2, std=0.3)
    full = tiny_llamagen(vocab=8, block_size=grid * grid, seed=2, std=0.3)
    num_slots = 1 + grid * grid
    compressed.setup_cache(batch, num_slots, None, kv_keep=0.5)  # C = 19: the condition, two rows, 6 more
    full.setup_cache(batch, num_slots, None)
    table = compressed.cache_keys
    gen = torch.Generator().manual_seed(0)
    cond = torch.tensor([0, 1, 2])
    pos = torch.zeros(batch, 1, dtype=torch.long)
    compressed(None, cond, input_pos=pos)
    full(None, cond, input_pos=pos)
    committed = torch.zeros(batch, dtype=torch.long)  # image tokens with their KV kept
    evictions = 0
    while int(committed.max()) < grid * grid - 4:
        width = int(torch.randint(1, 5, (1,), generator=gen))
        input_pos = 1 + committed[:, None] + torch.arange(width)  # [B, L]
        feed = torch.randint(0, 8, (batch, width), generator=gen)
        held_before, score_before = table.logical.clone(), table.score.clone()
        out = compressed(feed, input_pos=input_pos)
        held = table.logical.clone()  # [B, C]: what the call's queries could see
        mask = torch.zeros(batch, width, num_slots, dtype=torch.bool)
        for b in range(batch):
            mask[b, :, held[b][held[b] >= 0]] = True
        causal = torch.arange(num_slots)[None, None] <= input_pos[..., None]
        assert torch.allclose(out, full(feed, input_pos=input_pos, mask=mask & causal), atol=1e-5)
        for b in range(batch):
            before = {int(s): float(v) for s, v in zip(held_before[b], score_before[b], strict=True) if s >= 0}
            after = {int(s) for s in held[b] if s >= 0}
            evicted = set(before) - after
            evictions += len(evicted)
            assert all(s >= 1 for s in evicted)  # the condition slot stays
            front = int(input_pos[b].min())
            old_kept = [before[s] for s in after & set(before) if 1 <= s < front - grid * compressed.RECENT_ROWS]
            if evicted and old_kept:
                assert max(before[s] for s in evicted) <= min(old_kept)
        # accept a random part of the pass: the rest is forgotten, as a drafting method does
        committed = committed + torch.randint(1, width + 1, (batch,), generator=gen)
        compressed.truncate_cache(1 + committed)
        full.truncate_cache(1 + committed)
        assert not bool((table.logical >= (1 + committed)[:, None]).any())
    assert evictions > 0


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
