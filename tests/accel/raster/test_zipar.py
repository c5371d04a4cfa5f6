"""ZipAR next-set decoding, its Jacobi row fronts, the exact wavefront, and the 2-D draft initialisers.

- pass counts equal W + (H - 1) min(s, W) on several grids and windows;
- with s >= W, zipar is plain AR token for token (greedy and sampled, c2i and t2i);
- every pass feeds and shows exactly the intended sets (recorded from the model's forward,
  compared with sets derived from the closed-form schedule, not from the code's own rule);
- Jacobi fronts keep the lag and show no other front's drafts; with s >= W they sample the exact
  joint law (enumerated as in tests/laws.py);
- on a model with a hard radius-1 local receptive field, wavefront decoding equals raster decoding;
- the "above" / "left" / "above-left" initialisers keep the Jacobi engine exact (joint law).
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from laws import LocalLlamaGen, exact_law, tiny_llamagen
from scipy.stats import chisquare

import visar
from visar.accel import METHODS, Request, get_method
from visar.accel.core import tree_acceptance
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.raster import drafts, proposers, zipar
from visar.accel.raster.methods import ar, jacobi
from visar.apps.cli import main
from visar.errors import VisarError
from visar.models.lag_mask import lag_training_mask

SAMPLES = 20_000


def schedule_pass(index: int, width: int, s: int) -> int:
    """The pass (1 = the condition prefill) that produces image token `index` under the ideal schedule."""
    row, col = divmod(index, width)
    return 1 + col + row * min(s, width)


SAMPLED = SamplingParams(guidance_scale=1.5, top_k=20, top_p=0.9, temperature=1.1)
GREEDY = SamplingParams(top_k=1, guidance_scale=2.0)


# -- schedule ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, windows",
    [(16, [1, 2, 3, 4, 9]), (36, [1, 2, 4, 5, 6]), (64, [1, 3, 7, 8]), (256, [4, 8])],
)
def test_pass_count_is_the_formula(block_size, windows):
    model = tiny_llamagen(vocab=32, block_size=block_size, std=0.1)
    height, width = model.grid_size
    for s in windows:
        tokens, stats = zipar.zipar(Request(model, torch.tensor([0, 2]), SamplingParams(), make_generators(2, 0)), s=s)
        expected = width + (height - 1) * min(s, width)
        assert stats["forward_passes"] == expected and stats["forward_passes_per_image"] == [expected] * 2
        assert stats["tokens_per_forward"] == pytest.approx(block_size / expected)
        assert tokens.shape == (2, block_size)
        assert stats["max_fronts"] == min(height, -(-width // min(s, width)))
    if block_size == 256:  # the figures of the brief: 76 passes at s = 4, 136 at s = 8 (the released code: 88, 144)
        assert [width + (height - 1) * s for s in windows] == [76, 136]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SamplingParams()])
def test_equals_plain_ar_when_the_window_covers_a_row(params):
    model = tiny_llamagen(vocab=32, block_size=36, seed=1, std=0.3)
    cond = torch.tensor([0, 2, 1, 1])
    reference, ar_stats = ar.autoregressive(Request(model, cond, params, make_generators(4, 7)))
    for s in (6, 11):
        tokens, stats = zipar.zipar(Request(model, cond, params, make_generators(4, 7)), s=s)
        assert torch.equal(tokens, reference)
        assert stats["forward_passes"] == ar_stats["forward_passes"] == 36
    # a window below the row length changes the tokens (the test can fail)
    tokens, _ = zipar.zipar(Request(model, cond, params, make_generators(4, 7)), s=3)
    assert not torch.equal(tokens, reference)


def test_equals_plain_ar_text_conditional():
    """Caption conditions with padding: the prefill and the cache's key mask carry over to the explicit masks."""
    model = tiny_llamagen(vocab=32, block_size=16, seed=4, std=0.3, model_type="t2i", cls_token_num=3, caption_dim=8)
    captions = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[False, True, True], [True, True, True]])
    for params in (GREEDY, SAMPLED):
        reference, _ = ar.autoregressive(Request(model, captions, params, make_generators(2, 3), cond_mask=mask))
        tokens, _ = zipar.zipar(Request(model, captions, params, make_generators(2, 3), cond_mask=mask), s=4)
        assert torch.equal(tokens, reference)
        if params is GREEDY:  # Jacobi fronts, and GSD with groups of one (its test is then the exact one)
            book = torch.randn(model.vocab_size, 4)
            for name, options in [
                ("zipar-sjd", {}),
                ("zipar-mc-sjd", {}),
                ("zipar-gsd", dict(group_size=1)),
                ("pjd", {}),
            ]:
                request = Request(model, captions, params, make_generators(2, 3), cond_mask=mask, tokenizer=book)
                tokens, _ = get_method(name).fn(request, s=4, **options)
                assert torch.equal(tokens, reference), name


def test_tree_fronts_equal_plain_ar_greedy_when_the_window_covers_a_row(monkeypatch):
    """With s >= W and greedy sampling, fronts that take side candidates give plain AR's tokens: the
    side node's draw and the re-fed KV of the taken candidate are right. Without the re-feed the
    taken candidate's slot keeps candidate 0's KV, and the tokens change (the test can fail)."""
    model = tiny_llamagen(vocab=16, block_size=64, seed=5, std=0.6)  # neighbours often equal: sides get taken
    cond = torch.tensor([0, 1, 2, 0])
    reference, _ = ar.autoregressive(Request(model, cond, GREEDY, make_generators(4, 7)))
    tokens, stats = zipar.zipar_tree(Request(model, cond, GREEDY, make_generators(4, 7)), s=8, window=6, branch=4)
    assert torch.equal(tokens, reference) and min(stats["side_taken_per_image"]) > 0
    extend = zipar.tree_fronts.FrontTrees.extend

    def no_refeed(self, *args):
        commits = extend(self, *args)
        self.refeed = torch.full_like(self.refeed, -1)
        return commits

    monkeypatch.setattr(zipar.tree_fronts.FrontTrees, "extend", no_refeed)
    tokens, _ = zipar.zipar_tree(Request(model, cond, GREEDY, make_generators(4, 7)), s=8, window=6, branch=4)
    assert not torch.equal(tokens, reference)


