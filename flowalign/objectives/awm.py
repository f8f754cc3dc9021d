"""AWM: Advantage Weighted Matching (Xue et al., arXiv 2509.25050), on the forward process.

The paper's analysis: DDPO / Flow-GRPO's per-step likelihood of x_{t−1} is denoising score / flow
matching whose target is computed from a noisy x_{t−1} instead of x0, so its gradient has extra
variance. AWM keeps the pre-training loss exactly and lets the advantage decide how much each
sample counts. Rollouts keep only their final samples x0 (ODE solver: no log-probabilities). Per
sample, for a noising draw (σ, ε) (``../shared/METHODS.md`` notation):

    x_σ    = (1 − σ)·x0 + σ·ε,   v = ε − x0                          (the flow-matching pair)
    ℓ_θ(x) = w(σ)·mean‖v_θ(x_σ, σ) − v‖²                              (the pre-training loss)
    L      = mean_i A_i·ℓ_θ(x_i)  +  β·mean_i mean‖v_θ − v_ref‖²       (the AWM objective)

ℓ_θ is, up to constants, −log p_θ(x0) through the flow-matching ELBO, so L is the policy gradient
E[A·∇log p_θ(x0)] with the ELBO in place of the log-likelihood (the paper's objective; we could not
check its equation numbers against the paper text, so none are cited). A positive advantage pulls
v_θ toward the sample's velocity (flow matching toward it), a negative one pushes it away. With
A ≡ c > 0 the loss is c times plain flow matching toward the rollouts.

What the authors' code and SD3.5-M configs (scxue/advantage_weighted_matching, read, not copied)
do beyond this, and what we do: (i) it wraps −ℓ_θ in Flow-GRPO's clipped ratio exp(ℓ_old − ℓ_θ),
old = the rollout weights, but its GenEval / OCR / PickScore configs set clip_range = 1 (no
effective clip); at ratio 1 that loss has exactly our gradient A·∇ℓ_θ, and we do not clip.
(ii) Reference / KL: β·mean‖v_θ − v_ref‖² to the LoRA-disabled model, β = 0.003 (GenEval, OCR) and
1e-4 (PickScore), plus a second such term toward an EMA of the policy, which we do not implement;
here ``train.kl_beta`` (our shapes recipe keeps 0, as every shapes recipe). (iii) Timesteps: its
configs train 6 of the sampler's discrete steps per sample, stratified over the first 90 % and
(GenEval, OCR) skipping the first; we draw ``train.noise_draws`` distinct schedule steps per sample
per update, uniformly, as DiffusionNFT. (iv) Weighting: its configs use a generalised-Huber
w(ℓ, t) = t·((ℓ + ε)^p − ε^p)/p, p = 0.25 (its code's default is uniform); ``train.awm_time_weighting``
offers "uniform" (w = 1) and "sigma" (w = σ, its "t"); the Huber forms are not implemented. (v) It
rescales the clipped advantages to ±1 (advantage_max 1), a constant factor (the learning rate's).

Further decisions: each sample draws its own σ and ε (no sharing across a group); samples with a
NaN reward (``valid`` false) are left out of the mean.
"""

from __future__ import annotations

import torch


def awm_loss(
    v_theta: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    *,
    time_weight: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AWM loss of one noising draw for a minibatch.

    v_theta (with grad), target (v = ε − x0), v_ref: [B, ...]; advantages: [B]; time_weight: [B]
    w(σ) (1 when None); weight: [B] in {0, 1}, the samples that train (all when None). The
    flow-matching error is the mean over all non-batch elements; the loss is the weighted mean over
    samples of A·w·error, plus kl_beta·mean‖v_θ − v_ref‖² (needs v_ref when kl_beta > 0).
    Returns (loss scalar, stats: policy_loss, kl, awm_fm (the unweighted flow-matching error)).
    """
    weight = torch.ones_like(advantages, dtype=torch.float32) if weight is None else weight.float()
    denom = weight.sum().clamp(min=1.0)
    fm = ((v_theta.float() - target.float()) ** 2).flatten(1).mean(1)  # [B]
    tw = torch.ones_like(fm) if time_weight is None else time_weight.float()
    policy_loss = (advantages.float() * tw * fm * weight).sum() / denom
    loss = policy_loss
    kl = torch.zeros((), device=v_theta.device)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs v_ref")
        kl = (((v_theta.float() - v_ref.detach().float()) ** 2).flatten(1).mean(1) * weight).sum() / denom
        loss = loss + kl_beta * kl
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "awm_fm": (fm * weight).sum() / denom}
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402

AWM_TIME_WEIGHTINGS = ("uniform", "sigma")


@dataclass
class AWMOptions:
    """``train.*`` options of method awm."""

    # w(σ) of the matching loss: "uniform" is the pre-training flow-matching loss the paper keeps
    # (its abstract: "the same score/flow-matching loss as pretraining"; the authors' code's default
    # weighting 'Uniform', their SD3.5 configs use a Huber form we lack); "sigma" is that code's 't'.
    awm_time_weighting: str = "uniform"


@register
class AWM(ForwardProcessObjective):
    """AWM: ODE rollouts by the current weights; ``train.noise_draws`` noising draws per sample
    and minibatch (one loss term each), each sample's flow-matching loss weighted by its
    advantage; a velocity KL to the reference when ``train.kl_beta`` > 0."""

    name = "awm"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, AWMOptions)

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            ("train.awm_time_weighting", t.awm_time_weighting in AWM_TIME_WEIGHTINGS,
             f"must be one of {', '.join(AWM_TIME_WEIGHTINGS)}, got {t.awm_time_weighting!r}"),
        ]

    def loss(self, batch, idx, j, adv, valid):
        """AWM on one noising draw per sample of minibatch ``idx``."""
        ctx, t = self.ctx, self.config.train
        sub, adv, weight = batch.traj[idx], adv[idx], valid[idx]
        x0, x_t, sigma, timestep, eps = self.noised(sub, idx, j)
        v_ref = None
        if t.kl_beta > 0:
            with torch.no_grad(), ctx.adapter.reference():
                v_ref = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0, model=ctx.reference_model)
        v_theta = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0, model=ctx.model)
        if adv.ndim == 2:  # one column per reward: the weighted sum
            adv = adv @ ctx.reward_weights.to(adv)
        time_weight = sigma.float() if t.awm_time_weighting == "sigma" else None
        return awm_loss(v_theta, eps - x0, adv, time_weight=time_weight, v_ref=v_ref, kl_beta=t.kl_beta,
                        weight=weight)
