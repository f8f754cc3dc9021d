"""AWM: Advantage Weighted Matching (Xue et al., arXiv 2509.25050), on the forward process.

The paper's analysis: DDPO / Flow-GRPO's per-step likelihood of x_{t−1} is denoising score / flow
matching whose target is computed from a noisy x_{t−1} instead of x0, so its gradient has extra
variance. AWM keeps the pre-training loss exactly and lets the advantage decide how much each
sample counts. Rollouts keep only their final samples x0 (ODE solver: no log-probabilities). Per
sample, for a noising draw (σ, ε) (``../shared/METHODS.md`` notation):

    x_σ    = (1 − σ)·x0 + σ·ε,   v = ε − x0                          (the flow-matching pair)
    m_θ(x) = mean‖v_θ(x_σ, σ) − v‖²                                  (the pre-training error)
    ℓ_θ(x) = w(σ)·ρ(m_θ(x))                                          (ρ(m) = m: the pre-training loss)
    L      = mean_i A_i·ℓ_θ(x_i)  +  β·mean_i mean‖v_θ − v_ref‖²       (the AWM objective)
             [+ β_ema·mean_i mean‖v_θ − v_ema‖²: the authors' second KL, (iv) below; off by default]

ℓ_θ is, up to constants, −log p_θ(x0) through the flow-matching ELBO, so L is the policy gradient
E[A·∇log p_θ(x0)] with the ELBO in place of the log-likelihood. A positive advantage pulls v_θ toward
the sample's velocity (flow matching toward it), a negative one pushes it away. With A ≡ c > 0 the
loss is c times plain flow matching toward the rollouts. ``awm_loss`` implements L.

No equation numbers are cited: the form above is the abstract's ("the same score/flow-matching loss
as pretraining … reweights each sample by its advantage") as the authors' code computes it.

What the authors' code and SD3.5-M configs (scxue/advantage_weighted_matching, read, not copied)
do, term by term, and what we do:
(i) ratio: it wraps −ℓ_θ in Flow-GRPO's clipped ratio exp(ℓ_old − ℓ_θ), old = the weights of the
epoch's first minibatches, but its GenEval / OCR / PickScore configs set clip_range = 1 (clip to
[0, 2], in effect none); at ratio 1 that loss has exactly our gradient A·∇ℓ_θ, and we do not clip.
(ii) the loss ρ: its configs set weighting 'ghuber' with power p = 0.25, a generalised Huber loss of
the per-sample error, ρ(m) = ((m + ε)^p − ε^p)/p with ε = 1e-10 (its code's default is 'Uniform',
ρ(m) = m); ∇ρ = (m + ε)^(p−1)·∇m, so samples the model already fits well weigh more and outliers
less. ``train.awm_loss: ghuber`` with ``train.awm_ghuber_power`` (0.25) is that form (p = 1 gives
the MSE exactly; its 'huber' is ghuber at p = 0.5, halved). Our default stays "mse", the paper's
stated pre-training loss.
(iii) the time weight w: 'ghuber' multiplies by t (= σ); so does its 't' weighting.
``train.awm_time_weighting``: "uniform" (w = 1, default) or "sigma" (w = σ). The authors' SD3.5
setting is awm_loss: ghuber, awm_time_weighting: sigma.
(iv) reference KL: β·mean‖v_θ − v_ref‖² to the LoRA-disabled model (its 'Uniform' kl_weight), β =
0.001 (GenEval, after its last commit), 0.003 (OCR), 1e-4 (PickScore); ``train.kl_beta`` here (our
shapes recipe keeps 0, as every shapes recipe). Its configs add a second such term with weight
ema_beta = 1 toward an EMA copy of the policy (a second LoRA) updated once per epoch with decay
min(0.3, 0.001·optimizer steps): ``train.awm_ema_beta`` (default 0, off) and ``train.awm_ema_decay``
(0.3), the copy kept by this objective and checkpointed.
(v) timesteps: its configs train 6 of the sampler's discrete steps per sample, stratified over the
first 90 % and (GenEval, OCR) skipping the first; we draw ``train.noise_draws`` distinct schedule
steps per sample per update, uniformly, as DiffusionNFT.
(vi) it clips advantages to ±5 and rescales them to ±1 (advantage_max 1), a constant factor (the
learning rate's).

Further decisions: each sample draws its own σ and ε (no sharing across a group); samples with a
NaN reward (``valid`` false) are left out of the mean.
"""

