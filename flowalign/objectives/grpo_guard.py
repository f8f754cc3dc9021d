"""GRPO-Guard (Wang et al., arXiv 2510.22319): Flow-GRPO's clipped objective with a regulated ratio
and a per-step gradient reweighting.

The paper's finding: under the flow SDE a step's transition is Gaussian with a std s = σ_t·sqrt(|dt|)
that does not depend on θ, so with Δμ = μ_θ − μ_old and the rollout's draw x' = μ_old + s·z

    log r = log p_θ(x') − log p_old(x') = −‖Δμ‖² / (2s²) + ⟨Δμ, z⟩ / s

(reduced over elements like the log-probs; ``../shared/METHODS.md`` §1 for μ and s). Its mean
−‖Δμ‖²/(2s²) is below 0 (the ratio's mean falls below 1 once the policy moves) and its spread
‖Δμ‖/s grows as s shrinks, so steps at different noise levels see differently skewed ratios: PPO's
clip [1 − ε, 1 + ε] no longer bounds the over-confident positive updates. GRPO-Guard's two parts:

    (RatioNorm)   log r̃ = s·(log r + ‖Δμ‖² / (2s²)) = s·log r + ‖Δμ‖² / (2s)   (= ⟨Δμ, z⟩: mean 0, spread ‖Δμ‖)
    (reweighting) L_t   = (1 / |dt|) · mean_i max(−A_i·r̃_i, −A_i·clip(r̃_i, 1 − ε, 1 + ε))
    per step: L_t + β·KL_t, accumulated over the trained steps      (KL as Flow-GRPO's, "exact"
                                                                     convention, not reweighted)

Why the 1/|dt|: on-policy ∇_θ log r̃ = ⟨z, ∇_θ μ_θ⟩, and μ_θ moves with the velocity by
∂μ/∂v = dt·(1 + σ_t²(1 − σ)/(2σ)) (= dt·(1 + η²/2) for Flow-GRPO's σ_t), so without it a step's
gradient on v is proportional to its step size |dt|; with it every step gives v the same-sized
push, ⟨z, (1 + η²/2)·∇_θ v⟩ (the paper's "gradient reweighting that equalizes policy gradients over
noise conditions"). With an already normalised ratio (bias 0, s = 1) and |dt| = 1 (or the
reweighting off) the loss is Flow-GRPO's exactly; on-policy Δμ = 0 and r̃ = 1.

No equation numbers are cited: the forms above are the ones two public ports agree on, read, not
copied: verl-omni's ``GRPOGuardLoss`` (ratio exp((log r + ‖Δμ‖²_mean/(2s²))·s), the per-step loss
divided by sqrt(−dt)²) and Flow-Factory's ``GRPOGuardTrainer`` (the same ratio, without the 1/|dt|);
a published summary of the CVPR 2026 version names the two parts "RatioNorm … mean of 1" and "1/dt
gradient reweighting". (Another summary describes RatioNorm as standardising each step's ratios by
their batch mean and std; no port does that, and the closed form above is what removes the bias and
the 1/s, for every sample alone.) ``grpo_guard_loss`` implements L_t + β·KL_t; ``ratio_norm``
implements log r̃. ``train.guard_step_weight: none`` leaves the 1/|dt| out (Flow-Factory's form).

Decisions and what the paper leaves open: (i) ‖Δμ‖² is reduced over elements like the log-probs
(``sampling.log_prob_reduction``), so mean and sum reductions give the same r̃ up to the element
count, as log r does (both ports use the mean, as Flow-GRPO's log-prob). (ii) μ_old needs the
rollout policy's transition mean, which the rollout does not store: this objective keeps a copy of
the weights that sampled the epoch (an EMA of decay 0, updated at the end of each epoch and swapped
in for sampling, so it is exactly the rollout policy) and recomputes μ_old with it, one extra forward
per trained step (Flow-Factory stores μ_old at sampling time instead; the value is the same).
(iii) the flow SDE and DanceGRPO's SDE (with or without its score term) only: θ-independent std
s = coefficient·sqrt(|dt|) with a Gaussian log-density, and ∂μ/∂v ∝ dt (dance_grpo_euler: exactly
dt); CPS drops the variance from its log-prob and the per-element EXPLORENET std is not a scalar s,
so both are rejected. (iv) |dt| = σ − σ' of the sampling schedule, one value per
step (shared by the batch).
"""

from __future__ import annotations

import torch

from flowalign.objectives.flow_grpo import flow_grpo_loss, plus_gaussian_kl
from flowalign.objectives.base import weighted_mean
from flowalign.samplers.flow_sde import reduce_elements


