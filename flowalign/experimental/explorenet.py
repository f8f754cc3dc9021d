"""EXPLORENET: a learned per-element exploration noise for group-relative RL (``../shared/METHODS.md`` §2).

Group-relative methods learn only from groups whose rewards differ. The explorer is a small
network that, before any reward is seen, maps (current latent x_k, step k, prompt embedding c) to
a multiplier m_φ(x_k, k, c) > 0 for every latent element; the SDE step then samples with the
per-element std  std_k·m  instead of the isotropic std_k, and the generator's log-probs use
exactly that std (``flow_grpo_sde_step`` takes η of the latent's shape).

**Magnitude fixed, shape learned.** In ``mode="shape"`` the raw output s is normalised so that
mean(m²) = 1 over the elements of each sample and step: the total noise variance equals the
isotropic baseline's and only its distribution over elements is learned. ``mode="magnitude"``
(the ablation) learns one scalar per step instead, m = exp(a_k) for all elements; ``"both"``
multiplies the two. At initialisation the last layer is zero, so m ≡ 1: exactly isotropic.

**Training signal.** For a prompt c the G samples of a group are i.i.d. draws of the rollout
distribution q_φ(τ | c) (initial noise aside, which φ does not touch). The explorer maximises
the expected within-group reward variance J(φ) = E_c E_{τ_1..G ~ q_φ}[U], with the unbiased
U-statistic U = 1/(G(G − 1)) Σ_{i≠j} (r_i − r_j)² / 2 (so E[U] = Var(r | c)). By the
score-function identity

    ∇J = E[ U · Σ_i ∇ log q_φ(τ_i) ],    log q_φ(τ) = Σ_k Σ_e log N(x'_{k,e}; μ_{k,e}, (std_k·m_{k,e})²)

where only m depends on φ (the mean μ is the generator's). Subtracting from U the mean U of the
*other* groups in the batch (a leave-one-out baseline, independent of the group's own τ) keeps
the estimator unbiased and lowers its variance. μ is never recomputed: with w = (x' − μ)/std_k =
m_old·z (z the standard normal drawn at sampling), log q_φ = −½(w / m_φ)² − log m_φ + const,
so the update needs only the explorer's own forward passes. Bias accepted: the log-density is
averaged (not summed) over elements, like the generator's ("mean" reduction), which rescales the
gradient per sample by 1/elements — a constant factor, no bias in direction; and the generator
moves between the rollout and the explorer's update only by the one step of that epoch, which
the explorer's update ignores (it is on-policy for the rollout it scores).

The explorer is saved apart from the generator (``explorenet.safetensors`` in checkpoints,
``explorenet/`` next to ``final/``) and is never needed to sample from the trained generator.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODES = ("shape", "magnitude", "both")


def normalise_shape(raw: torch.Tensor) -> torch.Tensor:
    """m = exp(s) scaled so that mean(m²) = 1 over each sample's elements. raw: [B, ...] → [B, ...]."""
    flat = raw.flatten(1)
    log_m = flat - 0.5 * torch.logsumexp(2 * flat, dim=1, keepdim=True) + 0.5 * math.log(flat.shape[1])
    return log_m.exp().view_as(raw)


def exploration_log_density(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """log N(w; 0, m²) up to a constant, averaged over elements: w = (x' − μ)/std_iso, m the
    multiplier under evaluation. w, m: [B, ...] → [B]."""
    return (-0.5 * (w / m) ** 2 - torch.log(m)).flatten(1).mean(1)


def group_spread_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per sample: U of its group minus the mean U of the other groups (leave-one-out baseline),
    with U = 1/(G(G − 1)) Σ_{i≠j} (r_i − r_j)²/2, the unbiased within-group variance.
    rewards, group_ids: [B] (NaN rewards are left out). Returns ([B] weights, stats)."""
    valid = torch.isfinite(rewards)
    ids = torch.unique(group_ids[valid])
    u = {}
    for gid in ids.tolist():
        r = rewards[valid & (group_ids == gid)].float()
        u[gid] = r.var(unbiased=True).item() if len(r) > 1 else 0.0
    values = torch.tensor(list(u.values()))
    weights = torch.zeros_like(rewards, dtype=torch.float32)
    for gid, value in u.items():
        others = (values.sum() - value) / max(len(values) - 1, 1)
        weights[valid & (group_ids == gid)] = value - others
    stats = {"explore/group_variance": values.mean().item() if len(values) else float("nan"),
             "explore/group_std": values.clamp(min=0).sqrt().mean().item() if len(values) else float("nan"),
             "explore/zero_spread_groups": (values < 1e-12).float().mean().item() if len(values) else float("nan")}
    return weights, stats


class ExploreNet(nn.Module):
    """(x [B, C, h, w], step index [B], pooled prompt embedding [B, P]) → multiplier m [B, C, h, w].

    A few 3×3 convolutions over the latent, with the step and prompt added as a per-channel
    bias (FiLM-style). Zero-initialised output: m ≡ 1 at the start (isotropic)."""

    def __init__(self, channels: int, prompt_dim: int, steps: int, mode: str = "shape", hidden: int = 32):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"explorenet mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.inp = nn.Conv2d(channels, hidden, 3, padding=1)
        self.step = nn.Embedding(steps, hidden)
        self.prompt = nn.Linear(prompt_dim, hidden)
        self.mid = nn.Conv2d(hidden, hidden, 3, padding=1)
        self.out = nn.Conv2d(hidden, channels, 3, padding=1)
        self.log_magnitude = nn.Parameter(torch.zeros(steps))
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, step: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        step = torch.as_tensor(step, device=x.device).long().expand(x.shape[0])
        m = torch.ones_like(x, dtype=torch.float32)
        if self.mode in ("shape", "both"):
            h = self.inp(x.float()) + (self.step(step) + self.prompt(pooled.float()))[:, :, None, None]
            h = self.mid(torch.nn.functional.silu(h))
            m = normalise_shape(self.out(torch.nn.functional.silu(h)))
        if self.mode in ("magnitude", "both"):
            m = m * self.log_magnitude[step].exp().view(-1, *([1] * (x.ndim - 1)))
        return m
