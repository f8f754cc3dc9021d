"""Flow-GRPO: the PPO-style clipped objective over SDE steps with a KL to the reference policy.

Per trained step (``../shared/METHODS.md`` §3):

    ratio = exp(log p_θ(x'|x) − log p_old(x'|x))
    L     = mean_i max(−A_i·ratio_i, −A_i·clip(ratio_i, 1 − ε, 1 + ε)) + β·KL
            (DanceGRPO, per reward c: mean_i Σ_c w_c·max(−A_ic·ratio_i, −A_ic·clip(ratio_i)), β = 0)
    KL    = ‖μ_θ − μ_ref‖² / (2·s²)       (reduced like log p over elements)

Which s, ``train.kl_convention``: "exact" (the default) takes the transition's own std, s = σ_t·sqrt(|dt|)
for the flow SDE, so KL is the KL between the two per-step Gaussians. "flow_grpo" takes what Flow-GRPO's
train_sd3.py divides by, the SDE's σ_t without the step's dt (s = std / sqrt(σ − σ')): its KL is the
exact one times |dt|, so the same β is 1/|dt| times weaker than under "exact" (×9 on a uniform 10-step
schedule, ×3.7 to ×25 per step on SD3.5's shift-3 schedule). A β copied from Flow-GRPO means what it
meant there only with "flow_grpo". For CPS Flow-GRPO's σ_t is the transition std itself, so the two
conventions agree.

Samples whose advantage is zero (every column, |A| ≤ 1e-6: a group with no reward spread) carry no
policy gradient but count in the mean, so the gradient's scale depends on how many groups had no
spread. ``train.zero_advantage: drop`` leaves them out of the mean, as Flow-GRPO's train_sd3.py
does (it filters them out of the epoch's batch before training); "keep" (the default) keeps them.
The KL term then averages over the kept samples only, as in Flow-GRPO.

The trainer sums this over trained steps by gradient accumulation.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from flowalign.objectives.base import weighted_mean
from flowalign.samplers.flow_sde import reduce_elements

KL_CONVENTIONS = ("exact", "flow_grpo")
ZERO_ADVANTAGE = ("keep", "drop")
ZERO_ADVANTAGE_TOL = 1e-6  # |A| at or below this is "zero": a no-spread group's mean may round by an ulp


def kl_std(std: torch.Tensor, sigma: float, sigma_next: float, *, convention: str, sde: str) -> torch.Tensor:
    """The s the KL term divides by (module docstring). std: the transition std [B, 1, ...]
    (broadcastable); σ > σ': the step's noise levels. "exact" → std; "flow_grpo" → std / sqrt(σ − σ')
    for the flow SDE (Flow-GRPO's σ_t) and std for CPS (its σ_t is the std). Same shape as std."""
    if convention == "exact" or sde == "cps":
        return std
    if convention == "flow_grpo" and sde == "flow_grpo":
        return std / math.sqrt(sigma - sigma_next)
    raise ValueError(f"kl_convention {convention!r} is defined for the flow_grpo and cps steps, not {sde!r}")


def nonzero_advantage(advantages: torch.Tensor) -> torch.Tensor:
    """advantages [B] or [B, C] → bool [B]: some column has |A| > ZERO_ADVANTAGE_TOL."""
    a = advantages.abs() if advantages.ndim == 1 else advantages.abs().amax(dim=1)
    return a > ZERO_ADVANTAGE_TOL


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, weight: torch.Tensor,
                reduction: str = "mean") -> torch.Tensor:
    """The per-step Gaussian KL ‖μ − μ_ref‖² / (2·s²), reduced over elements like log p, averaged
    over the samples that train. mean, ref_mean: [B, ...]; std: s, broadcastable; weight: [B]."""
    return weighted_mean(reduce_elements((mean - ref_mean) ** 2 / (2 * std**2), reduction), weight)


def plus_gaussian_kl(loss: torch.Tensor, beta: float, mean: torch.Tensor | None, ref_mean: torch.Tensor | None,
                     std: torch.Tensor | None, weight: torch.Tensor,
                     reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss + β·KL, KL) with KL = ``gaussian_kl`` over the samples of ``weight``; (loss, 0) when
    β = 0 (mean, ref_mean and std needed when β > 0). The Gaussian-step twin of ``plus_velocity_kl``."""
    if beta <= 0:
        return loss, torch.zeros((), device=loss.device)
    if mean is None or ref_mean is None or std is None:
        raise ValueError("beta > 0 needs mean, ref_mean and std")
    kl = gaussian_kl(mean, ref_mean, std, weight, reduction)
    return loss + beta * kl, kl


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    advantage_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Flow-GRPO loss of one step for a minibatch.

    log_prob, old_log_prob: [B]; advantages: [B], or [B, C] with one column per reward and
    ``advantage_weights`` [C] (DanceGRPO: each reward's clipped objective, summed with its
    weight); mean, ref_mean: [B, ...] transition means under the policy and the reference (needed
    when β > 0); std: the s of the KL (``kl_std``), broadcastable to mean; weight: [B] in {0, 1},
    which samples train this step (all when None). The loss is the weighted mean over samples.
    Returns (loss scalar, stats: policy_loss, kl, ratio, clipfrac, approx_kl).
    """
    weight = torch.ones_like(log_prob) if weight is None else weight.float()
    ratio = torch.exp(log_prob - old_log_prob)
    per_reward = advantages.ndim == 2
    r = ratio[:, None] if per_reward else ratio
    objective = torch.maximum(-advantages * r, -advantages * torch.clamp(r, 1.0 - clip_range, 1.0 + clip_range))
    if per_reward:
        if advantage_weights is None:
            raise ValueError("advantages with one column per reward need advantage_weights")
        objective = objective @ advantage_weights.to(objective)
    policy_loss = weighted_mean(objective, weight)
    loss, kl = plus_gaussian_kl(policy_loss, beta, mean, ref_mean, std, weight, reduction)
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "ratio": weighted_mean(ratio, weight),
            "clipfrac": weighted_mean(((ratio - 1).abs() > clip_range).float(), weight),
            "approx_kl": weighted_mean(0.5 * (log_prob - old_log_prob) ** 2, weight),
        }
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from flowalign.objectives.base import BaseObjective, Minibatch, Policy, register  # noqa: E402
from flowalign.rollout import transition  # noqa: E402
from flowalign.samplers.flow_sde import StepOutput  # noqa: E402
from flowalign.samplers.steps import step_counts  # noqa: E402


