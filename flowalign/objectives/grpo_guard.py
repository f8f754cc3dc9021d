"""GRPO-Guard (arXiv 2510.22319): Flow-GRPO's clipped objective with a regulated ratio.

The paper's finding: under the flow SDE a step's transition is Gaussian with a std s = σ_t·sqrt(|dt|)
that does not depend on θ, so with Δμ = μ_θ − μ_old and the rollout's draw x' = μ_old + s·z

    log r = log p_θ(x') − log p_old(x') = −‖Δμ‖² / (2s²) + ⟨Δμ, z⟩ / s

(sum over elements; ``../shared/METHODS.md`` §1 for μ and s). Its mean −‖Δμ‖²/(2s²) is below 0
(the ratio's mean falls below 1 once the policy moves) and its spread ‖Δμ‖/s grows as s shrinks,
so steps at different noise levels see differently skewed ratios: PPO's clip [1 − ε, 1 + ε] no
longer bounds the over-confident positive updates, and the low-noise steps dominate the gradient.
GRPO-Guard regulates the ratio per step (RatioNorm) and thereby reweights the gradient across
noise levels:

    log r̃ = s·(log r + ‖Δμ‖² / (2s²)) = s·log r + ‖Δμ‖² / (2s)   (= ⟨Δμ, z⟩: mean 0, spread ‖Δμ‖)
    L     = Flow-GRPO's loss with r̃ in place of r:
            mean_i max(−A_i·r̃_i, −A_i·clip(r̃_i, 1 − ε, 1 + ε)) + β·KL

Adding back the bias centres the ratio at 1 at every step; multiplying by s removes the 1/s that
made the ratio's spread, and ∇ log r (∝ (x' − μ_θ)/s²), depend on the noise level, so every step's
clip bounds a comparable change and contributes a comparably scaled gradient. With an already
normalised ratio (bias 0, s = 1) the loss is Flow-GRPO's exactly; on-policy Δμ = 0 and r̃ = 1.

Decisions and what the paper leaves open (we could not check its equation numbers against its text,
so none are cited): (i) the bias and the scale are applied in one expression, per sample and step,
as in the public port we read (Flow-Factory's GRPOGuardTrainer, which also multiplies the log-ratio
by σ_t·sqrt(|dt|) and adds ‖Δμ‖²/(2σ_t·sqrt(|dt|))); ‖Δμ‖² is reduced over elements like the
log-probs (``sampling.log_prob_reduction``), so mean and sum reductions give the same r̃ up to the
element count, as log r does. (ii) μ_old needs the rollout policy's transition mean, which the
rollout does not store: this objective keeps a copy of the weights that sampled the epoch (an EMA
of decay 0, updated at the end of each epoch and swapped in for sampling, so it is exactly the
rollout policy) and recomputes μ_old with it, one extra forward per trained step. (iii) the flow
SDE and DanceGRPO's SDE only (θ-independent std with a Gaussian log-density); CPS drops the
variance from its log-prob and the per-element EXPLORENET std is not a scalar s, so both are rejected.
"""

from __future__ import annotations

import torch