def test_tree_fronts_of_one_candidate_are_zipar_mc_sjd():
    """branch 1 or depth 1: no tree, the tokens and passes of zipar-mc-sjd (maximal coupling)."""
    model = tiny_llamagen(block_size=36, seed=6)
    cond = torch.tensor([0, 2, 1])
    reference, ref_stats = zipar.zipar_mc_sjd(
        Request(model, cond, SAMPLED, make_generators(3, 4)), s=2, window=4, init="above"
    )
    for options in (dict(branch=1), dict(depth=1)):
        tokens, stats = zipar.zipar_tree(Request(model, cond, SAMPLED, make_generators(3, 4)), s=2, window=4, **options)
        assert torch.equal(tokens, reference) and stats["forward_passes"] == ref_stats["forward_passes"]
    tokens, _ = zipar.zipar_tree(Request(model, cond, SAMPLED, make_generators(3, 4)), s=2, window=4, branch=3)
    assert not torch.equal(tokens, reference)


class Recorder:
    """Wraps a model's forward and keeps every cached call's inputs, positions and mask."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __enter__(self):
        original = self.model.forward

        def forward(tokens=None, cond=None, **kw):
            if tokens is not None:
                self.calls.append((tokens.clone(), kw["input_pos"].clone(), kw["mask"].clone()))
            return original(tokens, cond, **kw)

        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


@pytest.mark.parametrize("block_size, s, params", [(36, 2, SamplingParams()), (36, 4, GREEDY), (64, 3, SAMPLED)])
def test_each_pass_feeds_and_shows_the_intended_sets(block_size, s, params):
    model = tiny_llamagen(vocab=32, block_size=block_size, seed=2, std=0.3)
    height, width = model.grid_size
    num_tokens, num_cond = block_size, model.num_condition_tokens
    cond = torch.tensor([1, 0])
    with Recorder(model) as rec:
        tokens, stats = zipar.zipar(Request(model, cond, params, make_generators(2, 1)), s=s)
    produced = [schedule_pass(i, width, s) for i in range(num_tokens)]
    assert len(rec.calls) == stats["forward_passes"] - 1
    last_fed = {}
    for step, (fed, input_pos, mask) in enumerate(rec.calls, start=2):
        copies = 2 if params.uses_cfg else 1
        assert fed.shape[0] == input_pos.shape[0] == mask.shape[0] == copies * len(cond)
        assert torch.equal(fed[:2], fed[-2:]) and torch.equal(mask[:2], mask[-2:])  # CFG halves aligned
        index = (input_pos[0] - num_cond).tolist()
        # inputs: the predecessor of every token this pass produces, plus each row's last token
        # produced on the pass before (its KV), merged when they coincide
        predecessors = {i - 1 for i in range(num_tokens) if produced[i] == step}
        row_ends = {r * width + width - 1 for r in range(height - 1) if produced[r * width + width - 1] == step - 1}
        assert sorted(index) == sorted(predecessors | row_ends)
        assert (input_pos == input_pos[0]).all()  # one schedule for the whole batch
        for b in range(len(cond)):
            for m, k in enumerate(index):
                visible = mask[b, m, num_cond:].nonzero().flatten().tolist()
                expected = sorted({j for j in range(k) if produced[j] < step} | {k})
                assert visible == expected, (step, k)
                assert mask[b, m, :num_cond].all()
                if produced[k] < step:  # a generated token is fed as itself
                    assert fed[b, m] == tokens[b, k]
                else:  # a row start's stand-in: the last generated token of the row above
                    row = k // width
                    newest = max(j for j in range(row * width, k) if produced[j] < step)
                    assert fed[b, m] == tokens[b, newest]
                last_fed[(b, k)] = int(fed[b, m])
    # every slot's last write is its true token: no stand-in KV survives
    assert all(last_fed[(b, k)] == tokens[b, k] for b in range(len(cond)) for k in range(num_tokens - 1))


@pytest.mark.parametrize("block_size, s", [(36, 2), (64, 3), (36, 6)])
def test_training_mask_is_what_each_predicting_input_sees(block_size, s):
    """ZipAR-aware training (visar/train/raster.py) must show a position what generation shows it."""
    model = tiny_llamagen(vocab=32, block_size=block_size, seed=3, std=0.3)
    height, width = model.grid_size
    num_cond = model.num_condition_tokens
    train_mask = lag_training_mask((height, width), s, num_cond)
    length = num_cond + block_size - 1
    assert train_mask.shape == (length, length)
    with Recorder(model) as rec:
        zipar.zipar(Request(model, torch.tensor([0, 2]), SAMPLED, make_generators(2, 1)), s=s)
    produced = [schedule_pass(i, width, s) for i in range(block_size)]
    checked = 0
    for step, (_, input_pos, mask) in enumerate(rec.calls, start=2):
        for m, k in enumerate((input_pos[0] - num_cond).tolist()):
            if k + 1 < block_size and produced[k + 1] == step:  # this input predicts token k + 1
                assert torch.equal(mask[:, m, :length], train_mask[num_cond + k].expand(mask.shape[0], -1))
                assert not mask[:, m, length:].any()
                checked += 1
    assert checked == block_size - 1
    # the condition position that predicts token 0 sees only the condition, as in raster order
    assert train_mask[num_cond - 1].nonzero().flatten().tolist() == list(range(num_cond))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    assert torch.equal(lag_training_mask((height, width), width, num_cond), causal)
    assert torch.equal(train_mask, causal) == (s >= width)


def test_plan_of_jacobi_fronts():
    """A hand-made state of one 4x6 image at s = 2, window 3: row 0 complete (last token not yet
    fed), row 1 waiting for row 0 (full window), row 2 lag-clipped, row 3 starting with a stand-in."""
    count = torch.tensor([[6, 3, 2, 0]])
    fed = torch.tensor([[5, 2, 2, 0]])
    plan = zipar.plan.plan_pass(count, fed, (4, 6), s=2, window=3)
    assert plan.window_len.tolist() == [[0, 3, 0, 1]]
    # row 2 may predict (2, c) only once row 1 has c + 2 tokens: (2, 2) needs 4, row 1 has 3
    assert plan.feed_only.tolist() == [[True, False, False, False]]  # row 2's newest token already has its KV
    assert plan.input_index.tolist() == [[5, 8, 9, 10, 17]]
    assert plan.predicts.tolist() == [[False, True, True, True, True]]
    assert plan.has_draft.tolist() == [[False, True, True, False, False]]
    generated = zipar.plan.generated_mask(count, 6)
    visible = zipar.plan.visibility(plan, generated)[0]
    rows = [visible[m].nonzero().flatten().tolist() for m in range(5)]
    assert rows[0] == [0, 1, 2, 3, 4, 5]
    assert rows[1] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert rows[2] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # its front's draft 9
    assert rows[3] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # row 3's start sits at (2, 5) with a stand-in: it sees row 2's generated tokens, not row 1's drafts
    assert rows[4] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17]
    tokens = torch.arange(24)[None] + 100
    fed_tokens = zipar.plan.pass_inputs(plan, tokens, torch.tensor([[0, 7, 8, 0, 0]]))
    assert fed_tokens.tolist() == [[105, 108, 7, 8, 113]]  # the stand-in is row 2's newest token, 13


def test_plan_of_a_start_lag():
    """PJD's pair on one 4x12 image, start lag 8 and running lag 2: a row waits for 8 tokens above
    before its first, then predicts up to 2 columns behind the row above."""
    count = torch.tensor([[7, 0, 0, 0]])
    plan = zipar.plan.plan_pass(count, count.clone(), (4, 12), s=2, window=8, start_lag=8)
    assert plan.window_len.tolist() == [[5, 0, 0, 0]]  # row 1 waits: 7 < 8 tokens above
    assert zipar.plan.plan_pass(count, count.clone(), (4, 12), s=2, window=8).window_len.tolist() == [[5, 6, 0, 0]]
    count = torch.tensor([[8, 0, 0, 0]])
    plan = zipar.plan.plan_pass(count, count.clone(), (4, 12), s=2, window=8, start_lag=8)
    assert plan.window_len.tolist() == [[4, 7, 0, 0]]  # row 1 starts with columns 0 .. 6 (c + 2 <= 8)
    count = torch.tensor([[12, 9, 3, 0]])  # row 1 started: lag 2 behind row 0's end, row 2 at 9 - 2 - 3 = 4
    plan = zipar.plan.plan_pass(count, count.clone(), (4, 12), s=2, window=8, start_lag=8)
    assert plan.window_len.tolist() == [[0, 3, 5, 0]]
    # a start lag of the running lag or less is the running lag's own schedule
    assert torch.equal(
        zipar.plan.plan_pass(count, count.clone(), (4, 12), s=3, window=8, start_lag=2).window_len,
        zipar.plan.plan_pass(count, count.clone(), (4, 12), s=3, window=8).window_len,
    )


@pytest.mark.parametrize(
    "name, options",
    [("zipar-mc-sjd", dict(s=3, window=4, cross_row=False)), ("pjd", dict(start_lag=5, s=2, window=4))],
)
def test_jacobi_fronts_keep_the_lag_and_their_drafts_private(monkeypatch, name, options):
    model = tiny_llamagen(vocab=32, block_size=64, seed=3, std=0.3)
    width, num_cond, s = 8, model.num_condition_tokens, options["s"]
    start_lag = options.get("start_lag", s)
    counts = []
    plan_pass = zipar.plan.plan_pass
    monkeypatch.setattr(
        zipar.engine, "plan_pass", lambda count, *a, **k: counts.append(count.clone()) or plan_pass(count, *a, **k)
    )
    cond = torch.tensor([0, 1, 2])
    with Recorder(model) as rec:
        tokens, stats = get_method(name).fn(Request(model, cond, SamplingParams(), make_generators(3, 0)), **options)
    assert stats["acceptance_rate"] > 0 and max(stats["forward_passes_per_image"]) < width + 7 * start_lag
    checked = 0
    for count, (fed, input_pos, mask) in zip(counts[1:], rec.calls, strict=False):
        for b in range(3):
            generated = zipar.plan.generated_mask(count, width)[b]
            for m, pos in enumerate(input_pos[b].tolist()):
                k = pos - num_cond
                if k == 63:
                    continue  # padding
                row, col = divmod(k + 1, width)
                for j in mask[b, m, num_cond:].nonzero().flatten().tolist():
                    if j != k and not generated[j]:  # an ungenerated slot: only its own front's drafts
                        assert j // width == row and j <= k and j >= row * width + int(count[b, row]), (k, j)
                if generated[k]:
                    assert fed[b, m] == tokens[b, k]
                if 0 < row < 8 and k + 1 >= row * width + int(count[b, row]):  # predicts (row, col): the lag
                    assert int(count[b, row - 1]) >= min(col + s, width)
                    assert col > 0 or int(count[b, row - 1]) >= min(start_lag, width)  # a row's first token
                    checked += 1
    assert checked > 50


def test_plan_and_commits_of_cross_row_fronts():
    """One 4x6 image at s = 2, window 4: row 0 at 3 tokens, row 1 at 1 (lag-clipped: it may not
    predict (1, 1) from generated tokens alone), row 2 not started."""
    count = torch.tensor([[3, 1, 0, 0]])
    fed = torch.tensor([[2, 0, 0, 0]])
    plain = zipar.plan.plan_pass(count, fed, (4, 6), s=2, window=4)
    assert plain.window_len.tolist() == [[3, 1, 0, 0]]
    plan = zipar.plan.plan_pass(count, fed, (4, 6), s=2, window=4, cross_row=True)
    # row 0 feeds 2 drafts (columns 3, 4): row 1 may predict up to column 4 + 1 - 2 = 3
    assert plan.window_len.tolist() == [[3, 3, 0, 0]] and plan.above_drafts.tolist() == [[0, 2, 0, 0]]
    assert plan.input_index.tolist() == [[2, 3, 4, 6, 7, 8]]
    visible = zipar.plan.visibility(plan, zipar.plan.generated_mask(count, 6), s=2)[0]
    rows = [visible[m].nonzero().flatten().tolist() for m in range(6)]
    assert rows[3] == [0, 1, 2, 6]  # predicts (1, 1): needs row 0 up to column 2, generated
    assert rows[4] == [0, 1, 2, 3, 6, 7]  # predicts (1, 2): also row 0's draft at column 3
    assert rows[5] == [0, 1, 2, 3, 4, 6, 7, 8]  # predicts (1, 3): drafts at columns 3 and 4
    # row 0 accepts its first draft only: it commits columns 3 (draft) and 4 (residual); the
    # row-0 columns known as fed are 0..3, so row 1 keeps (1, 1) and (1, 2), not (1, 3)
    accept = torch.tensor([[True, False, False, True, True, False]])
    valid, commits, good = zipar.plan.valid_commits(plan, accept, count)
    assert valid.tolist() == [[True, True, True, True, True, False]]
    assert good.tolist() == [[1, 2, 0, 0]]
    assert commits.tolist() == [[2, 2, 0, 0]]  # row 1: two accepted drafts, no extra token after an invalid slot
    # without leaning fronts the plain rule: leading accepts + 1
    valid, commits, _ = zipar.plan.valid_commits(plain, torch.tensor([[True, False, False, False]]), count)
    assert commits.tolist() == [[2, 1, 0, 0]] and valid.all()


def windows_row_by_row(count, width, s, window):
    """The cross-row windows as the loop over rows made them (before `compose_down`)."""
    above = torch.cat([torch.full_like(count[:, :1], width), count[:, :-1]], 1)
    reach = torch.where(above >= width, width, above - s + 1)
    window_len, above_drafts = zipar.plan.capped(reach - count, window), torch.zeros_like(count)
    for r in range(1, count.shape[1]):
        drafts = (window_len[:, r - 1] - 1).clamp(min=0)
        leans = (count[:, r] > 0) & (above[:, r] < width)
        above_drafts[:, r] = torch.where(leans, drafts, 0)
        window_len[:, r] = zipar.plan.capped(reach[:, r] + above_drafts[:, r] - count[:, r], window[:, 0])
    return window_len, above_drafts


def commits_row_by_row(plan, accept, count, width, s):
    """valid_commits of cross-row fronts as the loop over rows made them (before `compose_down`)."""
    never = plan.slot.shape[1] + 1
    column = (plan.input_index + 1) % width
    valid, good = plan.predicts.clone(), torch.zeros_like(count)
    stop_holds = torch.zeros_like(count, dtype=torch.bool)
    for r in range(count.shape[1]):
        lane = plan.row == r
        if r > 0:
            held = count[:, r - 1] + good[:, r - 1]
            valid &= ~lane | ~plan.leans | (column + s <= held[:, None])
        stop = lane & plan.predicts & ~(accept & valid)
        first = torch.where(stop, plan.slot, never).amin(1)
        good[:, r] = torch.where(plan.window_len[:, r] > 0, first, 0)
        stop_holds[:, r] = (stop & valid & (plan.slot == first[:, None])).any(1)
    return valid, torch.where(plan.window_len > 0, good + stop_holds.long(), 0), good


def test_cross_row_windows_and_commits_equal_the_row_loops():
    """front_windows and valid_commits chain the rows in ceil(log2 H) steps what the loops did row by
    row: random counts (chains of leaning fronts included), windows per image, accepts, s."""
    gen = torch.Generator().manual_seed(0)
    chains = 0
    for trial in range(300):
        batch, height, width = 3, int(torch.randint(1, 10, (1,), generator=gen)), 7
        s = int(torch.randint(1, 5, (1,), generator=gen))
        count = torch.randint(0, width + 1, (batch, height), generator=gen).sort(1, descending=True).values
        count[torch.rand(batch, height, generator=gen) < 0.2] = 0
        window = torch.randint(1, width + 1, (batch,), generator=gen)
        window_len, _, above_drafts = zipar.plan.front_windows(count, width, s, window, cross_row=True)
        loop_len, loop_drafts = windows_row_by_row(count, width, s, window[:, None])
        assert torch.equal(window_len, loop_len) and torch.equal(above_drafts, loop_drafts), trial
        chains += int(((above_drafts[:, 1:] > 0) & (above_drafts[:, :-1] > 0)).sum())
        plan = zipar.plan.plan_pass(count, count.clone(), (height, width), s, int(window[0]), cross_row=True)
        has_draft = torch.zeros_like(plan.predicts) if plan.has_draft is None else plan.has_draft  # None: no drafts
        accept = has_draft & (torch.rand(plan.slot.shape, generator=gen) < 0.7)
        if trial % 3 == 0:  # any accept, the last slot of a front included
            accept = torch.rand(plan.slot.shape, generator=gen) < 0.7
        fast = zipar.plan.valid_commits(plan, accept, count)
        loop = commits_row_by_row(plan, accept, count, width, s)
        assert all(torch.equal(a, b) for a, b in zip(fast, loop, strict=True)), trial
    assert chains > 50  # fronts leaning on fronts that lean: the case the loops chained


def test_cross_row_fronts_commit_only_tokens_whose_context_held(monkeypatch):
    """Recorded from real runs: every token a front commits was predicted when the row above had
    (after that pass) at least min(c + s, W) tokens; what a query sees beyond the generated tokens
    is its own front's drafts or the row above's drafts it needs (columns <= c + s - 1)."""
    model = tiny_llamagen(vocab=16, block_size=64, seed=5, std=0.6)
    width, num_cond = 8, model.num_condition_tokens
    counts = []
    plan_pass = zipar.plan.plan_pass
    monkeypatch.setattr(
        zipar.engine, "plan_pass", lambda count, *a, **k: counts.append(count.clone()) or plan_pass(count, *a, **k)
    )
    cond = torch.zeros(4, dtype=torch.long)
    leaned = 0
    for name, s in [("zipar-mc-sjd", 2), ("zipar-mc-sjd", 3), ("zipar-tree", 2), ("zipar-tree", 3)]:
        counts.clear()
        with Recorder(model) as rec:
            tokens, stats = get_method(name).fn(
                Request(model, cond, SamplingParams(temperature=0.3), make_generators(4, 0)),
                s=s,
                window=6,
                init="above",
            )
        assert stats["cross_row"] and sum(stats.get("side_taken_per_image", [1])) > 0
        counts.append(torch.full_like(counts[0], width))
        for before, after in zip(counts[:-1], counts[1:], strict=True):
            for b in range(4):
                for row in range(1, 8):
                    for col in range(int(before[b, row]), int(after[b, row])):
                        assert int(after[b, row - 1]) >= min(col + s, width), (name, s, b, row, col)
                        leaned += int(before[b, row - 1]) < min(col + s, width)
        for count, (_, input_pos, mask) in zip(counts[1:], rec.calls, strict=False):
            for b in range(4):
                generated = zipar.plan.generated_mask(count, width)[b]
                for m, pos in enumerate(input_pos[b].tolist()):
                    k = pos - num_cond
                    if k == 63:  # padding: no real input sits at the last token, and no one reads its outputs
                        continue
                    row, col = divmod(k + 1, width)
                    for j in mask[b, m, num_cond : num_cond + 64].nonzero().flatten().tolist():  # not scratch
                        if j == k or generated[j]:
                            continue
                        own = j // width == row and row * width + int(count[b, row]) <= j <= k
                        above = j // width == row - 1 and j <= k - width + s
                        assert own or above, (name, s, k, j)
    assert leaned > 0  # some commits did lean on drafts of the row above


@pytest.mark.slow  # 16 configurations x 16 images, compared by their mean passes
def test_jacobi_fronts_never_need_more_passes_than_zipar():
    """Each front commits at least one token whenever zipar's would, so no image needs more passes
    than W + (H - 1) s, with or without cross-row drafts. On a peaked model (neighbours often
    equal) drafts copied from the row above are accepted far more often than uniform ones (here:
    16.9 vs 21.8 passes at s = 2, 20.1 vs 34.4 at s = 4, of 22 and 36). Leaning on the row above's
    drafts does not pay on this toy (its rows alternate two tokens, and a row that starts a pass
    earlier from another draw runs out of phase with the row above, whose copies then fail: 19.7
    vs 16.9 at s = 2); on visar-tiny-c2i it does (README)."""
    model = tiny_llamagen(vocab=16, block_size=64, seed=5, std=0.6)
    cond = torch.zeros(16, dtype=torch.long)
    params = SamplingParams(temperature=0.3)
    for s in (2, 4):
        bound = 8 + 7 * s
        mean_passes = {}
        for name in ("zipar-sjd", "zipar-mc-sjd"):
            for init in ("above", "random"):
                for cross_row in (True, False):
                    _, stats = get_method(name).fn(
                        Request(model, cond, params, make_generators(16, 0)),
                        s=s,
                        window=8,
                        init=init,
                        cross_row=cross_row,
                    )
                    per_image = stats["forward_passes_per_image"]
                    assert max(per_image) <= bound, (name, init, cross_row, per_image)
                    mean_passes[name, init, cross_row] = np.mean(per_image)
        print(s, bound, mean_passes)
        assert mean_passes["zipar-sjd", "above", False] < mean_passes["zipar-sjd", "random", False] - 3


@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_carried_laws_are_kept_for_live_drafts_only(monkeypatch, coupling):
    """Carried q's and Gumbel noise rows are held for the drafts a front can still verify (at most
    fronts x (window - 1)) and for one pass's slots, not for all N image tokens: at a real
    vocabulary [B, N, V] of each is 540 MB (B=32, N=256, V=16,384)."""
    held = {"laws": 0, "noise": 0}
    pack, carry = zipar.carried.CarriedDrafts.pack, proposers.GumbelCarry.__call__

    def counted_pack(self, size):
        pack(self, size)
        held["laws"] = max(held["laws"], self.probs.shape[1])

    def counted_carry(self, request):
        out = carry(self, request)
        held["noise"] = max(held["noise"], self.noise.shape[1])
        return out

    monkeypatch.setattr(zipar.carried.CarriedDrafts, "pack", counted_pack)
    monkeypatch.setattr(proposers.GumbelCarry, "__call__", counted_carry)
    model = tiny_llamagen(vocab=16, block_size=64, seed=5, std=0.6)  # 8 x 8 tokens
    window = 4
    _, stats = zipar.zipar_mc_sjd(
        Request(model, torch.zeros(6, dtype=torch.long), SamplingParams(), make_generators(6, 0)), s=2, window=window,
        coupling=coupling,
    )  # fmt: skip
    assert 0 < held["laws"] <= stats["max_fronts"] * (window - 1) < 64
    if coupling == "gumbel":
        assert 0 < held["noise"] <= stats["max_fronts"] * window < 64


@pytest.mark.one_thread  # tokens of a batch against each image alone
def test_jacobi_fronts_do_not_depend_on_the_batch():
    model = tiny_llamagen(vocab=32, block_size=36, seed=6, std=0.3)
    params = SAMPLED
    cond = torch.tensor([0, 2, 1])
    gens = make_generators(3, 10)
    tokens, stats = zipar.zipar_sjd(Request(model, cond, params, gens), s=2, window=4, init="above-left")
    alone, alone_stats = zipar.zipar_sjd(
        Request(model, cond[1:2], params, [torch.Generator().manual_seed(11)]), s=2, window=4, init="above-left"
    )
    assert torch.equal(alone[0], tokens[1])
    assert alone_stats["forward_passes_per_image"][0] == stats["forward_passes_per_image"][1]
    tokens, stats = zipar.zipar_tree(Request(model, cond, params, make_generators(3, 10)), s=2, window=4, branch=4)
    alone, alone_stats = zipar.zipar_tree(
        Request(model, cond[1:2], params, [torch.Generator().manual_seed(11)]), s=2, window=4, branch=4
    )
    assert torch.equal(alone[0], tokens[1]) and stats["side_taken_per_image"][1] > 0
    assert alone_stats["forward_passes_per_image"][0] == stats["forward_passes_per_image"][1]


# -- exactness against the enumerated joint law --------------------------------------------------------------


def law_matches(tokens: torch.Tensor, law: np.ndarray, vocab: int) -> tuple[bool, str]:
    """Chi-square (cells expected below 5 pooled) and TV against the Monte-Carlo noise floor
    (mean + 5 sd of the TV of exact multinomial samples of the same size)."""
    n = len(tokens)
    index = (tokens * vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)).sum(1).numpy()
    counts = np.bincount(index, minlength=len(law)).astype(float)
    if counts[law == 0].sum():
        return False, "a zero-probability sequence was drawn"
    expected = law * n
    small = expected < 5
    observed, expected = (
        np.append(counts[~small], counts[small].sum()),
        np.append(expected[~small], expected[small].sum()),
    )
    if expected[-1] == 0:  # nothing to pool (top-k / top-p zeroed those cells)
        observed, expected = observed[:-1], expected[:-1]
    pvalue = chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    tv = 0.5 * np.abs(counts / n - law).sum()
    null_tv = 0.5 * np.abs(np.random.default_rng(0).multinomial(n, law / law.sum(), size=200) / n - law).sum(1)
    tolerance = null_tv.mean() + 5 * null_tv.std()
    return pvalue > 1e-3 and tv < tolerance, f"p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}"


@pytest.fixture(scope="module")
def model4():
    """2x2 tokens, vocabulary 6: 1296 sequences, enumerable."""
    return tiny_llamagen(vocab=6, block_size=4, seed=0, std=0.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options, params",
    [
        ("sjd", dict(init="above", window=2), SamplingParams(guidance_scale=2.0, top_k=4)),
        ("mc-sjd", dict(init="left", window=3, coupling="gumbel"), SamplingParams(top_p=0.8, temperature=1.3)),
        ("mc-sjd", dict(init="above-left", window=2), SamplingParams(guidance_scale=1.5, top_k=5, top_p=0.9)),
        ("zipar-sjd", dict(init="above-left", window=2, s=2), SamplingParams(guidance_scale=2.0, top_k=4)),
        ("zipar-mc-sjd", dict(init="above", window=2, s=2, coupling="gumbel"), SamplingParams(top_p=0.8)),
        ("pjd", dict(s=2, window=2), SamplingParams(guidance_scale=1.5, top_k=5)),  # start lag 8: past the row
    ],
)
def test_joint_law_is_exact(model4, name, options, params):
    """The 2-D initialisers in the Jacobi engine, and Jacobi row fronts with s >= W, sample the model's law."""
    label = 1
    cond = torch.full((SAMPLES,), label)
    tokens, stats = get_method(name).fn(Request(model4, cond, params, make_generators(SAMPLES, 3000)), **options)
    ok, summary = law_matches(tokens, exact_law(model4, label, params), model4.vocab_size)
    print(name, options, summary, stats["tokens_per_forward"])
    assert ok, summary
    assert stats["tokens_per_forward"] > 1.0  # drafts were accepted, so the initialiser's drafts were tested


