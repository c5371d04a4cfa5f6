"""MAR's sampling loop (Li et al. 2024, LTH14/mar `sample_tokens` @ fe470ac), for any ContinuousTokenModel.

One random order per image; step s of num_iter reveals the positions that leave the mask, whose
length is floor(L cos(pi/2 (s+1)/num_iter)) clamped to [1, masked - 1] (all remaining at the last
step); each revealed token is denoised by the diffusion head from Gaussian noise. Guidance acts on
the head's eps (the variance stays the class's), with Muse's linear ramp
1 + (cfg - 1)(L - mask_len)/L or a constant; temperature scales the noise of every step.

Randomness: upstream draws from one global stream in batch order; here each image draws its order
and then all its noise ([L, T + 1, C], keyed to position and diffusion step) from its own
generator, so an image does not depend on its batch and drafts can share the target's noise
(CSpD's trajectory alignment). `BatchNoise` replays upstream's stream for the fixtures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import BlockReuse
from ...models.diffusion import diffusion_step
from ..core.checks import check_choice, check_number
from ..core.method_registry import Request, register_method
from ..core.stats import DecodeLog


@dataclass(frozen=True)
class MaskSchedule:
    """Per step s: masked_before[s] tokens are masked when step s starts, masked_after[s] after it;
    the positions order[masked_after : masked_before] are revealed; guidance[s] is the CFG scale."""

    masked_before: tuple[int, ...]
    masked_after: tuple[int, ...]
    guidance: tuple[float, ...]

    @classmethod
    def cosine(cls, num_tokens: int, num_iter: int, cfg: float, cfg_schedule: str) -> MaskSchedule:
        if cfg_schedule not in ("linear", "constant"):
            raise VisarError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")
        if num_iter < 1:
            raise VisarError(f"num_iter must be >= 1, got {num_iter}")
        before, after, guidance, masked = [], [], [], num_tokens
        for step in range(num_iter):
            mask_len = float(np.floor(num_tokens * np.cos(math.pi / 2.0 * (step + 1) / num_iter)))
            mask_len = max(1.0, min(masked - 1.0, mask_len))
            if cfg_schedule == "linear":  # upstream computes it in float32
                ramp = torch.tensor(num_tokens, dtype=torch.float32) - torch.tensor(mask_len, dtype=torch.float32)
                guidance.append(float(1 + (cfg - 1) * ramp / num_tokens))
            else:
                guidance.append(float(cfg))
            before.append(masked)
            masked = 0 if step == num_iter - 1 else int(mask_len)
            after.append(masked)
        return cls(tuple(before), tuple(after), tuple(guidance))


class PositionNoise:
    """Each image's diffusion noise, drawn once from its generator and keyed to (position, step):
    table[b, position, T] is the starting noise x_T, table[b, position, i] the noise of step i."""

    def __init__(self, generators, num_tokens: int, num_steps: int, channels: int, device):
        self.table = torch.stack(
            [torch.randn(num_tokens, num_steps + 1, channels, generator=g, device=g.device) for g in generators]
        ).to(device)  # [B, L, T + 1, C]
        self.num_steps = num_steps

    def start(self, rows: Tensor, positions: Tensor) -> Tensor:
        return self.table[rows, positions, self.num_steps]

    def step(self, rows: Tensor, positions: Tensor, step: int) -> Tensor:
        return self.table[rows, positions, step]


class BatchNoise:
    """Upstream's stream (for the fixtures): per AR step one randn(n, C) for the start, then per
    diffusion step randn_like of the (CFG-doubled) batch, of which the first n rows are used."""

    def __init__(self, generator: torch.Generator, channels: int, guided: bool):
        self.generator, self.channels, self.guided = generator, channels, guided

    def start(self, rows: Tensor, positions: Tensor) -> Tensor:
        return torch.randn(len(rows), self.channels, generator=self.generator)

    def step(self, rows: Tensor, positions: Tensor, step: int) -> Tensor:
        n = len(rows)
        return torch.randn(2 * n if self.guided else n, self.channels, generator=self.generator)[:n]


def head_output(model, constants, x: Tensor, step: Tensor, z: Tensor, z_null: Tensor | None, cfg) -> Tensor:
    """The head's [eps | v] at respaced step `step` [N]; with z_null, eps guided as
    eps_null + cfg (eps - eps_null) (cfg a float or [N]), v the class's."""
    timesteps = constants["timestep_map"][step]
    if z_null is None:
        return model.diffusion_head(x, timesteps, z)
    out = model.diffusion_head(torch.cat([x, x]), torch.cat([timesteps, timesteps]), torch.cat([z, z_null]))
    return guided(out, x.shape[-1], cfg)


def guided(out: Tensor, channels: int, cfg) -> Tensor:
    """The head's output on [class rows ; null rows] -> eps guided, v the class's [N, 2C]."""
    cond, null = out.chunk(2)
    scale = cfg[:, None] if isinstance(cfg, Tensor) else cfg
    eps = null[:, :channels] + scale * (cond[:, :channels] - null[:, :channels])
    return torch.cat([eps, cond[:, channels:]], dim=-1)


