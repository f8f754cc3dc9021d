"""DGPO: Direct Group Preference Optimization (Luo, Hu & Tang, arXiv 2510.08425, ICLR 2026), on ODE rollouts.

DPO learns from a preferred / dispreferred pair without a stochastic policy; DGPO lifts it to the
groups of group-relative RL. Each prompt's group of k rollouts (ODE solver: no per-step
log-probabilities are needed) is split by advantage into a positive group G⁺ = {A_i > 0} and a
negative group G⁻ = {A_i < 0}, and the Bradley–Terry probability that G⁺ beats G⁻ is maximised
(the authors' README states the objective as max E log p_θ(G⁺ ≻ G⁻ | c) = E log σ(R_θ(G⁺|c) − R_θ(G⁻|c))):

    s_θ(x)  = −β·(‖v − v_θ(x_σ)‖² − ‖v − v_ref(x_σ)‖²),   x_σ = (1 − σ)·x0 + σ·ε,  v = ε − x0
              (the Diffusion-DPO implicit reward β·log p_θ/p_ref through the flow-matching ELBO;
               errors are means over elements)
    R(G)    = Σ_{x ∈ G} w(x)·s_θ(x),   w(x) = |A(x)| / k                (group-level implicit reward)
    L       = −log σ(R(G⁺) − R(G⁻)) = −log σ((1/k)·Σ_i A_i·s_θ(x_i))     (per group; mean over groups)

The weights are the advantage magnitudes: with group-normalised advantages Σ_{G⁺} |A| = Σ_{G⁻} |A|,
which is what makes the intractable partition term of the DPO derivation cancel between the two
groups (the paper's key step), and samples near the group mean count little. The 1/k is the
authors' code's (its per-sample term A·β_dpo·Δmse / group_size), so ``train.dgpo_beta`` means
their ``beta_dpo``. On a group of two with advantages (+a, −a) the loss is
−log σ(−(a·β/2)·[(mse_θ,w − mse_ref,w) − (mse_θ,l − mse_ref,l)]): at a = 1 exactly the Diffusion-DPO
loss as diffusers' train_diffusion_dpo.py computes it (scale −½·β_dpo), the same β. ``dgpo_loss``
implements L.

No equation numbers are cited: the objective above is the README's equation and the authors' code
(Luo-Yihong/DGPO, ``compute_group_dgpo_loss_allreduce``, read, not copied).

Term by term against the authors' code, and what we do:
(i) group reward: Σ_i A_i·β·Δmse_i / k, as here (without the 1/k the margin is k times sharper at
the same β).
(ii) loss scale: their code back-propagates σ(βΣAΔ/k)·A·mse_θ with the sigmoid factor detached,
averaged over samples; that is the gradient of L above divided by β. We take L itself (the
objective the paper states; the constant matters only for gradient clipping and against the KL).
(iii') KL: their total loss adds β_kl·mean_i ‖v_θ − v_ref‖² (their ``train.beta``: 1e-3 … 0.02) to
that surrogate; here ``train.kl_beta`` enters as β·kl_beta·mean_i ‖v_θ − v_ref‖² (over the samples
with a reward), so L + β·kl_beta·KL is β times their loss and a copied β_kl keeps their balance.
(iii) noise: σ and ε shared by a group's k samples (their ``use_shared_noise``), as here.
(iv) timesteps: their configs train ``num_train_timesteps`` = 4 levels drawn (the same for the whole
batch) among the first ``trunc_steps`` + 1 of the 10-step schedule (4 → 5 levels, 6 → 7: the
high-noise end, "t_min"); ``train.dgpo_noise_levels`` (0 = all levels, default) restricts our draws
to the first n levels the same way; we draw per group, not per batch.
(v) reference: the adapter with its LoRA disabled (theirs: the same, with CFG on it optional).
(vi) not implemented: their PPO-style clip of the matching loss against an EMA "old" policy
(added after review, per their README), their EMA reference variant, their switch of rollouts to
that EMA after 200–500 steps, the clip on the KL, and their advantage clip at ±5 (ours: the
advantages as configured).
Further decision: samples with a NaN reward get weight 0 (their advantage is not used).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flowalign.domains import Annotated, above, at_least

from flowalign.objectives.base import flow_matching_error, velocity_kl, weighted_mean


def dgpo_loss(
    mse_theta: torch.Tensor,
    mse_ref: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DGPO loss L of a batch of groups, plus β·kl_beta times the velocity KL.

    mse_theta (with grad), mse_ref: [G, k] flow-matching errors of each sample under the policy and
    the reference (same σ, ε within a group); advantages: [G, k] (0 for samples that do not train);
    kl (with grad): [G, k] mean‖v_θ − v_ref‖² per sample (needed when kl_beta > 0); weight: [G, k] in
    {0, 1}, the samples the KL averages over (all when None).
    Returns (loss scalar = mean over groups of −log σ((1/k)·Σ_i A_i·s_i), s = −β·(mse_θ − mse_ref),
    + β·kl_beta·(weighted mean of kl); stats: policy_loss, kl, dgpo_margin (mean R(G⁺) − R(G⁻)),
    dgpo_accuracy (fraction of groups whose margin is > 0)).
    """
    scores = -beta * (mse_theta.float() - mse_ref.detach().float())  # [G, k]
    margin = (advantages.float() * scores).mean(1)  # R(G⁺) − R(G⁻) with w = |A|/k, [G]
    per_group = -F.logsigmoid(margin)
    policy_loss = per_group.mean()
    loss = policy_loss
    kl_mean = torch.zeros((), device=mse_theta.device)
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs kl")
        w = torch.ones_like(kl) if weight is None else weight.float()
        kl_mean = weighted_mean(kl.float(), w)
        # β·kl_beta: the authors' balance, whose DGPO gradient is ours / β (see the module docstring)
        loss = loss + beta * kl_beta * kl_mean
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "kl": kl_mean.detach(), "dgpo_margin": margin.mean(),
                 "dgpo_accuracy": (margin > 0).float().mean()}
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.objectives.base import register, whole_groups_rule  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class DGPOOptions:
    """``train.*`` options of method dgpo."""

    # β of the implicit reward s = −β·Δmse, with the group reward's 1/k: the authors' beta_dpo (10–100
    # with a frozen reference, 100 in their GenEval / OCR configs, 10 for PickScore; 2000–5000 only
    # with their EMA reference, which is not implemented here).
    dgpo_beta: Annotated[float, above(0)] = 100.0
    # The timestep clip: noising draws only among the first n levels of the sampling schedule (the
    # high-noise end; the authors' configs: 5 or 7 of 10, i.e. trunc_steps + 1); 0 = every level.
    dgpo_noise_levels: Annotated[int, at_least(0, "0 = every level")] = 0