@pytest.mark.slow
def test_a_copy_reported_with_the_wrong_q_is_detected(model4):
    """Negative control: the same copies reported as uniform draws (q = 1/V instead of one-hot) bias
    the law, and the joint-law test above sees it."""

    def above_claimed_uniform(request):
        tokens, _ = drafts.above_init(request)
        vocab = request.state.vocab_size
        return tokens, torch.full((*tokens.shape, vocab), 1.0 / vocab)

    params, label = SamplingParams(guidance_scale=2.0, top_k=4), 1
    cond = torch.full((SAMPLES,), label)
    tokens, _ = jacobi.sjd(
        Request(model4, cond, params, make_generators(SAMPLES, 3000)), window=2, init=above_claimed_uniform
    )
    ok, summary = law_matches(tokens, exact_law(model4, label, params), model4.vocab_size)
    print("wrong q:", summary)
    assert not ok, summary


TREE_LAW = [
    (dict(s=2, branch=3, init="random", neighbours=""), SamplingParams(top_p=0.8, temperature=1.3)),
    (dict(s=4, branch=4), SamplingParams(guidance_scale=2.0, top_k=4)),
]


@pytest.mark.slow
@pytest.mark.parametrize("options, params", TREE_LAW)
def test_tree_fronts_sample_the_exact_law(model4, options, params):
    """Tree fronts with s >= W: draws from the carried draft's law, or the neighbours first, verified
    by recursive rejection, sample the model's joint law; side candidates were taken in many images."""
    label, cond = 1, torch.full((SAMPLES,), 1)
    tokens, stats = zipar.zipar_tree(Request(model4, cond, params, make_generators(SAMPLES, 3100)), **options)
    ok, summary = law_matches(tokens, exact_law(model4, label, params), model4.vocab_size)
    print("zipar-tree", options, summary, "side taken", np.mean(stats["side_taken_per_image"]))
    assert ok, summary
    assert np.mean(stats["side_taken_per_image"]) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("options, params", TREE_LAW)