def ratio_norm(log_ratio: torch.Tensor, mean_shift_sq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """RatioNorm: log r̃ = s·log r + ‖Δμ‖² / (2s).

    log_ratio: [B] log p_θ − log p_old; mean_shift_sq: [B] ‖μ_θ − μ_old‖² reduced over elements like
    the log-probs; scale: [B] the step's transition std s. Returns [B]."""
    return scale * log_ratio + mean_shift_sq / (2 * scale)


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    clip_range: float,
    step_weight: float = 1.0,
    reduction: str = "mean",
    beta: float = 0.0,
    ref_mean: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    advantage_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-Guard loss L_t of one step for a minibatch: ``step_weight`` (the reweighting, 1/|dt|)
    times Flow-GRPO's policy term (``flow_grpo_loss`` at β = 0) on the RatioNorm'd ratio, plus β
    times Flow-GRPO's Gaussian KL (``gaussian_kl``, not reweighted).

    log_prob (with grad), old_log_prob: [B]; advantages: [B] or [B, C] (with advantage_weights [C]);
    mean (with grad), old_mean, ref_mean: [B, ...] the step's transition means under θ, the rollout
    policy and the reference (ref_mean needed when β > 0); std: the transition std, broadcastable to
    mean, one value per sample; step_weight: a scalar; weight: [B] in {0, 1}. Returns (loss scalar,
    stats: Flow-GRPO's, with ``ratio`` / ``clipfrac`` of r̃ and ``policy_loss`` the reweighted policy
    term, plus raw_ratio, the unnormalised ratio's mean).
    """
    scale = std.float().expand_as(mean).reshape(mean.shape[0], -1)[:, 0]  # [B]: one std per sample
    shift = reduce_elements((mean.float() - old_mean.detach().float()) ** 2, reduction)
    log_ratio = log_prob - old_log_prob
    normed = ratio_norm(log_ratio, shift, scale)
    policy, stats = flow_grpo_loss(old_log_prob + normed, old_log_prob, advantages, clip_range=clip_range,
                                   weight=weight, advantage_weights=advantage_weights)
    loss = step_weight * policy
    w = torch.ones_like(log_ratio) if weight is None else weight.float()
    if beta > 0:
        loss, kl = plus_gaussian_kl(loss, beta, mean, ref_mean, std, w, reduction)
        stats["kl"] = kl.detach()
    with torch.no_grad():
        stats["policy_loss"] = step_weight * stats["policy_loss"]
        stats["raw_ratio"] = weighted_mean(torch.exp(log_ratio), w)
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.flow_grpo import FlowGRPO  # noqa: E402

GUARD_SDES = ("flow_grpo", "dance_grpo", "dance_grpo_euler")
GUARD_STEP_WEIGHTS = ("inverse_dt", "none")


@dataclass
class GRPOGuardOptions:
    """``train.*`` options of method grpo_guard."""

    # The paper's gradient reweighting of each trained step's policy loss: "inverse_dt" multiplies it
    # by 1/(σ − σ') of the step, so every step moves the velocity by a comparable amount
    # (verl-omni's port: loss / sqrt(−dt)²); "none" leaves RatioNorm alone (Flow-Factory's port).
    guard_step_weight: str = "inverse_dt"


@register
class GRPOGuard(FlowGRPO):
    """GRPO-Guard: Flow-GRPO's rollouts, trained steps and KL, with the RatioNorm'd ratio. Keeps
    the rollout policy's weights (its checkpointed state) to recompute the old transition means."""

    name = "grpo_guard"
    rollout = "sde"
    predictions = ("velocity",)
    stateful = True
    flow_grpo_kl_steps = ()  # its KL divides by the transition std that RatioNorm uses: exact only
    options = (*FlowGRPO.options, GRPOGuardOptions)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.rollout_policy = EMA(ctx.params, 0.0)  # decay 0: a copy of the weights that sample the epoch

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        return super().validate(config) + [
            ("sampling.sde", config.sampling.sde in GUARD_SDES,
             f"must be one of {', '.join(GUARD_SDES)} for grpo_guard (a Gaussian step whose std does not depend on "
             f"the model; cps drops the variance from its log-prob), got {config.sampling.sde!r}"),
            ("train.guard_step_weight", config.train.guard_step_weight in GUARD_STEP_WEIGHTS,
             f"must be one of {', '.join(GUARD_STEP_WEIGHTS)}, got {config.train.guard_step_weight!r}"),
        ]

    def sampling_weights(self):
        return self.rollout_policy.swapped_in()

    def loss(self, mb, j):
        t, s, sub = self.config.train, self.config.sampling, mb.traj
        if sub.std_scales is not None:
            raise ValueError("grpo_guard needs one transition std per sample and step; a per-element exploration "
                             "std (EXPLORENET) has none")
        # the rollout policy's mean first: swapping its weights in after θ's forward would break θ's graph
        old_mean = self.transition(mb, j, "old", self.rollout_policy).mean
        out, ref_mean = self.rescore(mb, j)
        step_weight = 1.0
        if t.guard_step_weight == "inverse_dt":
            step_weight = 1.0 / float(sub.schedule.sigmas[j] - sub.schedule.sigmas[j + 1])  # 1/|dt|
        return grpo_guard_loss(out.log_prob, sub.log_probs[:, j], mb.advantages, mean=out.mean,
                               old_mean=old_mean, std=out.std, clip_range=t.clip_range, step_weight=step_weight,
                               reduction=s.log_prob_reduction, beta=t.kl_beta, ref_mean=ref_mean,
                               weight=self.trained_weight(mb, j),
                               advantage_weights=self.ctx.reward_weights if mb.advantages.ndim == 2 else None)

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        self.rollout_policy.update()  # the weights that sample the next epoch
        return {}

    def components(self) -> dict:
        return {"rollout_policy": self}

    def state_dict(self) -> dict:
        return self.rollout_policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollout_policy.load_state_dict(state)
