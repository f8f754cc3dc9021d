"""DiffusionNFT: online RL on the forward (noising) process, CFG-free, with any sampler.

Rollouts keep only their final samples x0 (any solver: the log-probabilities of the sampler are
never used). Per sample (``../shared/METHODS.md`` §3):

    r      = clip(A / A_max, −1, 1) / 2 + 1/2 ∈ [0, 1]        (the "optimality probability")
    x_t    = (1 − t)·x0 + t·ε                                   (fresh t and ε)
    v⁺     = β·v_θ + (1 − β)·v_old,    v⁻ = (1 + β)·v_old − β·v_θ
    x̂0(v)  = x_t − t·v
    L      = [r·‖x̂0(v⁺) − x0‖² / w⁺ + (1 − r)·‖x̂0(v⁻) − x0‖² / w⁻] / β  +  λ·‖v_θ − v_ref‖²
    w±     = mean|x̂0(v±) − x0|, detached (adaptive weight)

v_old is a slowly moving copy of the trained weights (the "old" policy, which also samples the
rollouts); its gradient is stopped. Minimising the positive term pulls the implicit positive
policy toward good samples, the negative term pushes the implicit negative policy toward bad ones,
and since v⁻ moves opposite to v_θ this drives v_θ away from them. With r ≡ 1 and β = 1 the loss
is flow-matching regression of v_θ onto the samples (weighted by t² / w⁺).
"""

from __future__ import annotations

import torch
from flowalign.domains import Annotated, above, at_least, between


def optimality_probability(advantages: torch.Tensor, advantage_max: float) -> torch.Tensor:
    """r = clip(A / A_max, −1, 1) / 2 + 1/2. advantages: [B] → [B] in [0, 1]."""
    return (advantages / advantage_max).clamp(-1.0, 1.0) / 2 + 0.5


def weighted_error(x0_hat: torch.Tensor, x0: torch.Tensor, masks: torch.Tensor | None = None,
                   elem_weight: torch.Tensor | None = None) -> torch.Tensor:
    """mean ‖x̂0 − x0‖² / detached mean|x̂0 − x0|, both means over all elements, the squared errors
    weighted by ``elem_weight``. x0_hat, x0, elem_weight: [B, ...] → [B]. With ``masks`` (bool
    [M, ...], M parts partitioning one sample's elements) the numerator is split by part: [B, M],
    summing over M to the unsplit error. The normaliser stays the whole sample's, so a part with no
    error (the waiting stream of a video-first sample) takes no weight from the others."""
    err = (x0_hat.float() - x0.float()).flatten(1)
    sq = err**2 if elem_weight is None else elem_weight.float().flatten(1) * err**2
    scale = err.detach().abs().mean(1).clamp(min=1e-5)  # [B]
    if masks is None:
        return sq.mean(1) / scale
    return sq @ masks.flatten(1).to(sq.dtype).T / sq.shape[1] / scale[:, None]