def test_tree_fronts_without_the_residual_ladder_are_detected(model4, monkeypatch, options, params):
    """Negative control: each candidate tested against p instead of the residual its earlier
    candidates left (and the last draw from p) biases the law, and the same test sees it."""
    monkeypatch.setattr(tree_acceptance, "ladder_residual", lambda target, draft: target)
    label, cond = 1, torch.full((SAMPLES,), 1)
    tokens, _ = zipar.zipar_tree(Request(model4, cond, params, make_generators(SAMPLES, 3100)), **options)
    ok, summary = law_matches(tokens, exact_law(model4, label, params), model4.vocab_size)
    print("zipar-tree without the ladder", options, summary)
    assert not ok, summary


def test_initialisers_copy_their_neighbours():
    """On a 3x3 grid, vocabulary 5: what each initialiser drafts and the q it reports."""
    state = SimpleNamespace(  # what an initialiser reads of a `SlotState`
        tokens=torch.zeros(3, 12, dtype=torch.long), committed=torch.tensor([4, 1, 4]), keys=torch.zeros(3),
        num_tokens=9, vocab_size=5, grid_size=(3, 3), window=3, vocab_ids=lambda: torch.arange(5),
    )  # fmt: skip
    canvas = torch.full((3, 12), -1)
    canvas[0, :4] = torch.tensor([1, 2, 3, 4])  # image 0: four committed tokens and a carried draft at index 5
    canvas[0, 5] = 0
    canvas[1, 0] = 2  # image 1: one committed token
    canvas[2, :4] = torch.tensor([1, 4, 3, 4])  # image 2: (1, 1) has the same token above and to the left
    index = torch.tensor([[4, 5, 6, 7], [1, 2, 3, -1], [4, -1, -1, -1]])
    uniforms = torch.tensor([[0.1, 0.7, 0.3, 0.9], [0.2, 0.6, 0.99, 0.5], [0.8, 0.1, 0.1, 0.1]])
    request = drafts.FillRequest(state, index, uniforms, canvas)
    uniform = torch.full((5,), 0.2)

    tokens, probs = drafts.above_init(request)
    # (1, 1) <- 2 above it; (2, 0) <- 4; (2, 1) <- the copy just made for (1, 1)
    assert tokens[0, [0, 2, 3]].tolist() == [2, 4, 2]
    assert tokens[1].tolist() == [1, 3, 2, 2]  # row 0 has nothing above: uniform tokens int(5 u); (1, 0) <- 2
    assert torch.equal(probs[0, 0], torch.eye(5)[2]) and torch.allclose(probs[1, 0], uniform)
    assert canvas[0, 4] == -1  # the caller's canvas is left as it was

    tokens, probs = drafts.left_init(request)
    assert tokens[0].tolist()[:2] == [4, 4]  # (1, 1) <- 4; (1, 2) (carried: unused) <- the copy
    assert tokens[0, 2] == 1 and torch.allclose(probs[0, 2], uniform)  # a row start has no left neighbour
    assert tokens[0, 3] == 4 and torch.allclose(probs[0, 3], uniform)  # a random draft is not a source
    assert tokens[1, :2].tolist() == [2, 2] and torch.equal(probs[1, 1], torch.eye(5)[2])  # a run repeats

    tokens, probs = drafts.above_left_init(request)
    # (1, 1): above 2, left 4, u = 0.1 < 1/2 picks above; q is the two-point mixture
    assert tokens[0, 0] == 2 and torch.allclose(probs[0, 0], torch.tensor([0, 0, 0.5, 0, 0.5]))
    assert tokens[0, 2] == 4 and torch.equal(probs[0, 2], torch.eye(5)[4])  # (2, 0): only above
    # (2, 1): above is (1, 1)'s copy (2), left is (2, 0)'s copy (4); u = 0.9 picks left
    assert tokens[0, 3] == 4 and torch.allclose(probs[0, 3], torch.tensor([0, 0, 0.5, 0, 0.5]))
    assert tokens[2, 0] == 4 and torch.equal(probs[2, 0], torch.eye(5)[4])  # both neighbours agree: one-hot
    assert torch.allclose(probs[1, 3], uniform)  # a slot with no draft (-1) still gets a distribution


