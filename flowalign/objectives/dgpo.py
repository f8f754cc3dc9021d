"""DGPO: Direct Group Preference Optimization (Luo et al., arXiv 2510.08425), on ODE rollouts.

DPO learns from a preferred / dispreferred pair without a stochastic policy; DGPO lifts it to the
groups of group-relative RL. Each prompt's group of k rollouts (ODE solver: no per-step
log-probabilities are needed) is split by advantage into a positive group G⁺ = {A_i > 0} and a
negative group G⁻ = {A_i < 0}, and the Bradley–Terry probability that G⁺ beats G⁻ is maximised:

    s_θ(x)  = −β·(‖v − v_θ(x_σ)‖² − ‖v − v_ref(x_σ)‖²),   x_σ = (1 − σ)·x0 + σ·ε,  v = ε − x0
              (the Diffusion-DPO implicit reward β·log p_θ/p_ref through the flow-matching ELBO;
               errors are means over elements)
    R(G)    = Σ_{x ∈ G} w(x)·s_θ(x),   w(x) = |A(x)|                 (group-level implicit reward)
    L       = −log σ(R(G⁺) − R(G⁻)) = −log σ(Σ_i A_i·s_θ(x_i))       (per group; mean over groups)

The weights are the advantage magnitudes: with group-normalised advantages Σ_{G⁺} |A| = Σ_{G⁻} |A|,
which is what makes the intractable partition term of the DPO derivation cancel between the two
groups (the paper's key step), and samples near the group mean count little. On a group of two
with advantages (+a, −a) the loss is −log σ(a·(s_w − s_l)): Diffusion-DPO's loss with β·a in place
of β. (We could not check the paper's equation numbers against its text, so none are cited.)

Reference: the adapter with its LoRA disabled (as Flow-GRPO's KL and GDRO). Decisions where the
paper leaves details open: (i) σ and ε are shared by the k samples of a group (one noising draw per
group, as GDRO; Flow-Factory's DGPO port does the same, its ``use_shared_noise``), so implicit
rewards within a group differ by the samples rather than by the noise; (ii) σ is drawn from the
sampling schedule's levels, ``train.noise_draws`` per group per update; (iii) samples with a NaN
reward get weight 0 (their advantage is not used); (iv) no PPO-style clipping or EMA reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dgpo_loss(
    mse_theta: torch.Tensor,
    mse_ref: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DGPO loss of a batch of groups.

    mse_theta (with grad), mse_ref: [G, k] flow-matching errors of each sample under the policy and
    the reference (same σ, ε within a group); advantages: [G, k] (0 for samples that do not train).
    Returns (loss scalar = mean over groups of −log σ(Σ_i A_i·s_i), s = −β·(mse_θ − mse_ref);
    stats: policy_loss, dgpo_margin (mean Σ_i A_i·s_i), dgpo_accuracy (fraction of groups whose
    margin is > 0)).
    """
    scores = -beta * (mse_theta.float() - mse_ref.detach().float())  # [G, k]
    margin = (advantages.float() * scores).sum(1)  # R(G⁺) − R(G⁻), [G]
    per_group = -F.logsigmoid(margin)
    loss = per_group.mean()
    with torch.no_grad():
        stats = {"policy_loss": loss.detach(), "dgpo_margin": margin.mean(),
                 "dgpo_accuracy": (margin > 0).float().mean()}
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class DGPOOptions:
    """``train.*`` options of method dgpo."""

    # β of the implicit reward s = −β·Δmse. Flow-Factory's DGPO guide (a public port of the paper's
    # code) uses 10–100 with a frozen reference (dpo_beta: 100); Diffusion-DPO's β (2000–5000) is
    # for ε-prediction errors summed differently and does not carry over.
    dgpo_beta: float = 100.0


@register
class DGPO(ForwardProcessObjective):
    """DGPO: ODE rollouts by the current weights; ``train.noise_draws`` noising draws per group
    and minibatch (one loss term each), shared by a group's samples; a minibatch holds whole
    groups. The group preference compares the policy's and the reference's flow-matching errors."""

    name = "dgpo"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, DGPOOptions)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size  # a group trains together, on one draw

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            ("train.train_batch_size", t.train_batch_size % t.group_size == 0,
             "must be a multiple of train.group_size for dgpo (a minibatch holds whole groups)"),
            ("train.group_size", t.group_size >= 2, "must be at least 2 for dgpo (a group preference needs two)"),
            ("train.dgpo_beta", t.dgpo_beta > 0, "must be > 0"),
            ("model.lora_rank", config.model.lora_rank > 0 or t.kl_beta > 0,
             "must be > 0 for dgpo: its reference is the adapter with the LoRA disabled (full fine-tuning keeps "
             "a reference copy only with train.kl_beta > 0)"),
        ]

    def loss(self, batch, idx, j, adv, valid):
        """DGPO on one noising draw shared by each group of minibatch ``idx`` (whole groups, in order)."""
        ctx, t = self.ctx, self.config.train
        sub, adv, weight = batch.traj[idx], adv[idx], valid[idx]
        x0, x_t, _, timestep, eps = self.noised(sub, idx, j)
        target = (eps - x0).flatten(1)
        with torch.no_grad(), ctx.adapter.reference():
            v_ref = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0, model=ctx.reference_model)
        mse_ref = ((v_ref.float().flatten(1) - target) ** 2).mean(1)
        v_theta = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0, model=ctx.model)
        mse_theta = ((v_theta.float().flatten(1) - target) ** 2).mean(1)
        if adv.ndim == 2:  # one column per reward: the weighted sum
            adv = adv @ ctx.reward_weights.to(adv)
        adv = torch.where(weight.bool(), adv, torch.zeros_like(adv))
        k = t.group_size
        return dgpo_loss(mse_theta.view(-1, k), mse_ref.view(-1, k), adv.view(-1, k), beta=t.dgpo_beta)
