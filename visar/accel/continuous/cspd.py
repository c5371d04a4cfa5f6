"""Continuous speculative decoding for MAR (CSpD; Wang et al. 2024, arXiv 2411.11925).

Checked against MarkXCloud/CSpD (`spec_decode/spec_decode_runner.py`) for behaviour; written anew.
A draft MAR runs `num_draft` MAR steps; the target then verifies the block in one batched pass and
accepts or replaces each drafted token. Both share the image's order, mask schedule and diffusion
noise (keyed to position and step: the "trajectory alignment"); steps up to `prefill` x num_iter
are the target's own (pre-filling).

What a token is, for the acceptance test: its denoising trajectory tau = (x_T, ..., x_1, x_0). The
stochastic steps are Gaussian, the last one (respaced step 0) is a deterministic map x_0 = f(x_1);
so, by a change of variables,

    log p(tau) = log N(x_T; 0, I) + sum_{i >= 1} log N(x_{i-1}; mu_p(x_i), t^2 sigma_p^2(x_i))
                 - log |det J_{f_p}(x_1^p)|,   x_1^p = f_p^{-1}(x_0),

and the same for the draft q (x_1^q = its own x_1). t is the sampling temperature.

Mode "exact" (default; the target's law exactly):
  - accept the draft's tau with probability min(1, p(tau) / q(tau)) (`accept_probability`);
  - otherwise draw from the residual max(0, p - q) by acceptance-rejection with bound M = 1:
    propose tau' ~ p (a fresh target chain), accept with probability max(0, 1 - q(tau')/p(tau'))
    (`residual_accept_probability`) until one is accepted. Given a rejection, a proposal is
    accepted with probability Z = TV(p, q), the probability of that rejection, so the expected
    number of proposals per token is Z * 1/Z = 1, however close the draft is. `max_tries=K`
    bounds the tries instead: a token whose K tries all fail is a fresh target draw (never a zero
    vector), which makes the law p - a^K (a p - min(p, q)) (a = the draft's acceptance rate): off
    by at most 1/(e K) in total variation, so a bounded run is labelled lossy;
  - tokens of later draft steps, which were conditioned on a rejected token, are discarded
    and drafted again;
  - the target verifies draft step j with a row that sees the drafts of steps < j, so each token is
    tested against the distribution plain target sampling would use.
Mode "relaxed" (lossy, upstream's heuristic): the Gaussian exponents are divided by
`inner_temperature`^2 (upstream: 42) in both densities, which accepts far more drafts; its
residual sampler keeps upstream's bound of 100 tries (unbounded, the tempered residual would
almost never accept), then a target draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.diffusion import diffusion_step
from ..core.checks import check_choice, check_number
from ..core.method_registry import Request, register_method
from ..core.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE
from ..core.stats import DecodeLog
from .mar import (
    MaskSchedule,
    PositionNoise,
    chain_output,
    check_loop,
    check_params,
    condition_pass,
    draw_orders,
    head_output,
    predicted_positions,
    sample_step,
)

LOG_2PI = math.log(2 * math.pi)


# -- the acceptance rules (pure) -----------------------------------------------------------------


def accept_probability(log_p: Tensor, log_q: Tensor) -> Tensor:
    """P(accept a draft tau ~ q) = min(1, p(tau) / q(tau)). Lossless with the residual below."""
    return torch.exp((log_p - log_q).clamp(max=0))


def residual_accept_probability(log_p: Tensor, log_q: Tensor) -> Tensor:
    """For tau' ~ p: accept as a draw of the residual max(0, p - q) / Z with probability
    max(0, p - q)(tau') / (M p(tau')) = max(0, 1 - q(tau')/p(tau')), M = 1 (residual <= p)."""
    return (1 - torch.exp((log_q - log_p).clamp(max=0))).clamp(min=0)


def gaussian_log_density(x: Tensor, mean: Tensor, log_variance: Tensor, inner_temperature: float = 1.0) -> Tensor:
    """sum over the last dim of log N(x; mean, exp(log_variance)); inner_temperature > 1 flattens
    the exponent (the relaxed mode's heuristic; 1 is the true density)."""
    squared = (x - mean) ** 2 * torch.exp(-log_variance) / inner_temperature**2
    return -0.5 * (squared + log_variance + LOG_2PI).sum(-1)


# -- one model's chain on a set of tokens ----------------------------------------------------------


class TokenHead:
    """The reverse chain of one model on N tokens: transition(x, step) for token rows, and the
    final deterministic map f(x_1) (respaced step 0) with its inverse and Jacobian."""

    def __init__(self, transition, chain=None):
        self.transition = transition  # (x [M, C], step [M], rows [M]) -> (mean, log_variance)
        # rows [M] -> step(x [M, C], i) -> (mean, log_variance): the transition along one chain of
        # fixed rows (a model's head embeds the rows' conditions once); default: transition itself
        self.chain = chain or self.stepwise_chain

    def stepwise_chain(self, rows: Tensor):
        return lambda x, i: self.transition(x, torch.full_like(rows, i), rows)

    def final(self, x1: Tensor, rows: Tensor) -> Tensor:
        return self.transition(x1, torch.zeros_like(rows), rows)[0]

    def inverse_final(self, x0: Tensor, rows: Tensor, iterations: int = 50) -> Tensor:
        """x_1 with f(x_1) = x_0. f is a small perturbation of a scaling (x_0 = a x_1 - b eps,
        b about 6e-3 at 100 steps), so the fixed point x_1 <- x_1 + (x_0 - f(x_1)) / a converges
        fast: it stops once a step moves no coordinate by more than float32 resolution (a few
        iterations in practice, each one call of the head), or after `iterations`."""
        zero = torch.zeros_like(x0)
        scale = self.final(torch.ones_like(x0), rows) - self.final(zero, rows)  # a up to the eps term
        scale = torch.where(scale.abs() > 0.5, scale, torch.ones_like(scale))
        tolerance = 2 * torch.finfo(x0.dtype).eps * (1 + x0.abs())
        x1 = x0.clone()
        for _ in range(iterations):
            update = (x0 - self.final(x1, rows)) / scale
            x1 = x1 + update
            if bool((update.abs() <= tolerance).all()):
                break
        return x1

    def final_log_det(self, x1: Tensor, rows: Tensor) -> Tensor:
        """log |det df/dx_1| per token [N]. The head acts on each token alone, so the C rows of every
        token's Jacobian come from one pass over C copies of the tokens (copy c backpropagates
        output channel c) and one backward."""
        count, channels = x1.shape
        with torch.enable_grad():
            x = x1.detach().repeat(channels, 1).requires_grad_(True)  # copy c = rows c*N .. c*N + N - 1
            out = self.final(x, rows.repeat(channels)).reshape(channels, count, channels)
            picked = out.diagonal(dim1=0, dim2=2)  # [N, C]: output channel c of copy c
            (grad,) = torch.autograd.grad(picked.sum(), x)
        jacobian = grad.reshape(channels, count, channels).transpose(0, 1)  # [N, C (output), C (input)]
        return torch.linalg.slogdet(jacobian.double())[1].float()

    def log_trajectory(
        self, path: Tensor, x0: Tensor, rows: Tensor, temperature: float, inner_temperature: float, own: bool
    ) -> Tensor:
        """log density [N] of the trajectory (path[T-1] = x_T, ..., path[1], x_0) under this model.
        path [T, N, C]: path[i] is the input of step i. own: path[0] is this model's own x_1 (else
        it is recovered from x_0 by inverting this model's final map)."""
        steps, count = path.shape[:2]
        x1 = path[0] if own else self.inverse_final(x0, rows)
        states = torch.cat([x1[None], path[1:]]) if steps > 1 else x1[None]
        log_density = gaussian_log_density(states[-1], torch.zeros_like(x0), torch.zeros_like(x0))
        if steps > 1:
            inputs = states[1:].reshape(-1, x0.shape[1])
            step = torch.arange(1, steps, device=x0.device).repeat_interleave(count)
            mean, log_variance = self.transition(inputs, step, rows.repeat(steps - 1))
            log_variance = log_variance + 2 * math.log(temperature)
            outputs = states[:-1].reshape(-1, x0.shape[1])
            per_step = gaussian_log_density(outputs, mean, log_variance, inner_temperature).reshape(steps - 1, count)
            log_density = log_density + per_step.sum(0)
        return log_density - self.final_log_det(x1, rows)

    def sample(self, start: Tensor, rows: Tensor, temperature: float, noise: Tensor):
        """A fresh chain from start [N, C] with step noise [T, N, C] -> (path [T, N, C], x_0)."""
        x, path, step_of = start, [], self.chain(rows)
        for i in reversed(range(noise.shape[0])):
            path.append(x)
            mean, log_variance = step_of(x, i)
            x = mean + float(i != 0) * torch.exp(0.5 * log_variance) * noise[i] * temperature
        return torch.stack(path[::-1]), x


def residual_proposals(target, draft, rows, index, n, temperatures, draw_uniform, draw_normal):
    """n proposals from the target for each pending token `index` [P], each tested against the
    residual -> (ok [P, n] bool, the proposals' outputs x0 [P * n, C])."""
    temperature, inner = temperatures
    noise = draw_normal(n, index)  # [P, n, T + 1, C]
    prop_rows = rows[index].repeat_interleave(n)
    start = noise[:, :, -1].reshape(-1, noise.shape[-1])
    step_noise = noise[:, :, :-1].reshape(-1, noise.shape[2] - 1, noise.shape[-1]).transpose(0, 1)
    path, x0 = target.sample(start, prop_rows, temperature, step_noise)
    log_p_prop = target.log_trajectory(path, x0, prop_rows, temperature, inner, own=True)
    log_q_prop = draft.log_trajectory(path, x0, prop_rows, temperature, inner, own=False)
    uniform = draw_uniform(n, index).reshape(-1)
    return (uniform < residual_accept_probability(log_p_prop, log_q_prop)).reshape(len(index), n), x0


def speculate(
    target: TokenHead,
    draft: TokenHead,
    rows: Tensor,
    draft_path: Tensor,
    draft_x0: Tensor,
    temperature: float,
    draw_uniform,
    draw_normal,
    *,
    mode: str = "exact",
    inner_temperature: float = 42.0,
    max_tries: int | None = None,
    proposals_per_round: int = 8,
    needs_residual=None,
):
    """Verify N drafted tokens (trajectories draft_path [T, N, C], outputs draft_x0 [N, C]) and replace
    the rejected ones -> (tokens [N, C], accepted [N] bool, residual_tries [N]).

    draw_uniform(n, index) -> [P, n]; draw_normal(n, index) -> [P, n, T + 1, C] (step noise, then the
    start, per proposal), for the tokens `index` [P] only, each from its own image's generator (so
    an image's draws do not depend on the rest of the batch). needs_residual(accepted) -> [N] bool:
    the rejected tokens the caller keeps (default: every rejected one); the others keep their
    draft value and the residual sampler skips them (cspd discards an image's steps after its
    first rejection, so their residual draws would be wasted).
    """
    inner = 1.0 if mode == "exact" else inner_temperature
    log_q = draft.log_trajectory(draft_path, draft_x0, rows, temperature, inner, own=True)
    log_p = target.log_trajectory(draft_path, draft_x0, rows, temperature, inner, own=False)
    everyone = torch.arange(len(rows), device=rows.device)
    accepted = draw_uniform(1, everyone)[:, 0] < accept_probability(log_p, log_q)
    tokens = draft_x0.clone()
    tries = torch.zeros(len(rows), dtype=torch.long, device=rows.device)
    pending = ~accepted if needs_residual is None else needs_residual(accepted) & ~accepted
    done_tries = 0
    while bool(pending.any()) and (max_tries is None or done_tries < max_tries):
        # proposals_per_round proposals at once for every pending token; the first accepted one
        # wins (the same law as trying them one after another).
        n = proposals_per_round if max_tries is None else min(proposals_per_round, max_tries - done_tries)
        index = pending.nonzero().squeeze(1)
        ok, x0 = residual_proposals(target, draft, rows, index, n, (temperature, inner), draw_uniform, draw_normal)
        first = torch.where(ok.any(1), ok.float().argmax(1), n)
        tries[index] += torch.where(ok.any(1), first + 1, torch.full_like(first, n))
        won = ok.any(1)
        chosen = x0.reshape(len(index), n, -1)[torch.arange(len(index), device=rows.device), first.clamp(max=n - 1)]
        tokens[index[won]] = chosen[won]
        pending[index[won]] = False
        done_tries += n
    if bool(pending.any()):  # every bounded try failed: a fresh exact draw from the target
        index = pending.nonzero().squeeze(1)
        noise = draw_normal(1, index)[:, 0]
        _, x0 = target.sample(noise[:, -1], rows[index], temperature, noise[:, :-1].transpose(0, 1))
        tokens[index] = x0
    return tokens, accepted, tries


def first_rejections(block: Tensor, images: Tensor, token_step: Tensor, accepted: Tensor) -> Tensor:
    """Each image's first rejected draft step [B] (block[b], the steps it drafted, where none is),
    from the outcomes of its drafted tokens (image, draft step)."""
    first = block.clone()
    rejected = ~accepted
    return first.scatter_reduce_(0, images[rejected], token_step[rejected], reduce="amin")


def residuals_kept(block: Tensor, images: Tensor, token_step: Tensor):
    """speculate's needs_residual for cspd: only the tokens of each image's first rejected step are
    kept (the steps after it are discarded), so only their rejections need a residual draw."""
    return lambda accepted: token_step == first_rejections(block, images, token_step, accepted)[images]


RELAXED_MAX_TRIES = 100  # MarkXCloud/CSpD's bound on residual tries


# -- the pieces of the method ----------------------------------------------------------------------


def is_exact(options: dict, model) -> bool:
    # a bounded residual sampler is off by <= 1/(e K) in TV; relaxed mode is always bounded
    return options.get("mode") == "exact" and options.get("max_tries") is None


def check_pair(target, draft):
    """One clear error for a draft whose tokens mean something else than the target's."""
    if getattr(draft, "model_kind", None) != "continuous":
        raise VisarError("cspd needs a continuous-token draft model (a MAR) of the target's family")
    mismatches = [
        f"{what}: target {getattr(target, what)}, draft {getattr(draft, what)}"
        for what in ("grid_size", "token_dim", "num_image_tokens")
        if getattr(target, what) != getattr(draft, what)
    ]
    if mismatches:
        raise VisarError(
            "the draft's tokens do not fit the target's (token grid, order or token width differ: "
            + "; ".join(mismatches)
            + "): they cannot share orders and noise"
        )
    if target.condition_layout.num_classes != draft.condition_layout.num_classes:
        raise VisarError("the draft and the target have different class sets")


def model_head(model, constants, z: Tensor, z_null: Tensor | None, guidance: Tensor) -> TokenHead:
    """One model's chain for tokens with conditions z [N, Dz] (and z_null) and guidance [N]."""

    def transition(x, step, rows):
        out = head_output(model, constants, x, step, z[rows], None if z_null is None else z_null[rows], guidance[rows])
        mean, log_variance, _ = diffusion_step(constants, step, x, out)
        return mean, log_variance

    def chain(rows):
        head = chain_output(model, constants, z[rows], None if z_null is None else z_null[rows], guidance[rows])

        def step(x, i):
            mean, log_variance, _ = diffusion_step(constants, torch.full_like(rows, i), x, head(x, i))
            return mean, log_variance

        return step

    return TokenHead(transition, chain)


class ImageDraws:
    """Per-token draws from each token's own image generator, so results do not depend on the batch."""

    def __init__(self, generators, images: Tensor, steps: int, channels: int, device):
        self.generators, self.images, self.steps, self.channels, self.device = (
            generators,
            images,
            steps,
            channels,
            device,
        )

    def _each(self, index, make):
        out = [make(self.generators[image]) for image in self.images[index].tolist()]
        return torch.stack(out).to(self.device)

    def uniform(self, n, index):
        return self._each(index, lambda g: torch.rand(n, generator=g, device=g.device))

    def normal(self, n, index):
        return self._each(index, lambda g: torch.randn(n, self.steps + 1, self.channels, generator=g, device=g.device))


@dataclass(frozen=True)
class ConditionedModel:
    """A MAR with the batch's condition embedding and, when guided, the null one (else None)."""

    model: object
    cond: Tensor
    null: Tensor | None

    @classmethod
    def embed(cls, model, cond: Tensor, guided: bool) -> ConditionedModel:
        return cls(model, model.embed_condition(cond), model.null_embedding(cond.shape[0]) if guided else None)

    def features(self, tokens: Tensor, visible: Tensor, images: Tensor | None = None):
        """The transformer pass over rows of the images `images` [R] (default: the batch) -> (z, z_null)."""
        cond, null = self.cond, self.null
        if images is not None:
            cond, null = cond[images], None if null is None else null[images]
        return condition_pass(self.model, tokens, visible, cond, null, null is not None)


@dataclass(frozen=True)
class SharedSampling:
    """What the draft and the target share, so that their trajectories align: each image's order,
    the mask schedule and its CFG scales, the diffusion schedule, the noise keyed to (position, step)
    and the temperature."""

    orders: Tensor  # [B, L]
    schedule: MaskSchedule
    guidance: Tensor  # [num_iter]: the CFG scale of each MAR step
    constants: dict
    noise: PositionNoise
    temperature: float

    def reveal(self, steps: Tensor, active: Tensor) -> Tensor:
        """[B, L] bool: the positions image b reveals at its MAR step steps[b] (none where not active)."""
        return predicted_positions(self.orders, self.schedule, steps, active)

    def guidance_at(self, steps: Tensor) -> Tensor:
        return self.guidance[steps.clamp(max=len(self.guidance) - 1)]

    def denoise(self, model, tokens, z, z_null, reveal, steps, record=False):
        """sample_step: the tokens `reveal` marks, image b at the CFG scale of its MAR step steps[b]."""
        guidance = self.guidance_at(steps)
        return sample_step(
            model, self.constants, tokens, z, z_null, reveal, guidance, self.temperature, self.noise, record=record
        )


@dataclass(frozen=True)
class DraftedTokens:
    """The tokens of one draft block, in draft-step, then (image, position) order."""

    images: Tensor  # [N]
    positions: Tensor  # [N]
    step: Tensor  # [N]: the draft step j (0 .. block - 1) that drafted the token
    path: Tensor  # [T, N, C]: the draft's trajectory; path[i] is the input of diffusion step i
    x0: Tensor  # [N, C]: the drafted token
    z: Tensor  # [N, Dz]: the draft's conditions of the token
    z_null: Tensor | None  # [N, Dz] when guided

    @staticmethod
    def cat(parts: list[DraftedTokens]) -> DraftedTokens:
        return DraftedTokens(
            images=torch.cat([part.images for part in parts]),
            positions=torch.cat([part.positions for part in parts]),
            step=torch.cat([part.step for part in parts]),
            path=torch.cat([part.path for part in parts], dim=1),
            x0=torch.cat([part.x0 for part in parts]),
            z=torch.cat([part.z for part in parts]),
            z_null=None if parts[0].z_null is None else torch.cat([part.z_null for part in parts]),
        )


def propose(drafter: ConditionedModel, shared: SharedSampling, tokens, visible, step_of, block):
    """The draft's block: pass j runs MAR step step_of[b] + j of every image b with j < block[b] and
    sees the drafts of the passes before it -> (DraftedTokens, draft tokens [B, L, C], each pass's
    reveal [B, L]). Every pass drafts a token: MaskSchedule reveals at least one per step."""
    draft_tokens, draft_visible = tokens.clone(), visible.clone()
    parts, reveals = [], []
    for j in range(int(block.max())):
        z, z_null = drafter.features(draft_tokens, draft_visible)
        reveal = shared.reveal(step_of + j, j < block)
        record = shared.denoise(drafter.model, draft_tokens, z, z_null, reveal, step_of + j, record=True)
        draft_visible |= reveal
        reveals.append(reveal)
        if record is not None:
            images, positions, (x0, path, _means, _log_variances) = record
            z_null_drafted = None if z_null is None else z_null[images, positions]
            step = torch.full_like(images, j)
            parts.append(DraftedTokens(images, positions, step, path, x0, z[images, positions], z_null_drafted))
    return DraftedTokens.cat(parts), draft_tokens, reveals


def score(target: ConditionedModel, drafted: DraftedTokens, draft_tokens, visible, reveals, block):
    """The target's one pass over a draft block: a row per (image b, draft step j < block[b]) that
    sees the committed tokens and b's drafts of steps < j, as plain target step j would -> the
    target's conditions (z [N, Dz], z_null) of each drafted token."""
    row_step, row_image = torch.stack([j < block for j in range(len(reveals))]).nonzero(as_tuple=True)
    seen = [visible]  # seen[j]: the committed tokens and the drafts of steps < j
    for reveal in reveals[:-1]:
        seen.append(seen[-1] | reveal)
    row_visible = torch.stack(seen)[row_step, row_image]
    z, z_null = target.features(draft_tokens[row_image], row_visible, row_image)
    row_of = torch.zeros(len(reveals), len(block), dtype=torch.long, device=block.device)  # [J, B]
    row_of[row_step, row_image] = torch.arange(len(row_step), device=block.device)
    rows = row_of[drafted.step, drafted.images]
    return z[rows, drafted.positions], None if z_null is None else z_null[rows, drafted.positions]


def verify(target, drafter, shared, drafted, target_z, step_of, block, generators, **acceptance):
    """`speculate` on every drafted token, the steps after an image's first rejection left out of
    the residual sampling -> (tokens [N, C], accepted [N] bool, each image's first rejected step [B]
    (block[b] where none is)). acceptance: speculate's mode, inner_temperature and max_tries."""
    model, images, token_step = target.model, drafted.images, drafted.step
    guidance = shared.guidance_at(step_of[images] + token_step)
    target_head = model_head(model, shared.constants, *target_z, guidance)
    draft_head = model_head(drafter.model, shared.constants, drafted.z, drafted.z_null, guidance)
    draws = ImageDraws(generators, images, shared.noise.num_steps, model.token_dim, model.device)
    tokens, accepted, _ = speculate(
        target_head,
        draft_head,
        torch.arange(len(images), device=model.device),
        drafted.path,
        drafted.x0,
        shared.temperature,
        draws.uniform,
        draws.normal,
        needs_residual=residuals_kept(block, images, token_step),
        **acceptance,
    )
    return tokens, accepted, first_rejections(block, images, token_step, accepted)


def commit(tokens, visible, log: DecodeLog, drafted, verified, accepted, first_reject, forward_pass: int):
    """Write each image's tokens of its draft steps up to its first rejected one (inclusive) into
    tokens and visible, the verified tokens (the draft's or a residual draw), and log them."""
    kept = drafted.step <= first_reject[drafted.images]
    images, positions = drafted.images[kept], drafted.positions[kept]
    tokens[images, positions] = verified[kept]
    visible[images, positions] = True
    log.drafts(drafted.positions[None], drafted.step[None], kept[None], (accepted & kept)[None])
    committed = torch.zeros_like(visible)
    committed[images, positions] = True
    log.commit(torch.arange(visible.shape[1], device=visible.device).expand_as(visible), committed, forward_pass)


def target_steps(target: ConditionedModel, shared: SharedSampling, tokens, visible, step_of, log, steps: int) -> int:
    """Run `steps` MAR steps of the target alone (in place) -> its forward passes."""
    every = torch.arange(visible.shape[1], device=visible.device).expand_as(visible)
    everyone = torch.ones_like(visible[:, 0])
    for forward_pass in range(1, steps + 1):
        reveal = shared.reveal(step_of, everyone)
        shared.denoise(target.model, tokens, *target.features(tokens, visible), reveal, step_of)
        visible |= reveal
        log.count_pass(everyone)
        log.commit(every, reveal, forward_pass)
        step_of += 1
    return steps


def check_options(model, draft, num_draft, prefill, mode, inner_temperature, max_tries) -> int | None:
    """cspd's own options, checked before anything runs -> max_tries (relaxed mode: bounded)."""
    if draft is None:
        raise VisarError("cspd needs draft= (a smaller MAR of the same family: name, folder, pipeline or model)")
    check_choice("cspd mode", mode, ("exact", "relaxed"))
    check_number("num_draft", num_draft, 1, maximum=model.num_image_tokens, integer=True)
    check_number("max_tries", max_tries, 1, integer=True, allow_none=True)
    check_number("prefill", prefill, 0, maximum=1)
    check_number("inner_temperature", inner_temperature, MIN_TEMPERATURE, maximum=MAX_TEMPERATURE)
    check_pair(model, draft)
    # The tempered residual accepts almost nothing, so it must be bounded: upstream's 100 tries.
    return RELAXED_MAX_TRIES if max_tries is None and mode == "relaxed" else max_tries


# -- the method ------------------------------------------------------------------------------------


@torch.no_grad()
@register_method(
    "cspd",
    lossless=False,
    description="continuous speculative decoding (Wang et al. 2024): a draft MAR (draft=) drafts num_draft steps, "
    "the target verifies them in one pass; mode 'exact' keeps the target's law (max_tries=K bounds the residual "
    "sampler at up to 1/(e K) in TV), 'relaxed' is upstream's lossy inner temperature",
    model_kind="continuous",
    needs_draft=True,
    exact_when=is_exact,
    exact_when_text="mode='exact' and max_tries=None (the default: an unbounded residual sampler)",
    exact_example={"mode": "exact"},
)
def cspd(
    request: Request,
    *,
    draft=None,
    num_iter: int | None = None,
    num_diffusion_steps: int | None = None,
    cfg_schedule: str = "linear",
    num_draft: int = 4,
    prefill: float = 0.15,
    mode: str = "exact",
    inner_temperature: float = 42.0,
    max_tries: int | None = None,
):
    """CSpD: `draft` (a MAR) drafts num_draft steps, the target verifies them in one batched pass."""
    model, cond, params, generators = request.model, request.cond, request.params, request.generators
    check_params(params)
    num_iter = check_loop(model, num_iter, num_diffusion_steps, cfg_schedule)
    max_tries = check_options(model, draft, num_draft, prefill, mode, inner_temperature, max_tries)
    batch, num_tokens, device, guided = cond.shape[0], model.num_image_tokens, model.device, params.guidance_scale != 1
    schedule = MaskSchedule.cosine(num_tokens, num_iter, params.guidance_scale, cfg_schedule)
    # One diffusion schedule for both, the target's (its respacing, e.g. "ddim25", not an even spacing
    # of as many steps): trajectory alignment compares the two heads step for step.
    diffusion = model.diffusion_schedule(num_diffusion_steps)
    orders = draw_orders(generators, num_tokens, device)
    noise = PositionNoise(generators, num_tokens, diffusion.num_steps, model.token_dim, device)
    guidance = torch.tensor(schedule.guidance, device=device)
    shared = SharedSampling(orders, schedule, guidance, diffusion.constants(device), noise, params.temperature)
    target, drafter = ConditionedModel.embed(model, cond, guided), ConditionedModel.embed(draft, cond, guided)
    log = DecodeLog(batch, model.grid_size, num_draft, device)
    tokens = torch.zeros(batch, num_tokens, model.token_dim, device=device)
    visible = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
    step_of = torch.zeros(batch, dtype=torch.long, device=device)  # each image's next MAR step
    draft_passes = 0

    # Pre-filling: the first steps are the target's own (drafts there are poor).
    prefill_steps = min(num_iter, math.floor(num_iter * prefill) + 1) if prefill > 0 else 0
    target_passes = target_steps(target, shared, tokens, visible, step_of, log, prefill_steps)
    while bool((step_of < num_iter).any()):
        active = step_of < num_iter
        block = torch.clamp(num_iter - step_of, max=num_draft) * active  # [B]: the steps each image drafts
        # The draft runs block[b] MAR steps of image b (its tokens sample the shared noise).
        drafted, draft_tokens, reveals = propose(drafter, shared, tokens, visible, step_of, block)
        draft_passes += len(reveals)
        # One target pass scores every drafted step j as plain target sampling would (seeing steps < j).
        target_z = score(target, drafted, draft_tokens, visible, reveals, block)
        target_passes += 1
        log.count_pass(active)
        # Accept a drafted trajectory tau ~ q with probability min(1, p(tau) / q(tau)); replace a
        # rejected one by a draw from the residual max(0, p - q). Together: tau ~ p exactly.
        acceptance = dict(mode=mode, inner_temperature=inner_temperature, max_tries=max_tries)
        verified, accepted, first_reject = verify(
            target, drafter, shared, drafted, target_z, step_of, block, generators, **acceptance
        )
        # Later steps were drafted given a rejected token: keep each image's steps up to its first rejection.
        commit(tokens, visible, log, drafted, verified, accepted, first_reject, target_passes)
        step_of += torch.where(first_reject < block, first_reject + 1, block)

    stats = log.stats(target_passes, draft_passes)
    return tokens, {**stats, "num_iter": num_iter, "num_diffusion_steps": diffusion.num_steps, "mode": mode}