# -- wavefront ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_model():
    return tiny_llamagen(vocab=32, block_size=36, seed=7, std=0.5, cls=LocalLlamaGen)


@torch.no_grad()
def test_local_model_is_local(local_model):
    """The test model's logits for token t move exactly with the tokens its two layers read: the
    neighbours N(t) that the query attends to, and what those positions read in layer 1."""
    model, width, num_tokens = local_model, 6, 36

    def reads(t: int) -> set[int]:  # the slots the query predicting t attends to
        r, c = divmod(t, width)
        slots = {(r - 1) * width + c + d for d in (-1, 0, 1) if 0 <= c + d < width and r > 0}
        return slots | ({t - 1} if c > 0 else set())

    seq = torch.randint(0, 32, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    changed = seq.repeat(num_tokens, 1)
    changed[torch.arange(num_tokens), torch.arange(num_tokens)] = (seq[0] + 1) % 32  # row j changes token j
    cond = torch.ones(num_tokens + 1, dtype=torch.long)
    logits = model(torch.cat([seq, changed])[:, :-1], cond)  # position t predicts token t
    base, moved = logits[0], logits[1:]
    for t in range(num_tokens):
        depends = {t - 1} | reads(t) | {j for q in reads(t) for j in reads(q + 1)}
        depends = {j for j in depends if j >= 0 and j % width != width - 1}  # a row's last token is never read
        for j in range(t):
            assert torch.equal(moved[j, t], base[t]) == (j not in depends), (t, j)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_wavefront_equals_raster_on_a_local_model(local_model, params):
    cond = torch.tensor([0, 1, 2, 1, 0, 2])
    reference, _ = ar.autoregressive(Request(local_model, cond, params, make_generators(6, 2)))
    tokens, stats = zipar.wavefront(Request(local_model, cond, params, make_generators(6, 2)))
    assert torch.equal(tokens, reference)
    assert stats["forward_passes"] == 6 + 2 * 5 and stats["dependency_reach"] == 1  # (W-1) + (R+1)(H-1) + 1
    if params is SAMPLED:  # a lag too short for the model's reach hides (r-1, c+1): the tokens change
        tokens, _ = zipar.zipar(Request(local_model, cond, params, make_generators(6, 2)), s=1)
        assert not torch.equal(tokens, reference)


# -- registration, options, bad input -------------------------------------------------------------------------


def test_methods_are_registered_with_their_options():
    assert METHODS["zipar"].options == ["s"] and not METHODS["zipar"].lossless
    assert METHODS["zipar-sjd"].options == ["s", "window", "init", "cross_row", "budget", "start_lag"]
    assert not METHODS["zipar-sjd"].lossless
    assert METHODS["zipar-mc-sjd"].options == ["s", "window", "coupling", "init", "cross_row", "budget", "start_lag"]
    assert METHODS["pjd"].options == ["start_lag", "s", "window", "coupling", "init", "cross_row", "budget"]
    assert not METHODS["pjd"].lossless
    assert METHODS["zipar-gsd"].options == [
        "s",
        "group_size",
        "prob_gap",
        "max_distance",
        "residual",
        "window",
        "init",
        "cross_row",
        "budget",
        "start_lag",
    ]
    assert not METHODS["zipar-gsd"].lossless
    assert METHODS["zipar-tree"].options == [
        "s",
        "window",
        "branch",
        "depth",
        "init",
        "neighbours",
        "cross_row",
        "budget",
        "start_lag",
    ]
    assert not METHODS["zipar-tree"].lossless
    assert METHODS["wavefront"].options == [] and METHODS["wavefront"].lossless
    assert {"above", "left", "above-left"} <= set(drafts.INITIALISERS)


def test_pipeline_and_cli(tmp_path):
    pipe = visar.load("visar-tiny-random", device="cpu")
    out = pipe.generate(class_labels=[1, 2], method="zipar", s=4, output_type="tokens")
    assert out.tokens.shape == (2, 16, 16) and out.stats["forward_passes"] == 76 and not out.stats["lossless"]
    out = pipe.generate(class_labels=[3], method="zipar-sjd", s=8, window=4, init="above", output_type="tokens")
    assert out.stats["forward_passes"] <= 136
    out = pipe.generate(class_labels=[3], method="zipar-gsd", s=8, window=4, output_type="tokens")  # gets the tokenizer
    assert out.stats["forward_passes"] <= 136 and out.stats["group_size"] == 14
    assert main(["generate", "--method", "zipar", "--opt", "s=8", "--n", "1", "--out", str(tmp_path / "g")]) == 0
    assert json.loads((tmp_path / "g" / "stats.json").read_text())["forward_passes"] == 136


class NoGrid(torch.nn.Module):
    """A model with image tokens but no 2-D layout."""

    num_image_tokens = 16
    grid_size = None


@pytest.mark.parametrize("name", ["zipar", "zipar-sjd", "zipar-mc-sjd", "zipar-tree", "zipar-gsd", "pjd", "wavefront"])
def test_a_model_without_a_grid_is_refused(name):
    with pytest.raises(VisarError, match="2-D token grid"):
        get_method(name).fn(Request(NoGrid(), torch.tensor([0]), SamplingParams(), make_generators(1, 0)))


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("zipar", dict(s=0), "s \\(the ZipAR window"),
        ("zipar", dict(s=-2), "integer >= 1"),
        ("zipar", dict(s=2.5), "integer >= 1"),
        ("zipar", dict(s=True), "integer >= 1"),
        ("zipar-sjd", dict(s=0), "s \\(the ZipAR window"),
        ("zipar-sjd", dict(window=0), "window must be an integer >= 1"),
        ("zipar-sjd", dict(init="zeros"), "unknown draft initialiser"),
        ("zipar-mc-sjd", dict(coupling="independent"), "unknown coupling"),
        ("zipar-mc-sjd", dict(cross_row="yes"), "cross_row must be true or false"),
        ("zipar-mc-sjd", dict(start_lag=0), "start_lag \\(tokens of the row above"),
        ("pjd", dict(start_lag=2.5), "start_lag \\(.*None: s\\) must be an integer >= 1, got 2.5"),
        ("pjd", dict(s=0), "s \\(the ZipAR window"),
        ("zipar-tree", dict(branch=0), "branch must be an integer >= 1"),
        ("zipar-tree", dict(depth=3), "trees of depth 2"),
        ("zipar-tree", dict(neighbours="below"), "unknown neighbour 'below'"),
        ("zipar-tree", dict(s=0), "s \\(the ZipAR window"),
        ("zipar-tree", dict(window=None), "window must be an integer >= 1"),
        ("zipar-gsd", dict(s=0), "s \\(the ZipAR window"),
        ("zipar-gsd", dict(group_size=0, tokenizer=torch.randn(32, 4)), "group_size must be"),
        ("zipar-gsd", {}, "make the Request with tokenizer="),
        ("wavefront", {}, "known local"),
    ],
)
def test_bad_options(name, options, message):
    model = tiny_llamagen(vocab=32, block_size=16, std=0.3)
    options = dict(options)
    tokenizer = options.pop("tokenizer", None)
    request = Request(model, torch.tensor([0]), SamplingParams(), make_generators(1, 0), tokenizer=tokenizer)
    with pytest.raises(VisarError, match=message):
        get_method(name).fn(request, **options)


