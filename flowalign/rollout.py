"""Rollout: run a sampler over an adapter and keep the whole trajectory for training.

Shapes: B samples, S steps; latents x [B, ...]. The trajectory stores every latent so each SDE
transition can be rescored under the current policy (``rescore_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowalign.samplers.flow_sde import StepOutput, flow_grpo_sde_step, ode_step
from flowalign.samplers.steps import StepPlan
from pipelines.base import Conditioning, Schedule


@dataclass
class Trajectory:
    """latents: float32 [B, S + 1, ...] (x_0 is the initial noise, x_S the sample);
    log_probs: [B, S] (0 at ODE steps); trained: bool [B, S]; noise_levels: η per step [S];
    sigmas [S + 1], timesteps [S] as in the schedule; cond: the conditioning used."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    trained: torch.Tensor
    noise_levels: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    cond: Conditioning

    def __getitem__(self, index) -> "Trajectory":
        """Select samples; the per-step schedule tensors are shared."""
        return Trajectory(self.latents[index], self.log_probs[index], self.trained[index], self.noise_levels,
                          self.sigmas, self.timesteps, self.cond[index])

    @staticmethod
    def cat(parts: list["Trajectory"]) -> "Trajectory":
        first = parts[0]
        return Trajectory(torch.cat([p.latents for p in parts]), torch.cat([p.log_probs for p in parts]),
                          torch.cat([p.trained for p in parts]), first.noise_levels, first.sigmas, first.timesteps,
                          Conditioning.cat([p.cond for p in parts]))

    @property
    def samples(self) -> torch.Tensor:
        return self.latents[:, -1]


def sde_transition(adapter, x, step: int, sigmas, timesteps, eta, cond, guidance_scale, *,
                   noise=None, prev_sample=None, reduction="mean", model=None) -> StepOutput:
    """One Flow-GRPO SDE step from x at ``step`` (sample with ``noise`` or score ``prev_sample``)."""
    v = adapter.predict(x, timesteps[step], cond, guidance_scale, model=model)
    return flow_grpo_sde_step(v, x, sigmas[step], sigmas[step + 1], eta, noise=noise, prev_sample=prev_sample,
                              sigma_fallback=float(sigmas[1]), reduction=reduction)


@torch.no_grad()
def rollout(adapter, cond: Conditioning, noise: torch.Tensor, schedule: Schedule, plan: StepPlan, *,
            guidance_scale: float = 1.0, generator: torch.Generator | None = None,
            reduction: str = "mean") -> Trajectory:
    """Sample from ``noise`` [B, ...] with an SDE step where ``plan.noise_levels`` > 0 and an Euler
    (ODE) step elsewhere. SDE noise is drawn from ``generator`` (on its device, then moved)."""
    sigmas, timesteps = schedule.sigmas, schedule.timesteps
    steps = schedule.num_steps
    if len(plan.noise_levels) != steps:
        raise ValueError(f"plan has {len(plan.noise_levels)} steps, schedule {steps}")
    x = noise.float()
    latents, log_probs = [x], torch.zeros(x.shape[0], steps)
    for i in range(steps):
        eta = float(plan.noise_levels[i])
        if eta > 0:
            eps = torch.randn(x.shape, generator=generator, device=generator.device if generator else "cpu")
            out = sde_transition(adapter, x, i, sigmas, timesteps, eta, cond, guidance_scale,
                                 noise=eps.to(x.device), reduction=reduction)
            x, log_probs[:, i] = out.prev_sample, out.log_prob.cpu()
        else:
            v = adapter.predict(x, timesteps[i], cond, guidance_scale)
            x = ode_step(v, x, sigmas[i], sigmas[i + 1])
        latents.append(x)
    return Trajectory(torch.stack(latents, dim=1), log_probs.to(x.device), plan.trained.to(x.device),
                      plan.noise_levels, sigmas, timesteps, cond)


def group_noise(adapter, groups: int, group_size: int, generator: torch.Generator, shared: bool) -> torch.Tensor:
    """Initial noise [groups·group_size, ...]; ``shared``: one draw per group, repeated (the
    group's samples then differ only by SDE noise)."""
    if shared:
        return adapter.initial_noise(groups, generator).repeat_interleave(group_size, dim=0)
    return adapter.initial_noise(groups * group_size, generator)
