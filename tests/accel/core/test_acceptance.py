"""Single-position laws of the acceptance rules: every lossless rule outputs exactly p.

As vLLM's rejection-sampler test: draw many samples through the rule with random draft and
target distributions, and compare the empirical law with p by chi-square (>= 10^5 draws each).
"""

import pytest
import torch
from scipy.stats import chisquare

from visar.accel.core.acceptance import (
    SPECULATIVE,
    AcceptanceRule,
    gumbel_coupling,
    keyed_uniforms,
    lossless,
    maximal_coupling,
    ranked_group,
    speculative_accept,
    speculative_residual,
)
from visar.accel.core.sampling import sample_from_probs

DRAWS = 200_000
VOCAB = 8


def random_pair(seed: int, vocab: int = VOCAB, zero_target: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A target with a few zero-probability tokens (as top-k makes) and a draft that differs from it."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.rand(vocab, generator=gen) ** 2
    target[torch.randperm(vocab, generator=gen)[:zero_target]] = 0
    draft = torch.rand(vocab, generator=gen) + 0.05
    return target / target.sum(), draft / draft.sum()


def assert_law(tokens: torch.Tensor, probs: torch.Tensor):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a zero-probability token was drawn"
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * tokens.numel()
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}"
    return pvalue


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def speculative_draws(target, draft, seed, rule=SPECULATIVE):
    gen = torch.Generator().manual_seed(seed)
    draft_tokens = sample_from_probs(draft.expand(DRAWS, -1), torch.rand(DRAWS, generator=gen))
    p, q = target.expand(DRAWS, -1), draft.expand(DRAWS, -1)
    return maximal_coupling(
        p, q, draft_tokens, torch.rand(DRAWS, generator=gen), torch.rand(DRAWS, generator=gen), rule
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_rule_outputs_target_law(seed):
    target, draft = random_pair(seed)
    tokens, accepted = speculative_draws(target, draft, seed + 100)
    assert_law(tokens, target)
    # acceptance rate = 1 - TV(p, q), within 5 standard errors
    rate = 1 - tv(target, draft)
    assert abs(accepted.double().mean().item() - rate) < 5 * (rate * (1 - rate) / DRAWS) ** 0.5


def test_maximal_coupling_collides_as_often_as_possible():
    """P(y = x) = 1 - TV(p, q): the maximal coupling of MC-SJD keeps the old draft that often."""
    target, draft = random_pair(5)
    gen = torch.Generator().manual_seed(6)
    draft_tokens = sample_from_probs(draft.expand(DRAWS, -1), torch.rand(DRAWS, generator=gen))
    tokens, _ = maximal_coupling(
        target.expand(DRAWS, -1),
        draft.expand(DRAWS, -1),
        draft_tokens,
        torch.rand(DRAWS, generator=gen),
        torch.rand(DRAWS, generator=gen),
    )
    assert_law(tokens, target)
    collision = (tokens == draft_tokens).double().mean().item()
    rate = 1 - tv(target, draft)
    assert abs(collision - rate) < 5 * (rate * (1 - rate) / DRAWS) ** 0.5


def test_deterministic_draft_accepts_with_target_probability():
    """A one-hot q (a draft that was not sampled) is accepted with probability p(x) and stays exact."""
    target, _ = random_pair(3)
    x = int(target.argmax())
    one_hot = torch.nn.functional.one_hot(torch.tensor(x), VOCAB).float()
    tokens, accepted = speculative_draws(target, one_hot, 4)
    assert_law(tokens, target)
    assert abs(accepted.double().mean().item() - target[x].item()) < 0.01


def test_residual_is_normalised_positive_part():
    target = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draft = torch.tensor([0.2, 0.5, 0.2, 0.1])
    torch.testing.assert_close(speculative_residual(target, draft), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # p = q: acceptance is certain; the residual is still a distribution (p)
    torch.testing.assert_close(speculative_residual(target, target), target)
    # the accept test needs no division: p(x) = 0 is never accepted, p(x) >= q(x) always is
    accept = speculative_accept(target.expand(3, -1), draft.expand(3, -1), torch.tensor([3, 0, 0]), torch.rand(3))
    assert accept.tolist() == [False, True, True]


def test_gumbel_coupling_law_and_shared_noise_collision():
    """Gumbel-max with keyed noise is exact; two targets sharing the noise agree >= (1 - TV)/(1 + TV)."""
    target, other = random_pair(7)
    keys = torch.arange(DRAWS // 1000)  # 200 images x 1000 positions, so the hash is tested across both
    positions = torch.arange(1000).expand(len(keys), -1)
    noise = keyed_uniforms(keys, positions, purpose=1, size=VOCAB).reshape(DRAWS, VOCAB)
    tokens = gumbel_coupling(target.expand(DRAWS, -1), noise)
    assert_law(tokens, target)
    other_tokens = gumbel_coupling(other.expand(DRAWS, -1), noise)
    assert_law(other_tokens, other)
    distance = tv(target, other)
    collision = (tokens == other_tokens).double().mean().item()
    assert collision >= (1 - distance) / (1 + distance) - 0.01


def test_keyed_uniforms_depend_only_on_key_position_and_purpose():
    a = keyed_uniforms(torch.tensor([5, 9]), torch.tensor([[3, 4], [3, 4]]), purpose=1, size=16)
    b = keyed_uniforms(torch.tensor([9]), torch.tensor([[7, 4]]), purpose=1, size=16)
    torch.testing.assert_close(a[1, 1], b[0, 1])  # same key and position, other batch and window
    assert not torch.equal(a[0, 0], a[1, 0])  # other key
    assert not torch.equal(a[0, 0], a[0, 1])  # other position
    c = keyed_uniforms(torch.tensor([5]), torch.tensor([[3]]), purpose=2, size=16)
    assert not torch.equal(a[0, 0], c[0, 0])  # other purpose
    assert 0 < a.min() and a.max() < 1


def test_lossless_flags():
    for rule in (speculative_accept, speculative_residual, maximal_coupling, gumbel_coupling):
        assert rule.lossless is True
    assert SPECULATIVE.lossless

    @lossless(False)
    def from_target(target_probs, draft_probs):
        return target_probs

    assert not AcceptanceRule(speculative_accept, from_target).lossless


def test_resampling_rejections_from_target_is_detected():
    """Negative control: the Lumina-mGPT 2.0 residual (draw from p after a rejection) fails the same test."""

    @lossless(False)
    def from_target(target_probs, draft_probs):
        return target_probs

    target, draft = random_pair(0)
    tokens, _ = speculative_draws(target, draft, 100, AcceptanceRule(speculative_accept, from_target))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_law(tokens, target)


@pytest.mark.parametrize("vocab, size", [(7, 3), (7, 13), (16, 14), (512, 14), (5, 2)])
def test_ranked_group_is_the_stable_sort_neighbourhood(vocab, size):
    # GSD's group: the ranks around the draft's in p sorted decreasing, ties by id (a stable sort),
    # found without a sort; ties (zeros of top-k, repeated values) and ranks off either end included
    gen = torch.Generator().manual_seed(vocab + size)
    probs = torch.rand(40, vocab, generator=gen)
    probs[probs < 0.3] = 0.0  # many tied zeros
    probs[::3, : vocab // 2] = 0.125  # and tied positive values
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
    index = torch.randint(vocab, (40, 1), generator=gen)
    order = probs.sort(dim=-1, descending=True, stable=True).indices
    index[0], index[1] = order[0, 0], order[1, -1]  # the first and the last rank
    group, in_range = ranked_group(probs, index, size)
    ranks = (order == index).int().argmax(-1, keepdim=True) + torch.arange(size) - size // 2
    expected_in = (ranks >= 0) & (ranks < vocab)
    assert torch.equal(in_range, expected_in)
    assert torch.equal(group[in_range], order.gather(-1, ranks.clamp(0, vocab - 1))[expected_in])
    assert (~expected_in).any() and expected_in.sum() > 40  # both ends of the ranks were exercised
