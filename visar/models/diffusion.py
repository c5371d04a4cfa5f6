"""The Gaussian diffusion of continuous-token models (MAR's gen_diffusion): the cosine schedule,
its respacing (`DiffusionSchedule`), and the transition a head output fixes (`diffusion_step`).

A `ContinuousTokenModel` (`visar.models.base`) hands its schedule out through
`diffusion_schedule(steps)`; MAR's plain sampling (`visar/accel/continuous/mar.py`), cspd's verification
(`visar/accel/continuous/cspd.py`) and training (`visar/train/continuous.py`) all turn the head's output into
the transition with `diffusion_step`, so sampling and verification use one formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def cosine_betas(num_steps: int = 1000, max_beta: float = 0.999) -> np.ndarray:
    """The improved-DDPM cosine schedule, float64; beta capped at max_beta (the last step's is)."""

    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array(
        [min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta) for i in range(num_steps)]
    )


def respaced_timesteps(num_timesteps: int, spacing: int | str) -> list[int]:
    """The original steps kept by respacing, as guided-diffusion's `space_timesteps` (which MAR's
    diffusion copies): an int N or a string "N" or "N1,N2,...": per section of equal length, a float
    stride accumulated and rounded by Python's round (half to even); "ddimN": the integer stride
    that gives exactly N steps, from 0 (so the last step is below num_timesteps - 1)."""
    if isinstance(spacing, str) and spacing.startswith("ddim"):
        count = int(spacing[len("ddim") :])
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == count:
                return list(range(0, num_timesteps, stride))
        raise ValueError(f"cannot respace {num_timesteps} diffusion steps to exactly {count} with an integer stride")
    sections = [int(spacing)] if isinstance(spacing, int) else [int(x) for x in str(spacing).split(",")]
    size_per, extra = divmod(num_timesteps, len(sections))
    taken, start = [], 0
    for index, count in enumerate(sections):
        size = size_per + (1 if index < extra else 0)
        if count > size or count < 1:
            raise ValueError(f"cannot respace {size} diffusion steps to {count}")
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        position = 0.0
        for _ in range(count):
            taken.append(start + round(position))
            position += stride
        start += size
    return sorted(set(taken))


@dataclass(frozen=True)
class DiffusionSchedule:
    """A respaced Gaussian diffusion with learned-range variance and eps prediction (MAR's gen_diffusion).

    Constants are float64 (numpy) like upstream and are cast to float32 per use. timestep_map[i]
    is the original timestep the head is called with at respaced step i.
    """

    timestep_map: tuple[int, ...]
    betas: np.ndarray

    @classmethod
    def cosine(cls, spacing: int | str, num_timesteps: int = 1000) -> DiffusionSchedule:
        """The cosine schedule respaced by `spacing` (MAR's num_sampling_steps: "100", "ddim25", ...)."""
        alphas_cumprod = np.cumprod(1.0 - cosine_betas(num_timesteps))
        kept = respaced_timesteps(num_timesteps, spacing)
        betas, last = [], 1.0
        for step in kept:
            betas.append(1 - alphas_cumprod[step] / last)
            last = alphas_cumprod[step]
        return cls(tuple(kept), np.array(betas, dtype=np.float64))

    @property
    def num_steps(self) -> int:
        return len(self.betas)

    def constants(self, device) -> dict[str, Tensor]:
        """The per-step coefficients, float32 tensors [T] on device."""
        betas = self.betas
        alphas_cumprod = np.cumprod(1.0 - betas)
        prev = np.append(1.0, alphas_cumprod[:-1])
        posterior_variance = betas * (1.0 - prev) / (1.0 - alphas_cumprod)
        # The posterior variance is 0 at step 0: its log is clipped to step 1's (upstream's choice).
        clipped = posterior_variance[1] if len(betas) > 1 else betas[0]
        values = {
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod - 1),
            "posterior_log_variance_clipped": np.log(np.append(clipped, posterior_variance[1:])),
            "log_betas": np.log(betas),
            "posterior_mean_coef1": betas * np.sqrt(prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - prev) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
            "timestep_map": np.array(self.timestep_map),
        }
        out = {k: torch.from_numpy(v).to(device).float() for k, v in values.items()}
        out["timestep_map"] = out["timestep_map"].long()
        return out


def diffusion_step(constants: dict[str, Tensor], step: Tensor, x: Tensor, head_out: Tensor):
    """The Gaussian transition of respaced step `step` ([N] long) from x [N, C], given the head's
    output [N, 2C] = [eps | v] -> (mean, log_variance, pred_xstart), each [N, C].

    x0 = sqrt(1/abar) x - sqrt(1/abar - 1) eps (no clipping); mean = the posterior mean at x0;
    log var = frac log beta + (1 - frac) log(clipped posterior variance), frac = (v + 1) / 2.
    """
    eps, values = head_out.chunk(2, dim=-1)

    def at(name):
        return constants[name][step][:, None]

    frac = (values + 1) / 2
    log_variance = frac * at("log_betas") + (1 - frac) * at("posterior_log_variance_clipped")
    pred_xstart = at("sqrt_recip_alphas_cumprod") * x - at("sqrt_recipm1_alphas_cumprod") * eps
    mean = at("posterior_mean_coef1") * pred_xstart + at("posterior_mean_coef2") * x
    return mean, log_variance, pred_xstart