from __future__ import annotations

import torch
from flowalign.domains import Annotated, above, at_least, between

from flowalign.objectives.base import flow_matching_error, plus_velocity_kl, weighted_mean

GHUBER_EPS = 1e-10  # ε of the authors' generalised Huber loss (float64 there, as here)


def ghuber(error: torch.Tensor, power: float) -> torch.Tensor:
    """The authors' generalised Huber loss ρ(m) = ((m + ε)^p − ε^p) / p of per-sample errors m [B]
    (p = 1: m itself). Computed in float64, where ε = 1e-10 is not lost against m; returns [B] float32."""
    m = error.double()
    return (((m + GHUBER_EPS) ** power - GHUBER_EPS**power) / power).float()


def awm_loss(
    v_theta: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    *,
    time_weight: torch.Tensor | None = None,
    ghuber_power: float | None = None,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    v_ema: torch.Tensor | None = None,
    ema_beta: float = 0.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AWM loss L of one noising draw for a minibatch.

    v_theta (with grad), target (v = ε − x0), v_ref: [B, ...]; advantages: [B]; time_weight: [B]
    w(σ) (1 when None); ghuber_power: p of ρ = ``ghuber`` (ρ(m) = m when None); weight: [B] in
    {0, 1}, the samples that train (all when None). The flow-matching error m is the mean over all
    non-batch elements; the loss is the weighted mean over samples of A·w·ρ(m), plus
    kl_beta·mean‖v_θ − v_ref‖² (needs v_ref when kl_beta > 0) and ema_beta·mean‖v_θ − v_ema‖² (v_ema
    [B, ...], the EMA policy's velocity; needed when ema_beta > 0).
    Returns (loss scalar, stats: policy_loss, kl, awm_fm (the unweighted flow-matching error m), and
    ema_kl when ema_beta > 0).
    """
    weight = torch.ones_like(advantages, dtype=torch.float32) if weight is None else weight.float()
    fm = flow_matching_error(v_theta, target)  # [B]
    per_sample = fm if ghuber_power is None else ghuber(fm, ghuber_power)
    tw = torch.ones_like(fm) if time_weight is None else time_weight.float()
    policy_loss = weighted_mean(advantages.float() * tw * per_sample, weight)
    loss, kl = plus_velocity_kl(policy_loss, v_theta, v_ref, kl_beta, weight)
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "awm_fm": weighted_mean(fm, weight)}
    if ema_beta > 0:
        loss, ema_kl = plus_velocity_kl(loss, v_theta, v_ema, ema_beta, weight, name="ema_beta", target="v_ema")
        stats["ema_kl"] = ema_kl.detach()
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402

AWM_TIME_WEIGHTINGS = ("uniform", "sigma")
AWM_LOSSES = ("mse", "ghuber")


@dataclass
class AWMOptions:
    """``train.*`` options of method awm."""

    # w(σ) of the matching loss: "uniform" is the pre-training flow-matching loss the paper keeps
    # (its abstract: "the same score/flow-matching loss as pretraining"; the authors' code's default
    # weighting 'Uniform'); "sigma" is that code's 't' (their SD3.5 configs' 'ghuber' includes it).
    awm_time_weighting: str = "uniform"
    # ρ of each sample's error m: "mse" (ρ(m) = m, the pre-training loss) or "ghuber", the authors'
    # SD3.5 configs' generalised Huber ((m + 1e-10)^p − 1e-10^p)/p with p = train.awm_ghuber_power.
    awm_loss: str = "mse"
    # p of awm_loss: ghuber (read only then): the authors' configs use 0.25; 1 is the MSE.
    awm_ghuber_power: Annotated[float, above(0)] = 0.25
    # Weight of the authors' second KL, mean‖v_θ − v_ema‖² toward an EMA copy of the policy (their
    # SD3.5 configs: 1.0); 0 = off. The EMA is checkpointed and updated once per epoch.
    awm_ema_beta: Annotated[float, at_least(0)] = 0.0
    # Cap of that EMA's decay; the decay used at an epoch's end is min(cap, 0.001·optimizer steps so
    # far), the authors' linear ramp (their configs: 0.3).
    awm_ema_decay: Annotated[float, between(0, 1)] = 0.3


@register
class AWM(ForwardProcessObjective):
    """AWM: ODE rollouts by the current weights; ``train.noise_draws`` noising draws per sample
    and minibatch (one loss term each), each sample's flow-matching loss weighted by its
    advantage; a velocity KL to the reference when ``train.kl_beta`` > 0, and one to an EMA of the
    policy (kept, checkpointed, averaged at each epoch's end) when ``train.awm_ema_beta`` > 0."""

    name = "awm"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, AWMOptions)
    per_reward_advantages = True  # summed with the reward weights
    EMA_RAMP = 0.001  # the authors' decay ramp per optimizer step

    def __init__(self, ctx):
        super().__init__(ctx)
        # the second KL's target: a copy of the weights, averaged once per epoch (train.awm_ema_beta > 0)
        self.ema = EMA(ctx.params, 0.0) if self.config.train.awm_ema_beta > 0 else None
        self.stateful = self.ema is not None
        self.steps = 0  # optimizer steps taken so far (after_step)

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            ("train.awm_time_weighting", t.awm_time_weighting in AWM_TIME_WEIGHTINGS,
             f"must be one of {', '.join(AWM_TIME_WEIGHTINGS)}, got {t.awm_time_weighting!r}"),
            ("train.awm_loss", t.awm_loss in AWM_LOSSES, f"must be one of {', '.join(AWM_LOSSES)}, got {t.awm_loss!r}"),
            ("train.awm_ghuber_power", t.awm_ghuber_power > 0, f"must be > 0, got {t.awm_ghuber_power}"),
            ("train.awm_ema_beta", t.awm_ema_beta >= 0, f"must be ≥ 0, got {t.awm_ema_beta}"),
            ("train.awm_ema_decay", 0 <= t.awm_ema_decay < 1, f"must be in [0, 1), got {t.awm_ema_decay}"),
        ]

    def loss(self, mb, j):
        """AWM on one noising draw per sample of the minibatch."""
        ctx, t, cond = self.ctx, self.config.train, mb.traj.cond
        x0, x_t, sigma, timestep, eps = self.noised(mb, j)
        v_ref = ctx.predict(x_t, timestep, cond, policy="ref") if t.kl_beta > 0 else None
        # before θ's forward: swapping weights in later would break its graph
        v_ema = ctx.predict(x_t, timestep, cond, policy="old", weights=self.ema) if self.ema is not None else None
        v_theta = ctx.predict(x_t, timestep, cond)
        time_weight = sigma.float() if t.awm_time_weighting == "sigma" else None
        power = t.awm_ghuber_power if t.awm_loss == "ghuber" else None
        return awm_loss(v_theta, eps - x0, ctx.scalarise(mb.advantages), time_weight=time_weight, ghuber_power=power,
                        v_ref=v_ref, kl_beta=t.kl_beta, v_ema=v_ema, ema_beta=t.awm_ema_beta, weight=mb.valid)

    def after_step(self) -> None:
        self.steps += 1  # the EMA's decay ramp counts optimizer steps taken

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        if self.ema is None:
            return {}
        self.ema.decay = min(self.config.train.awm_ema_decay, self.EMA_RAMP * self.steps)
        self.ema.update()
        return {"train/awm_ema_decay": self.ema.decay}

    def state_dict(self) -> dict:
        return {**self.ema.state_dict(), "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state)
        self.steps = int(state["steps"])