def diffusion_nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of one noising draw for a minibatch.

    v_theta (with grad), v_old, v_ref, x_t, x0: [B, ...]; t: [B] noise level σ ∈ (0, 1];
    r: [B] optimality probability; weight: [B] in {0, 1} (samples that train; all when None).
    ``v_ref`` (the reference policy's velocity) is needed when ``kl_beta`` > 0. The loss is the
    weighted mean over samples. Returns (loss scalar, stats: policy_loss, positive, negative, kl, r).
    """
    if beta <= 0:
        raise ValueError(f"DiffusionNFT needs beta > 0, got {beta}")
    weight = torch.ones_like(r) if weight is None else weight.float()
    denom = weight.sum().clamp(min=1.0)
    v_old = v_old.detach().float()
    v_theta32 = v_theta.float()
    t = t.float().reshape(-1, *([1] * (x_t.ndim - 1)))
    x_t, x0 = x_t.float(), x0.float()
    positive = weighted_error(x_t - t * (beta * v_theta32 + (1 - beta) * v_old), x0)
    negative = weighted_error(x_t - t * ((1 + beta) * v_old - beta * v_theta32), x0)
    per_sample = (r * positive + (1 - r) * negative) / beta
    policy_loss = (per_sample * weight).sum() / denom
    loss = policy_loss
    kl = torch.zeros((), device=v_theta.device)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs v_ref")
        kl = (((v_theta32 - v_ref.detach().float()) ** 2).flatten(1).mean(1) * weight).sum() / denom
        loss = loss + kl_beta * kl
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(),
                 "nft_positive": (positive * weight).sum() / denom,
                 "nft_negative": (negative * weight).sum() / denom, "nft_r": (r * weight).sum() / denom}
    return loss, stats


def old_policy_decay(epoch: int, rate: float, maximum: float) -> float:
    """Ramped EMA decay of the old policy after ``epoch`` (0-based): min(maximum, rate·epoch).
    Decay 0 makes the old policy the current one (on-policy); the ramp slows it down later."""
    return min(maximum, rate * epoch)


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class NFTOptions:
    """``train.*`` options of method diffusion_nft."""

    nft_beta: Annotated[float, above(0)] = 1.0  # β: how far the implicit positive / negative policies sit from the old one
    nft_old_decay_rate: Annotated[float, at_least(0)] = 0.001  # the old policy's EMA decay after epoch e: min(max, rate·e)
    nft_old_decay_max: Annotated[float, between(0, 1)] = 0.5
    # every sample of a group gets the same noising draws (σ and ε) and a group trains in one
    # minibatch: common random numbers. The NFT gradient is Σ_i (2r_i − 1)·(x0_i − x̂0_i), and the ε
    # part of x̂0 is then shared, so it cancels against the group's centred r instead of adding noise.
    nft_shared_noising: bool = False


@register
class DiffusionNFT(ForwardProcessObjective):
    """DiffusionNFT: ODE (or any) rollouts sampled by the old policy; ``train.noise_draws``
    noising draws per sample and minibatch, one loss term each. The old policy is an EMA of the
    trained weights whose decay ramps per epoch (``old_policy_decay``); it is this objective's
    checkpointed state. ``head``: an optional replacement of the loss given (v_old, v_ref), for
    wrappers (flowalign/experimental/routing.py)."""

    name = "diffusion_nft"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, NFTOptions)

    def __init__(self, ctx):
        super().__init__(ctx)
        t = self.config.train
        self.unit = t.group_size if t.nft_shared_noising else 1  # samples sharing draws train together
        self.old = EMA(ctx.params, 0.0)  # samples the rollouts and anchors v⁺ / v⁻
        self.head = None

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            ("train.nft_beta", t.nft_beta > 0, "must be > 0"),
            ("train.nft_old_decay_max", 0 <= t.nft_old_decay_max < 1, "must be in [0, 1)"),
            ("train.train_batch_size", not t.nft_shared_noising or t.train_batch_size % t.group_size == 0,
             "must be a multiple of train.group_size for gdro and train.nft_shared_noising (a minibatch holds whole "
             "groups)"),
        ]

    def sampling_weights(self):
        return self.old.swapped_in()

    def loss(self, batch, idx, j, adv, valid):
        """DiffusionNFT on one noising draw per sample of minibatch ``idx``."""
        ctx, t = self.ctx, self.config.train
        sub, adv, weight = batch.traj[idx], adv[idx], valid[idx]
        x0, x_t, sigma, timestep, _ = self.noised(sub, idx, j)
        with torch.no_grad():  # before v_θ's forward: swapping the old weights in later would break its graph
            with self.old.swapped_in():
                v_old = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0)
            v_ref = None
            if t.kl_beta > 0:
                with ctx.adapter.reference():
                    v_ref = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0)
        if self.head is not None:
            return self.head(sub, x0, x_t, sigma, timestep, v_old, v_ref, adv, weight)
        v_theta = ctx.adapter.predict(x_t, timestep, sub.cond, 1.0, model=ctx.model)
        if adv.ndim == 2:  # one column per reward: r follows their weighted sum
            adv = adv @ ctx.reward_weights.to(adv)
        return diffusion_nft_loss(v_theta, v_old, x_t, x0, sigma, optimality_probability(adv, t.advantage_clip),
                                  beta=t.nft_beta, v_ref=v_ref, kl_beta=t.kl_beta, weight=weight)

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        t = self.config.train
        self.old.decay = old_policy_decay(epoch, t.nft_old_decay_rate, t.nft_old_decay_max)
        self.old.update()
        return {"train/old_decay": self.old.decay}

    def components(self) -> dict:
        return {"old": self}  # old.safetensors: the old policy's weights

    def state_dict(self) -> dict:
        return self.old.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.old.load_state_dict(state)
