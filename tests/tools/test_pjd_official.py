"""tools/pjd_official.py, PJD's official rules on visar's model interface: its schedule, and its law where
nothing is approximated (rows one after another, the keep rule off: AR's law)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import REPO
from laws import compare_laws, exact_law, sequence_index, tiny_llamagen, tiny_pipeline

from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, make_generators

spec = importlib.util.spec_from_file_location("pjd_official", REPO / "tools" / "pjd_official.py")
pjd_official = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pjd_official)


def test_rows_start_at_the_lag_and_run_two_behind(monkeypatch):
    """An 8 x 8 grid at start lag 3, window 2: after every pass a row that has started had 3 tokens above
    when it did, and a row under an unfinished one stays at least one token behind where the row above
    was (its token (r, c) waited for c + 2 above: lower rows commit accepted drafts only)."""
    model = tiny_llamagen(vocab=8, block_size=64, seed=2, std=0.3)
    seen, verify = [], pjd_official.OfficialRows.verify

    def recorded(self, rows, probs, generator):
        before = list(self.count)
        verify(self, rows, probs, generator)
        seen.append((before, list(self.count), list(self.running)))

    monkeypatch.setattr(pjd_official.OfficialRows, "verify", recorded)
    tokens, passes = pjd_official.official_decode(
        model, torch.tensor(1), SamplingParams(), make_generators(1, 0)[0], start_lag=3, window=2
    )
    assert passes == len(seen) + 1 and tokens.shape == (64,)
    width, started, lagged = 8, set(), 0
    for before, after, running in seen:
        for row in range(1, 8):
            if row in running and row not in started:  # its first pass is the next one
                assert after[row - 1] >= 3 and after[row] == 0
                started.add(row)
            if after[row - 1] < width:
                assert after[row] <= max(before[row - 1] - 1, 0), (row, before, after)
                lagged += after[row] > 0
    assert seen[-1][1] == [width] * 8 and started == set(range(1, 8)) and lagged > 5
    assert passes < 64  # rows overlapped


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_on_lumina_mgpt_greedy_rows_in_turn_give_ar_s_tokens(guidance):
    """The port on the tiny Lumina-mGPT model (its row ends, a left-padded prompt, CFG with its own null
    prompt): at a start lag of W, greedy, every row commits AR's argmax, so the tokens are AR's, in fewer
    passes (drafts accepted); with rows overlapping it decodes the whole grid in fewer passes still."""
    pipe = tiny_pipeline("hf-lumina-mgpt")
    model, width = pipe.model, pipe.model.grid_size[1]
    cond, mask = pipe.condition(prompts=["a red circle"])
    assert not bool(mask.all())  # padding the port must hide
    params = SamplingParams(top_k=1, guidance_scale=guidance)
    ar, stats = get_method("ar").fn(Request(model, cond, params, make_generators(1, 0), mask))
    rows_in_turn = dict(start_lag=width, window=3, cond_mask=mask[0])
    tokens, passes = pjd_official.official_decode(model, cond[0], params, make_generators(1, 0)[0], **rows_in_turn)
    assert torch.equal(tokens, ar[0]) and passes < stats["forward_passes"]
    overlap = dict(start_lag=2, window=2, cond_mask=mask[0])
    tokens, overlapped = pjd_official.official_decode(model, cond[0], params, make_generators(1, 0)[0], **overlap)
    assert tokens.shape == ar[0].shape and int(tokens.max()) < model.vocab_size and overlapped < passes


@pytest.mark.slow  # 4,000 images, one at a time, twice
@pytest.mark.parametrize("residual", ["(p - q)+", "p (negative control)"])
def test_without_the_keep_rule_rows_in_turn_sample_ar_s_law(monkeypatch, residual):
    """Start lag W (rows one after another) and the keep rule off (after a rejection every later slot
    carries a draw from its p, recorded with p): what is left is speculative Jacobi decoding with
    residual draws, which samples AR's law. An exact-law test of the port's acceptance, residual, bonus
    and carried laws on a 3 x 3 grid of 3 codes, window 3; a rejected slot drawing from p instead of
    the residual is detected (p ~ 3e-10, TV 0.090 against a tolerance of 0.074, when written)."""
    monkeypatch.setattr(pjd_official, "KEEP_ABOVE", 1.0)  # min(1, p / q) is never above 1
    if residual != "(p - q)+":
        monkeypatch.setattr(pjd_official, "residual_law", lambda p, q: p)
    model = pjd_official.law_model()
    params = SamplingParams(guidance_scale=1.5)
    generators = make_generators(4000, 0)
    tokens = torch.stack(
        [pjd_official.official_decode(model, torch.tensor(1), params, g, start_lag=3, window=3)[0] for g in generators]
    )
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, 3), exact_law(model, 1, params))
    assert (pvalue > 1e-3 and tv < tolerance) == (residual == "(p - q)+"), (pvalue, tv, tolerance)