def chain_output(model, constants, z: Tensor, z_null: Tensor | None, cfg):
    """head_output along reverse chains of fixed tokens (conditions z [N, Dz], z_null, cfg a float or
    [N]): -> head(x [N, C], i), the [eps | v] at respaced step i, through the model's
    diffusion_chain (the conditions and timesteps embedded once, not at every step)."""
    head = model.diffusion_chain(z if z_null is None else torch.cat([z, z_null]), constants["timestep_map"])
    if z_null is None:
        return head
    return lambda x, i: guided(head(torch.cat([x, x]), i), x.shape[-1], cfg)


def denoise(model, constants, start: Tensor, z, z_null, cfg, temperature: float, noise_at, record: bool = False):
    """Run the reverse chain from start [N, C] (x_T) -> x_0 [N, C]. noise_at(i) gives step i's noise.

    With record, also (path, means, log_vars), each [T, N, C], indexed by respaced step i: path[i]
    is the input of step i and (means[i], log_vars[i]) its Gaussian transition.
    """
    x = start
    num_steps = len(constants["timestep_map"])
    head = chain_output(model, constants, z, z_null, cfg)
    path, means, log_vars = [], [], []
    for i in reversed(range(num_steps)):
        step = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        mean, log_variance, _ = diffusion_step(constants, step, x, head(x, i))
        noise = noise_at(i)
        if record:
            path.append(x)
            means.append(mean)
            log_vars.append(log_variance)
        # Upstream draws noise at every step; at step 0 it is multiplied by 0.
        x = mean + float(i != 0) * torch.exp(0.5 * log_variance) * noise * temperature
    if record:
        # lists run over steps T-1 .. 0; flip so index i is step i
        return x, torch.stack(path[::-1]), torch.stack(means[::-1]), torch.stack(log_vars[::-1])
    return x


def predicted_positions(orders: Tensor, schedule: MaskSchedule, steps: Tensor, active: Tensor) -> Tensor:
    """[B, L] bool: the positions image b reveals at its step steps[b] (none where not active)."""
    num_tokens = orders.shape[1]
    before = torch.tensor(schedule.masked_before, device=orders.device)[
        steps.clamp(max=len(schedule.masked_before) - 1)
    ]
    after = torch.tensor(schedule.masked_after, device=orders.device)[steps.clamp(max=len(schedule.masked_after) - 1)]
    rank = torch.empty_like(orders)
    rank.scatter_(1, orders, torch.arange(num_tokens, device=orders.device).expand_as(orders))  # rank[b, pos]
    return (rank >= after[:, None]) & (rank < before[:, None]) & active[:, None]


def condition_pass(model, tokens, visible, cond_embedding, null_embedding, guided: bool, reuse=None):
    """The transformer pass: z [B, L, Dz] and, when guided, z_null (None otherwise)."""
    if not guided:
        return model.condition_features(tokens, visible, cond_embedding, reuse), None
    z = model.condition_features(
        torch.cat([tokens, tokens]), torch.cat([visible, visible]), torch.cat([cond_embedding, null_embedding]), reuse
    )
    return z.chunk(2)


def sample_step(model, constants, tokens, z, z_null, reveal, guidance, temperature, noise, record=False):
    """Denoise the tokens `reveal` [B, L] marks, in (image, position) order, into `tokens` (in place).
    guidance [B] per image. Returns the chain record when asked."""
    rows, positions = reveal.nonzero(as_tuple=True)
    if len(rows) == 0:
        return None
    z_rows = z[rows, positions]
    z_null_rows = None if z_null is None else z_null[rows, positions]
    cfg = guidance[rows]
    out = denoise(
        model,
        constants,
        noise.start(rows, positions),
        z_rows,
        z_null_rows,
        cfg,
        temperature,
        lambda i: noise.step(rows, positions, i),
        record=record,
    )
    if record:
        tokens[rows, positions] = out[0]
        return rows, positions, out
    tokens[rows, positions] = out
    return None


def check_params(params):
    if params.top_k is not None or params.top_p != 1.0 or params.entropy_temperature is not None:
        raise VisarError(
            "MAR samples continuous tokens: top_k / top_p / entropy_temperature do not apply (leave them unset)"
        )