def test_vectorised_above_init_equals_the_slot_loop():
    """init="above" copies in one gather per chain link what neighbour_fill copies slot by slot: random
    canvases and slot sets, windows longer than a row (a slot copies the copy made one row up), slots
    in any order, unused slots (-1)."""

    gen = torch.Generator().manual_seed(0)
    chains = 0
    for trial in range(200):
        batch, width, vocab, slots = 3, 4, 8, int(torch.randint(1, 14, (1,), generator=gen))
        size = 4 * width + slots
        canvas = torch.randint(-1, vocab, (batch, size), generator=gen)
        canvas[torch.rand(batch, size, generator=gen) < 0.6] = -1  # mostly unknown
        index = torch.stack([torch.randperm(size, generator=gen)[:slots] for _ in range(batch)])
        if trial % 2:  # in order, as the Jacobi windows feed them
            index = index.sort(1).values
        index[torch.rand(batch, slots, generator=gen) < 0.2] = -1
        canvas.scatter_(1, index.clamp(min=0), torch.where(index >= 0, -1, canvas.gather(1, index.clamp(min=0))))
        state = SimpleNamespace(grid_size=(size // width + 1, width), vocab_size=vocab)
        request = drafts.FillRequest(state, index, torch.rand(batch, slots, generator=gen), canvas)
        fast, loop = drafts.above_init(request), drafts.neighbour_fill(request, True, False)
        assert torch.equal(fast[0], loop[0]) and torch.equal(fast[1], loop[1]), trial
        source = index - width
        chains += int(((index[:, None, :] == source[:, :, None]) & (index[:, None, :] >= 0)).any(-1).sum())
    assert chains > 50  # the case the loop exists for is exercised


def test_consecutive_above_init_equals_the_slot_loop():
    """A window's or a tree's slots lie at committed + 0 .. G - 1 (`FillRequest.consecutive`): the
    forward fill down each column of W (`latest_known_above`) copies what neighbour_fill copies slot by
    slot, with committed tokens, carried drafts and gaps past the commit, G longer than several rows."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(1)
    for trial in range(300):
        batch, width, vocab = 3, int(torch.randint(1, 6, (1,), generator=gen)), 8
        slots = int(torch.randint(1, 20, (1,), generator=gen))
        committed = torch.randint(0, 3 * width, (batch,), generator=gen)
        size = 7 * width + slots
        canvas = torch.randint(0, vocab, (batch, size), generator=gen)
        gaps = (torch.arange(size) >= committed[:, None]) & (torch.rand(batch, size, generator=gen) < 0.6)
        canvas[gaps] = -1  # past the commit: carried drafts at some indices, none at the rest
        index = committed[:, None] + torch.arange(slots)
        state = SimpleNamespace(grid_size=(size // width + 1, width), vocab_size=vocab)
        uniforms = torch.rand(batch, slots, generator=gen)
        fast = drafts.above_init(drafts.FillRequest(state, index, uniforms, canvas, consecutive=True))
        loop = drafts.neighbour_fill(drafts.FillRequest(state, index, uniforms, canvas), True, False)
        assert torch.equal(fast[0], loop[0]) and torch.equal(fast[1], loop[1]), trial
