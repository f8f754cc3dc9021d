"""Flow-GRPO: the PPO-style clipped objective over SDE steps with a KL to the reference policy.

Per trained step (``../shared/METHODS.md`` §3):

    ratio = exp(log p_θ(x'|x) − log p_old(x'|x))
    L     = mean_i max(−A_i·ratio_i, −A_i·clip(ratio_i, 1 − ε, 1 + ε)) + β·KL
            (DanceGRPO, per reward c: mean_i Σ_c w_c·max(−A_ic·ratio_i, −A_ic·clip(ratio_i)), β = 0)
    KL    = ‖μ_θ − μ_ref‖² / (2·std²)     (two Gaussians with the same std; reduced like log p)

The trainer sums this over trained steps by gradient accumulation.
"""

from __future__ import annotations

import torch

from flowalign.samplers.flow_sde import reduce_elements


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
    when β > 0); std: broadcastable to mean; weight: [B] in {0, 1}, which samples train this step
    (all when None). The loss is the weighted mean over samples. Returns (loss scalar, stats:
    policy_loss, kl, ratio, clipfrac, approx_kl).
    """
    weight = torch.ones_like(log_prob) if weight is None else weight.float()
    denom = weight.sum().clamp(min=1.0)
    ratio = torch.exp(log_prob - old_log_prob)
    per_reward = advantages.ndim == 2
    r = ratio[:, None] if per_reward else ratio
    objective = torch.maximum(-advantages * r, -advantages * torch.clamp(r, 1.0 - clip_range, 1.0 + clip_range))
    if per_reward:
        if advantage_weights is None:
            raise ValueError("advantages with one column per reward need advantage_weights")
        objective = objective @ advantage_weights.to(objective)
    policy_loss = (objective * weight).sum() / denom
    loss = policy_loss
    kl = torch.zeros((), device=log_prob.device)
    if beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std")
        kl_per_sample = reduce_elements((mean - ref_mean) ** 2 / (2 * std**2), reduction)
        kl = (kl_per_sample * weight).sum() / denom
        loss = loss + beta * kl
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "ratio": (ratio * weight).sum() / denom,
            "clipfrac": (((ratio - 1).abs() > clip_range).float() * weight).sum() / denom,
            "approx_kl": (0.5 * (log_prob - old_log_prob) ** 2 * weight).sum() / denom,
        }
    return loss, stats