def sample_tokens(
    model,
    cond: Tensor,
    *,
    num_iter: int,
    cfg: float,
    cfg_schedule: str,
    temperature: float,
    orders: Tensor,
    noise,
    num_diffusion_steps: int | None = None,
    reuse: BlockReuse | None = None,
    null_interval: int = 1,
    log: DecodeLog | None = None,
) -> Tensor:
    """MAR's loop -> tokens [B, L, C]. orders [B, L]: each image's generation order. reuse /
    null_interval > 1: mar-cache's approximations (None / 1: none)."""
    batch, num_tokens = orders.shape
    schedule = MaskSchedule.cosine(num_tokens, num_iter, cfg, cfg_schedule)
    constants = model.diffusion_schedule(num_diffusion_steps).constants(model.device)
    guided = cfg != 1.0
    tokens = torch.zeros(batch, num_tokens, model.token_dim, device=model.device)
    visible = torch.zeros(batch, num_tokens, dtype=torch.bool, device=model.device)
    cond_embedding = model.embed_condition(cond)
    null_embedding = model.null_embedding(batch) if guided else None
    all_images = torch.ones(batch, dtype=torch.bool, device=model.device)
    null_gap = None  # z - z_null at the last step that ran the null branch
    for step in range(num_iter):
        if guided and null_interval > 1 and step % null_interval != 0 and null_gap is not None:
            # The guidance gap of the condition is stable across nearby steps: skip the null branch.
            z = model.condition_features(tokens, visible, cond_embedding, reuse)
            z_null = z - null_gap
        else:
            z, z_null = condition_pass(model, tokens, visible, cond_embedding, null_embedding, guided, reuse)
            null_gap = None if z_null is None else z - z_null
        steps = torch.full((batch,), step, device=model.device)
        reveal = predicted_positions(orders, schedule, steps, all_images)
        guidance = torch.full((batch,), schedule.guidance[step], device=model.device)
        sample_step(model, constants, tokens, z, z_null, reveal, guidance, temperature, noise)
        visible |= reveal
        if log is not None:
            log.count_pass(all_images)
            log.commit(torch.arange(num_tokens, device=model.device).expand(batch, -1), reveal, step + 1)
    return tokens


DIFFUSION_TIMESTEPS = 1000  # the steps MAR's head is trained on; num_diffusion_steps respaces them


def check_loop(model, num_iter, num_diffusion_steps, cfg_schedule) -> int:
    """MAR's loop options, checked before anything runs -> num_iter (None: the default)."""
    num_tokens = model.num_image_tokens
    check_number("num_iter", num_iter, 1, maximum=num_tokens, integer=True, allow_none=True)
    check_number(
        "num_diffusion_steps", num_diffusion_steps, 1, maximum=DIFFUSION_TIMESTEPS, integer=True, allow_none=True
    )
    check_choice("cfg_schedule", cfg_schedule, ("linear", "constant"))
    return num_iter or default_num_iter(model)


def default_num_iter(model) -> int:
    """Upstream's 64 steps for MAR's 256 tokens, as a quarter of the token count for other grids."""
    return max(1, model.num_image_tokens // 4)


def draw_orders(generators, num_tokens: int, device) -> Tensor:
    """One random order per image, from its own generator (before any of its noise)."""
    return torch.stack([torch.randperm(num_tokens, generator=g, device=g.device) for g in generators]).to(device)


def decode_mar(
    request: Request,
    *,
    num_iter: int,
    num_diffusion_steps: int | None,
    cfg_schedule: str,
    reuse: BlockReuse | None = None,
    null_interval: int = 1,
) -> tuple[Tensor, dict]:
    """MAR's loop over the request's images, each drawing its order and then all its noise from its
    own generator -> (tokens [B, L, C], stats). reuse / null_interval: as `sample_tokens`."""
    model, cond, params, generators = request.model, request.cond, request.params, request.generators
    batch, num_tokens = cond.shape[0], model.num_image_tokens
    steps = model.diffusion_schedule(num_diffusion_steps).num_steps
    orders = draw_orders(generators, num_tokens, model.device)
    noise = PositionNoise(generators, num_tokens, steps, model.token_dim, model.device)
    log = DecodeLog(batch, model.grid_size, 0, model.device)
    tokens = sample_tokens(
        model,
        cond,
        num_iter=num_iter,
        cfg=params.guidance_scale,
        cfg_schedule=cfg_schedule,
        temperature=params.temperature,
        orders=orders,
        noise=noise,
        num_diffusion_steps=num_diffusion_steps,
        reuse=reuse,
        null_interval=null_interval,
        log=log,
    )
    return tokens, {**log.stats(num_iter), "num_iter": num_iter, "num_diffusion_steps": steps}


@torch.no_grad()
@register_method(
    "mar",
    lossless=True,
    description="plain MAR sampling (Li et al. 2024): random order, cosine mask schedule, diffusion head",
    model_kind="continuous",
)
def mar(
    request: Request,
    *,
    num_iter: int | None = None,
    num_diffusion_steps: int | None = None,
    cfg_schedule: str = "linear",
):
    """Plain MAR sampling (the reference for continuous-token models). num_iter: the mask schedule's
    steps (default a quarter of the tokens: upstream's 64 for 256); num_diffusion_steps: the head's
    (default the model's num_sampling_steps)."""
    check_params(request.params)
    num_iter = check_loop(request.model, num_iter, num_diffusion_steps, cfg_schedule)
    return decode_mar(request, num_iter=num_iter, num_diffusion_steps=num_diffusion_steps, cfg_schedule=cfg_schedule)