@register
class DGPO(ForwardProcessObjective):
    """DGPO: ODE rollouts by the current weights; ``train.noise_draws`` noising draws per group
    and minibatch (one loss term each), shared by a group's samples; a minibatch holds whole
    groups. The group preference compares the policy's and the reference's flow-matching errors."""

    name = "dgpo"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, DGPOOptions)
    per_reward_advantages = True  # summed with the reward weights

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size  # a group trains together, on one draw

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            whole_groups_rule(config, "dgpo"),
            ("train.group_size", t.group_size >= 2, "must be at least 2 for dgpo (a group preference needs two)"),
            ("train.dgpo_beta", t.dgpo_beta > 0, "must be > 0"),
            ("train.dgpo_noise_levels", t.dgpo_noise_levels == 0
             or t.noise_draws <= t.dgpo_noise_levels <= config.sampling.num_steps,
             f"must be 0 (every level) or between train.noise_draws ({t.noise_draws}) and sampling.num_steps "
             f"({config.sampling.num_steps}), got {t.dgpo_noise_levels}"),
            ("model.lora_rank", config.model.lora_rank > 0 or t.kl_beta > 0,
             "must be > 0 for dgpo: its reference is the adapter with the LoRA disabled (full fine-tuning keeps "
             "a reference copy only with train.kl_beta > 0)"),
        ]

    def levels(self, batch) -> int:
        """The timestep clip: draws among the first train.dgpo_noise_levels schedule levels (0: all)."""
        return self.config.train.dgpo_noise_levels or super().levels(batch)

    def loss(self, mb, j):
        """DGPO on one noising draw shared by each group of the minibatch (whole groups, in order)."""
        ctx, t, cond = self.ctx, self.config.train, mb.traj.cond
        x0, x_t, _, timestep, eps = self.noised(mb, j)
        v_ref = ctx.predict(x_t, timestep, cond, policy="ref")
        v_theta = ctx.predict(x_t, timestep, cond)
        mse_ref, mse_theta = flow_matching_error(v_ref, eps - x0), flow_matching_error(v_theta, eps - x0)
        adv = ctx.scalarise(mb.advantages)
        adv = torch.where(mb.valid, adv, torch.zeros_like(adv))  # samples without a reward get weight 0
        kl = velocity_kl(v_theta, v_ref) if t.kl_beta > 0 else None
        k = t.group_size
        return dgpo_loss(mse_theta.view(-1, k), mse_ref.view(-1, k), adv.view(-1, k), beta=t.dgpo_beta,
                         kl=None if kl is None else kl.view(-1, k), kl_beta=t.kl_beta, weight=mb.valid.view(-1, k))
