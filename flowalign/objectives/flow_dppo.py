"""Flow-DPPO (arXiv 2606.11025): Flow-GRPO's rollouts, advantages and per-step ratio, with PPO's ratio
clip replaced by a mask from the exact Gaussian KL between the old and the new transition of each step.

Every stochastic step is a Gaussian x' ~ N(μ, s²) whose std s does not depend on θ
(``../shared/METHODS.md`` §1), so old and new policy of a step differ only in their means and

    KL(π_old ‖ π_θ) = ‖μ_θ − μ_old‖² / (2s²)                         (paper Eq. 14; either direction)

Per trained step, for the samples i of a minibatch (A_i the group advantage, x'_i the rollout's draw):

    r_i   = exp(log p_θ(x'_i | x_i) − log p_old(x'_i | x_i))
    D_i   = mean over elements of (μ_θ − μ_old)² / (2s²)           (the KL / the element count)
    drop_i = (D_i ≥ τ) ∧ [(r_i > 1 ∧ A_i > 0) ∨ (r_i < 1 ∧ A_i < 0)]   (paper Eq. 18)
    L     = Σ_i w_i·1[¬drop_i]·(−A_i·r_i) / max(Σ_i w_i, 1)  +  β·KL_ref

(w_i: the sample trains this step; τ = ``train.kl_mask_threshold``). A step that moved far from the old
policy (D ≥ τ) is dropped only while it still pushes in the advantage's direction; a far step that moves
back (A > 0, r < 1, or A < 0, r > 1) keeps its gradient. The mask is a boolean without gradient; a
dropped sample adds 0 and still counts in the mean. With τ → ∞ nothing is dropped and L is −A·r averaged:
Flow-GRPO's loss with an infinite clip range, the unclipped policy gradient. On-policy (the first
minibatch of an epoch) μ_θ = μ_old and r = 1: D = 0 and nothing is dropped. No ratio is clipped anywhere,
so ``train.clip_range`` is refused. β·KL_ref (``train.kl_beta``, 0 in the source) is Flow-GRPO's KL to the
reference, "exact" convention; the source has none.

Read from Tencent-Hunyuan/UniRL at commit 1a7b501e8fe8517b432a130220d2ff462f9b5afa:
``unirl/algorithms/flowdppo.py`` (``_gaussian_kl_div``, ``_flowdppo_kl_adv_loss``, ``FlowDPPO.prepare_segment``,
``compute_loss_and_backward``, ``_compute_sigma_t``), ``FlowDPPO/README.md`` (the equation numbers) and
``examples/diffusion/sd3_flowdppo.yaml`` (configs/sd35m_flow_dppo_pickscore.yaml translates it). Term by term:

* Paper and code differ on D: Eq. 14 is the KL of the whole latent (a sum over elements), the code
  reduces ``(μ_θ − μ_old)² / (2σ_t²)`` with a mean over the latent dimensions and calibrates τ = 1e-5
  against that. We follow the code: D is always the mean over elements, whatever
  ``sampling.log_prob_reduction`` says, so τ means what it means there. The ratio uses the log-probs as
  the rollout reduced them (mean by default, as UniRL's ``FlowSDEStrategy``).
* s: UniRL's ``_compute_sigma_t`` (``add_kl_coefficient: true``, the recipe's) rebuilds
  η·sqrt(σ / (1 − min(σ, 0.99)))·sqrt(σ − σ'), its flow SDE's transition std (they differ only for σ in
  (0.99, 1), which its schedules do not have). We take the std of the transition itself
  (``StepOutput.std``): for the flow SDE the same formula (at σ = 1 each takes its own sampler's
  denominator: UniRL's 1 − 0.99, ours Flow-GRPO's 1 − σ_1), and for CPS, DanceGRPO's SDE and a
  per-element exploration std (EXPLORENET) still the exact KL of the kernel that drew x', where UniRL's
  formula would not be. ``add_kl_coefficient: false`` (s = 1) is not offered.
* A dropped sample's ratio is taken at log r = 0 inside the loss: one whose ratio overflowed adds 0 to
  the loss and its gradient. UniRL's ``torch.where`` keeps only the loss finite (its gradient is inf·0).
* μ_old: UniRL replays the pre-update weights once per rollout batch (``prepare_segment``, no grad) and
  keeps the means, frozen across its ``num_updates_per_batch`` optimizer steps. Here the kept rollout
  policy of GRPO-Guard (the weights that sampled the epoch, ``GRPOGuard``) recomputes μ_old for each
  trained step: the same values, one extra forward. log p_old is the rollout's (its
  ``old_logp_source: rollout``, the default).
* Strict inequalities as in the code: r = 1 or A = 0 is never dropped; D = τ counts as high (``kl < τ``
  keeps). The loss is a mean over samples per step and the trainer averages the trained steps: UniRL's
  ``loss_per_elem.mean()`` over [B, S'].
* Advantages: UniRL's recipe takes group means over one batch-wide std (``adv_use_global_std``), no
  clipping and no filtering of zero-advantage samples: ``train.global_std: true``,
  ``train.zero_advantage: keep``. One advantage per sample (no per-reward columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowalign.domains import Annotated, at_least
from flowalign.objectives.base import register, weighted_mean
from flowalign.objectives.flow_grpo import FlowGRPO, plus_gaussian_kl
from flowalign.objectives.grpo_guard import GRPOGuard
from flowalign.samplers.flow_sde import reduce_elements


def step_kl(mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """D: the mean over elements of (μ − μ_old)² / (2s²), the exact KL of two Gaussian steps of equal
    std s divided by the element count. mean, old_mean: [B, ...]; std: broadcastable (one per sample,
    or per element). Returns float32 [B]."""
    return reduce_elements((mean.float() - old_mean.float()) ** 2 / (2 * std.float() ** 2), "mean")


def kl_adv_mask(step_divergence: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drop, high, keep) bool [B]: high = D ≥ τ; drop = high ∧ ((r > 1 ∧ A > 0) ∨ (r < 1 ∧ A < 0));
    keep = ¬drop. step_divergence, ratio, advantages: [B]."""
    high = step_divergence >= threshold
    drop = high & (((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0)))
    return drop, high, ~drop


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    kl_threshold: float,
    weight: torch.Tensor | None = None,
    beta: float = 0.0,
    ref_mean: torch.Tensor | None = None,
    reduction: str = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Flow-DPPO loss of one step for a minibatch (module docstring).

    log_prob (with grad), old_log_prob, advantages: [B]; mean (with grad), old_mean, ref_mean: [B, ...]
    the step's transition means under θ, the rollout policy and the reference (ref_mean needed when
    β > 0); std: the transition std s, broadcastable to mean; kl_threshold: τ (math.inf: no mask);
    weight: [B] in {0, 1}, which samples train this step (all when None); reduction: how log p was
    reduced (the reference KL's, as Flow-GRPO's). Returns (loss scalar, stats: policy_loss, kl, ratio,
    approx_kl, kl_new_old (mean D), kl_mask_fraction (D ≥ τ), masked_fraction (dropped)).
    """
    w = torch.ones_like(log_prob) if weight is None else weight.float()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    divergence = step_kl(mean.detach(), old_mean.detach(), std)
    drop, high, keep = kl_adv_mask(divergence, ratio.detach(), advantages, kl_threshold)
    # a dropped sample's ratio at log r = 0: one that overflowed adds 0, not inf·0 = NaN, to loss and gradient
    kept_ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    objective = torch.where(keep, -advantages * kept_ratio, torch.zeros_like(kept_ratio))
    policy_loss = weighted_mean(objective, w)
    loss, kl = plus_gaussian_kl(policy_loss, beta, mean, ref_mean, std, w, reduction)
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "ratio": weighted_mean(ratio, w),
            "approx_kl": weighted_mean(0.5 * log_ratio**2, w),
            "kl_new_old": weighted_mean(divergence, w),
            "kl_mask_fraction": weighted_mean(high.float(), w),
            "masked_fraction": weighted_mean(drop.float(), w),
        }
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
@dataclass
class FlowDPPOOptions:
    """``train.*`` options of method flow_dppo."""

    # τ: a trained step whose mean-over-elements Gaussian KL to the rollout policy's step is at least this,
    # and that still pushes along its advantage, is dropped from the gradient (UniRL's kl_mask_threshold,
    # calibrated on the mean-reduced KL; .inf: never, the unclipped policy gradient)
    kl_mask_threshold: Annotated[float, at_least(0, ".inf: no mask", finite=False)] = 1e-5


@register
class FlowDPPO(GRPOGuard):
    """Flow-DPPO: Flow-GRPO's rollouts and trained steps, the unclipped ratio masked by each step's
    Gaussian KL to the rollout policy. Keeps GRPO-Guard's copy of the rollout policy's weights (its
    checkpointed state) to recompute the old transition means."""

    name = "flow_dppo"
    options = (*FlowGRPO.options, FlowDPPOOptions)
    per_reward_advantages = False
    progress = ("masked_fraction",)
    flow_grpo_kl_steps = ()  # the reference KL (kl_beta > 0) divides by the transition std: exact only

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        keys = config.sources["keys"] if config.sources is not None else set()
        return super(GRPOGuard, cls).validate(config) + [  # Flow-GRPO's rules, not GRPO-Guard's SDE and step weight
            ("train.clip_range", "train.clip_range" not in keys,
             "is not used by flow_dppo (the KL mask, train.kl_mask_threshold, replaces the ratio clip): remove it"),
        ]

    def loss(self, mb, j):
        rows = mb.traj.trained[:, j]
        if rows.any() and not rows.all():  # a step only some samples train: those alone (FlowGRPO.loss)
            mb = mb.select(rows.nonzero().squeeze(1))
        t, s, sub = self.config.train, self.config.sampling, mb.traj
        # the rollout policy's mean first: swapping its weights in after θ's forward would break θ's graph
        old_mean = self.transition(mb, j, "old", self.rollout_policy).mean
        out, ref_mean = self.rescore(mb, j)
        return flow_dppo_loss(out.log_prob, sub.log_probs[:, j], mb.advantages, mean=out.mean, old_mean=old_mean,
                              std=out.std, kl_threshold=t.kl_mask_threshold, weight=self.trained_weight(mb, j),
                              beta=t.kl_beta, ref_mean=ref_mean, reduction=s.log_prob_reduction)
