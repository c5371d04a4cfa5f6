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

import torch
from torch import Tensor

from ..errors import VisarError
from ..models.base import diffusion_step
from .checks import check_choice, check_number
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
from .registry import register_method
from .sampling import MAX_TEMPERATURE, MIN_TEMPERATURE
from .stats import DecodeLog

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
        noise = draw_normal(n, index)  # [P, n, T + 1, C]
        prop_rows = rows[index].repeat_interleave(n)
        start = noise[:, :, -1].reshape(-1, noise.shape[-1])
        step_noise = noise[:, :, :-1].reshape(-1, noise.shape[2] - 1, noise.shape[-1]).transpose(0, 1)
        path, x0 = target.sample(start, prop_rows, temperature, step_noise)
        log_p_prop = target.log_trajectory(path, x0, prop_rows, temperature, inner, own=True)
        log_q_prop = draft.log_trajectory(path, x0, prop_rows, temperature, inner, own=False)
        uniform = draw_uniform(n, index).reshape(-1)
        ok = (uniform < residual_accept_probability(log_p_prop, log_q_prop)).reshape(len(index), n)
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


# -- the method ------------------------------------------------------------------------------------


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
    model,
    cond,
    params,
    generators,
    *,
    cond_mask=None,
    progress=False,
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
    check_params(params)
    num_iter = check_loop(model, num_iter, num_diffusion_steps, cfg_schedule)
    if draft is None:
        raise VisarError("cspd needs draft= (a smaller MAR of the same family: name, folder, pipeline or model)")
    check_choice("cspd mode", mode, ("exact", "relaxed"))
    check_number("num_draft", num_draft, 1, maximum=model.num_image_tokens, integer=True)
    check_number("max_tries", max_tries, 1, integer=True, allow_none=True)
    check_number("prefill", prefill, 0, maximum=1)
    check_number("inner_temperature", inner_temperature, MIN_TEMPERATURE, maximum=MAX_TEMPERATURE)
    if max_tries is None and mode == "relaxed":
        # The tempered residual accepts almost nothing, so it must be bounded: upstream's 100 tries.
        max_tries = RELAXED_MAX_TRIES
    check_pair(model, draft)
    batch, num_tokens, device = cond.shape[0], model.num_image_tokens, model.device
    cfg, temperature = params.guidance_scale, params.temperature
    guided = cfg != 1.0
    schedule = MaskSchedule.cosine(num_tokens, num_iter, cfg, cfg_schedule)
    # One schedule for both, the target's (its respacing, e.g. "ddim25", not an even spacing of as
    # many steps): trajectory alignment compares the two heads step for step.
    diffusion = model.diffusion_schedule(num_diffusion_steps)
    steps = diffusion.num_steps
    target_constants = draft_constants = diffusion.constants(device)
    orders = draw_orders(generators, num_tokens, device)
    noise = PositionNoise(generators, num_tokens, steps, model.token_dim, device)
    log = DecodeLog(batch, model.grid_size, num_draft, device)
    guidance_by_step = torch.tensor(schedule.guidance, device=device)

    tokens = torch.zeros(batch, num_tokens, model.token_dim, device=device)
    visible = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
    target_cond, draft_cond = model.embed_condition(cond), draft.embed_condition(cond)
    target_null = model.null_embedding(batch) if guided else None
    draft_null = draft.null_embedding(batch) if guided else None
    every = torch.arange(num_tokens, device=device).expand(batch, -1)
    step_of = torch.zeros(batch, dtype=torch.long, device=device)  # each image's next MAR step
    target_passes = draft_passes = 0

    # Pre-filling: the first steps are the target's own (drafts there are poor).
    prefill_steps = min(num_iter, int(math.floor(num_iter * prefill)) + 1) if prefill > 0 else 0
    for _ in range(prefill_steps):
        active = torch.ones(batch, dtype=torch.bool, device=device)
        z, z_null = condition_pass(model, tokens, visible, target_cond, target_null, guided)
        reveal = predicted_positions(orders, schedule, step_of, active)
        sample_step(model, target_constants, tokens, z, z_null, reveal, guidance_by_step[step_of], temperature, noise)
        visible |= reveal
        target_passes += 1
        log.count_pass(active)
        log.commit(every, reveal, target_passes)
        step_of += 1

    while bool((step_of < num_iter).any()):
        active = step_of < num_iter
        block = torch.clamp(num_iter - step_of, max=num_draft) * active  # draft steps per image
        # Drafting: pass j drafts step step_of + j of every image with j < block.
        draft_tokens, draft_visible = tokens.clone(), visible.clone()
        reveals, records = [], []
        for j in range(int(block.max())):
            in_pass = j < block
            z, z_null = condition_pass(draft, draft_tokens, draft_visible, draft_cond, draft_null, guided)
            reveal = predicted_positions(orders, schedule, step_of + j, in_pass)
            record = sample_step(
                draft,
                draft_constants,
                draft_tokens,
                z,
                z_null,
                reveal,
                guidance_by_step[(step_of + j).clamp(max=num_iter - 1)],
                temperature,
                noise,
                record=True,
            )
            draft_visible |= reveal
            reveals.append(reveal)
            records.append((record, z, z_null))
            draft_passes += 1
        # Verification: one target pass over rows (image, j), row j seeing the drafts of steps < j.
        row_image = torch.cat([torch.nonzero(j < block).squeeze(1) for j in range(len(reveals))])
        row_step = torch.cat([torch.full(((j < block).sum(),), j, device=device) for j in range(len(reveals))])
        seen = visible.clone()
        seen_by_step = []
        for j in range(len(reveals)):
            seen_by_step.append(seen.clone())
            seen |= reveals[j]
        row_visible = torch.stack(
            [seen_by_step[j][b] for b, j in zip(row_image.tolist(), row_step.tolist(), strict=True)]
        )
        z_rows, z_null_rows = condition_pass(
            model,
            draft_tokens[row_image],
            row_visible,
            target_cond[row_image],
            None if target_null is None else target_null[row_image],
            guided,
        )
        target_passes += 1
        log.count_pass(active)
        row_of = {(b, j): r for r, (b, j) in enumerate(zip(row_image.tolist(), row_step.tolist(), strict=True))}
        # Test every drafted token of every step in one call; per image keep the steps up to its first rejection.
        parts = {key: [] for key in ("images", "positions", "step", "path", "x0", "z", "z_null", "dz", "dz_null")}
        for j, (drafted, draft_z, draft_z_null) in enumerate(records):
            if drafted is None:
                continue
            images, positions, (x0, path, _means, _log_vars) = drafted
            token_rows = torch.tensor([row_of[(b, j)] for b in images.tolist()], device=device, dtype=torch.long)
            parts["images"].append(images)
            parts["positions"].append(positions)
            parts["step"].append(torch.full_like(images, j))
            parts["path"].append(path)
            parts["x0"].append(x0)
            parts["z"].append(z_rows[token_rows, positions])
            parts["dz"].append(draft_z[images, positions])
            if guided:
                parts["z_null"].append(z_null_rows[token_rows, positions])
                parts["dz_null"].append(draft_z_null[images, positions])
        if parts["images"]:
            images, positions, token_step = (torch.cat(parts[k]) for k in ("images", "positions", "step"))
            path, x0 = torch.cat(parts["path"], dim=1), torch.cat(parts["x0"])
            guidance = guidance_by_step[(step_of[images] + token_step).clamp(max=num_iter - 1)]
            z_null_all = torch.cat(parts["z_null"]) if guided else None
            dz_null_all = torch.cat(parts["dz_null"]) if guided else None
            target_head = model_head(model, target_constants, torch.cat(parts["z"]), z_null_all, guidance)
            draft_head = model_head(draft, draft_constants, torch.cat(parts["dz"]), dz_null_all, guidance)
            draws = ImageDraws(generators, images, steps, model.token_dim, device)

            new_tokens, accepted, _ = speculate(
                target_head,
                draft_head,
                torch.arange(len(images), device=device),
                path,
                x0,
                temperature,
                draws.uniform,
                draws.normal,
                mode=mode,
                inner_temperature=inner_temperature,
                max_tries=max_tries,
                needs_residual=residuals_kept(block, images, token_step),
            )
            first_reject = first_rejections(block, images, token_step, accepted)
            for j in range(len(records)):
                in_step = token_step == j
                if not bool(in_step.any()):
                    continue
                kept = in_step & (j <= first_reject[images])  # steps after the first rejection are discarded
                tokens[images[kept], positions[kept]] = new_tokens[kept]
                visible[images[kept], positions[kept]] = True
                step_positions = positions[in_step]
                log.drafts(
                    step_positions[None],
                    torch.full_like(step_positions, j)[None],
                    kept[in_step][None],
                    (accepted & kept)[in_step][None],
                )
                reveal = torch.zeros_like(visible)
                reveal[images[kept], positions[kept]] = True
                log.commit(every, reveal, target_passes)
        else:
            first_reject = block.clone()
        step_of = step_of + torch.where(first_reject < block, first_reject + 1, block)

    stats = log.stats(target_passes, draft_passes)
    return tokens, {**stats, "num_iter": num_iter, "num_diffusion_steps": steps, "mode": mode}