@dataclass
class FlowGRPOOptions:
    """``train.*`` options of the clipped-ratio methods (flow_grpo, dance_grpo, ddpo, grpo_guard)."""

    # which std the KL to the reference divides by: exact (the KL of the two per-step Gaussians) |
    # flow_grpo (Flow-GRPO's σ_t without the step's dt: the same β is 1/|dt| times weaker); module docstring
    kl_convention: str = "exact"
    # samples whose advantage is 0 (a group with no reward spread): keep them in the loss's mean | drop
    # them from it, as Flow-GRPO does (the gradient's scale then does not depend on how many groups had no spread)
    zero_advantage: str = "keep"
    # CFG's unconditional prediction in a training forward taken from the rollout, which computed it at
    # that step, instead of a forward of its own (needs train.detach_uncond: it carries no gradient):
    # the step costs one pass of the B conditional rows. Exact (to float rounding) while the weights are
    # those that sampled (an update's first minibatch); after an optimizer step the unconditional half is
    # the sampling weights', the conditional half the current ones' (docs/performance.md)
    reuse_rollout_uncond: bool = False


@register
class FlowGRPO(BaseObjective):
    """Flow-GRPO: rescore each trained SDE step of the rollout under the current weights (the
    flow SDE of ``sampling.sde`` for velocity models; the DDIM step for ε-prediction ones, see
    ``DDPO``) and take the clipped-ratio loss, a KL to the reference when ``train.kl_beta`` > 0.
    One loss term per trained step. Takes per-reward advantages (DanceGRPO's one clipped
    objective per reward)."""

    name = "flow_grpo"
    rollout = "sde"
    predictions = ("velocity",)
    options = (FlowGRPOOptions,)
    per_reward_advantages = True
    progress = ("clipfrac",)
    # the steps whose KL Flow-GRPO's convention (train.kl_convention: flow_grpo) is defined for
    flow_grpo_kl_steps: tuple[str, ...] = ("flow_grpo", "cps")

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t, s = config.train, config.sampling
        return [("sampling.eta", s.eta > 0,
                 "must be > 0 to train with log-probabilities (η = 0 is ODE sampling; diffusion_nft and gdro allow it)"),
                ("train.kl_convention", t.kl_convention in KL_CONVENTIONS,
                 f"must be one of {', '.join(KL_CONVENTIONS)}, got {t.kl_convention!r}"),
                ("train.kl_convention", t.kl_convention == "exact" or s.sde in cls.flow_grpo_kl_steps,
                 f"flow_grpo (Flow-GRPO's σ_t) is defined for method {cls.name} only with sampling.sde in "
                 f"{cls.flow_grpo_kl_steps}, not {s.sde!r}: use exact" if cls.flow_grpo_kl_steps else
                 f"must be exact for method {cls.name} (Flow-GRPO's convention is defined for its own steps)"),
                ("train.zero_advantage", t.zero_advantage in ZERO_ADVANTAGE,
                 f"must be one of {', '.join(ZERO_ADVANTAGE)}, got {t.zero_advantage!r}"),
                ("train.reuse_rollout_uncond", not t.reuse_rollout_uncond or t.detach_uncond,
                 "needs train.detach_uncond: true (the reused unconditional prediction carries no gradient)"),
                ("train.reuse_rollout_uncond", not t.reuse_rollout_uncond or s.guidance_scale > 1,
                 f"needs CFG (sampling.guidance_scale > 1, got {s.guidance_scale:g}): without it there is "
                 f"no unconditional branch to reuse")]

    @classmethod
    def keeps_uncond(cls, config) -> bool:
        return config.train.reuse_rollout_uncond

    def trained_weight(self, mb: Minibatch, j: int) -> torch.Tensor:
        """bool [b]: the minibatch's samples that train step j (trained there, valid reward, and a
        nonzero advantage under ``train.zero_advantage: drop``)."""
        weight = mb.traj.trained[:, j] & mb.valid
        if self.config.train.zero_advantage == "drop":
            weight = weight & nonzero_advantage(mb.advantages).to(weight.device)
        return weight

    @classmethod
    def num_terms(cls, config) -> int:
        return step_counts(config.sampling)[0]

    def terms(self, batch) -> list[int]:
        levels = batch.traj.noise_levels
        return [j for j in range(len(levels)) if levels[j] > 0]

    def transition(self, mb: Minibatch, j: int, policy: Policy = "theta", weights=None) -> StepOutput:
        """Step j of the minibatch's rollouts rescored under ``policy`` (``Context.policy``): the
        recorded x' scored with the std each sample was drawn with."""
        ctx, s, sub = self.ctx, self.config.sampling, mb.traj
        scale = None if sub.std_scales is None else sub.std_scales[:, j]
        reuse = sub.uncond is not None and policy == "theta"  # train.reuse_rollout_uncond
        with ctx.policy(policy, weights) as model, \
                ctx.adapter.given_uncond(sub.uncond[:, j]) if reuse else contextlib.nullcontext():
            return transition(ctx.adapter, sub.latents[:, j], j, sub.schedule, float(sub.noise_levels[j]), sub.cond,
                              s.guidance_scale, sde=s.sde, prev_sample=sub.latents[:, j + 1],
                              reduction=s.log_prob_reduction, model=model, std_scale=scale)

    def rescore(self, mb: Minibatch, j: int) -> tuple[StepOutput, torch.Tensor | None]:
        """(θ's transition of step j, the reference's transition mean when ``train.kl_beta`` > 0)."""
        out = self.transition(mb, j)
        ref_mean = self.transition(mb, j, "ref").mean if self.config.train.kl_beta > 0 else None
        return out, ref_mean

    def loss(self, mb, j):
        rows = mb.traj.trained[:, j]
        if rows.any() and not rows.all():
            # a step only some samples train (step_mode fraction: DanceGRPO, Flow-GRPO's timestep_fraction):
            # rescore those rows alone. The others weigh 0 in the loss, its mean and its statistics, so the
            # loss is the same; the denoiser's forward and backward shrink by the untrained share
            mb = mb.select(rows.nonzero().squeeze(1))
        t, s, sub = self.config.train, self.config.sampling, mb.traj
        out, ref_mean = self.rescore(mb, j)
        std = out.std
        if t.kl_beta > 0 and t.kl_convention != "exact":
            std = kl_std(std, float(sub.schedule.sigmas[j]), float(sub.schedule.sigmas[j + 1]),
                         convention=t.kl_convention, sde=s.sde)
        return flow_grpo_loss(out.log_prob, sub.log_probs[:, j], mb.advantages, clip_range=t.clip_range,
                              beta=t.kl_beta, mean=out.mean, ref_mean=ref_mean, std=std,
                              weight=self.trained_weight(mb, j), reduction=s.log_prob_reduction,
                              advantage_weights=self.ctx.reward_weights if mb.advantages.ndim == 2 else None)


@register
class DDPO(FlowGRPO):
    """DDPO (Black et al. 2023) on ε-prediction models: the same clipped-ratio loss on the DDIM
    transition (``flowalign.samplers.ddim``), which ``transition`` takes for these adapters. A
    preset: advantages as configured (configs/shapes_ddpo.yaml uses the per-prompt tracker)."""

    name = "ddpo"
    predictions = ("epsilon",)
    flow_grpo_kl_steps = ()  # the DDIM step's KL: Flow-GRPO's convention is defined for its flow SDE