from flowalign.objectives.flow_grpo import flow_grpo_loss
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
    reduction: str = "mean",
    **flow_grpo_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-Guard loss of one step for a minibatch: Flow-GRPO's loss (``flow_grpo_loss``, whose
    remaining keywords pass through: beta, ref_mean, weight, advantage_weights) on the RatioNorm'd ratio.

    log_prob (with grad), old_log_prob: [B]; advantages: [B] or [B, C]; mean (with grad), old_mean:
    [B, ...] the step's transition means under θ and the rollout policy; std: the transition std,
    broadcastable to mean, one value per sample. Returns (loss scalar, stats: Flow-GRPO's, with
    ``ratio`` / ``clipfrac`` of r̃, plus raw_ratio, the unnormalised ratio's mean).
    """
    scale = std.float().expand_as(mean).reshape(mean.shape[0], -1)[:, 0]  # [B]: one std per sample
    shift = reduce_elements((mean.float() - old_mean.detach().float()) ** 2, reduction)
    log_ratio = log_prob - old_log_prob
    normed = ratio_norm(log_ratio, shift, scale)
    loss, stats = flow_grpo_loss(old_log_prob + normed, old_log_prob, advantages, clip_range=clip_range, mean=mean,
                                 std=std, reduction=reduction, **flow_grpo_kwargs)
    with torch.no_grad():
        w = flow_grpo_kwargs.get("weight")
        w = torch.ones_like(log_ratio) if w is None else w.float()
        stats["raw_ratio"] = (torch.exp(log_ratio) * w).sum() / w.sum().clamp(min=1.0)
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.flow_grpo import FlowGRPO  # noqa: E402
from flowalign.rollout import transition  # noqa: E402

GUARD_SDES = ("flow_grpo", "dance_grpo", "dance_grpo_euler")


@register
class GRPOGuard(FlowGRPO):
    """GRPO-Guard: Flow-GRPO's rollouts, trained steps and KL, with the RatioNorm'd ratio. Keeps
    the rollout policy's weights (its checkpointed state) to recompute the old transition means."""

    name = "grpo_guard"
    rollout = "sde"
    predictions = ("velocity",)
    stateful = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.rollout_policy = EMA(ctx.params, 0.0)  # decay 0: a copy of the weights that sample the epoch

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        return super().validate(config) + [
            ("sampling.sde", config.sampling.sde in GUARD_SDES,
             f"must be one of {', '.join(GUARD_SDES)} for grpo_guard (a Gaussian step whose std does not depend on "
             f"the model; cps drops the variance from its log-prob), got {config.sampling.sde!r}"),
            ("train.kl_convention", config.train.kl_convention == "exact",
             "must be exact for grpo_guard (its KL divides by the transition std that RatioNorm uses)"),
        ]

    def sampling_weights(self):
        return self.rollout_policy.swapped_in()

    def loss(self, batch, idx, j, adv, valid):
        ctx, t, s = self.ctx, self.config.train, self.config.sampling
        sub = batch.traj[idx]
        if sub.std_scales is not None:
            raise ValueError("grpo_guard needs one transition std per sample and step; a per-element exploration "
                             "std (EXPLORENET) has none")
        weight = self.trained_weight(sub, j, adv[idx], valid[idx])
        x, x_next = sub.latents[:, j], sub.latents[:, j + 1]
        args = (ctx.adapter, x, j, sub.schedule, float(sub.noise_levels[j]), sub.cond, s.guidance_scale)
        kwargs = dict(sde=s.sde, prev_sample=x_next, reduction=s.log_prob_reduction)
        with torch.no_grad():  # before θ's forward: swapping weights in later would break its graph
            with self.rollout_policy.swapped_in():
                old_mean = transition(*args, **kwargs, model=ctx.model).mean
            ref_mean = None
            if t.kl_beta > 0:
                with ctx.adapter.reference():
                    ref_mean = transition(*args, **kwargs, model=ctx.reference_model).mean
        out = transition(*args, **kwargs, model=ctx.model)
        adv = adv[idx]
        return grpo_guard_loss(out.log_prob, sub.log_probs[:, j], adv, mean=out.mean, old_mean=old_mean, std=out.std,
                               clip_range=t.clip_range, reduction=s.log_prob_reduction, beta=t.kl_beta,
                               ref_mean=ref_mean, weight=weight,
                               advantage_weights=ctx.reward_weights if adv.ndim == 2 else None)

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        self.rollout_policy.update()  # the weights that sample the next epoch
        return {}

    def components(self) -> dict:
        return {"rollout_policy": self}

    def state_dict(self) -> dict:
        return self.rollout_policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollout_policy.load_state_dict(state)
