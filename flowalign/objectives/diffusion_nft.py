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

from flowalign.objectives.base import plus_velocity_kl, weighted_mean


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


def implicit_errors(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
                    beta: float, masks: torch.Tensor | None = None,
                    elem_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weighted_error`` of the implicit positive and negative policies' x̂0 (v⁺ = β·v_θ + (1 − β)·v_old,
    v⁻ = (1 + β)·v_old − β·v_θ; v_old detached). v_theta, v_old, x_t, x0: [B, ...]; t: [B] σ. Returns
    ([B], [B]), or ([B, M], [B, M]) split by the parts of ``masks`` (``weighted_error``)."""
    v_old = v_old.detach().float()
    v_theta32 = v_theta.float()
    t = t.float().reshape(-1, *([1] * (x_t.ndim - 1)))
    x_t, x0 = x_t.float(), x0.float()
    positive = weighted_error(x_t - t * (beta * v_theta32 + (1 - beta) * v_old), x0, masks, elem_weight)
    negative = weighted_error(x_t - t * ((1 + beta) * v_old - beta * v_theta32), x0, masks, elem_weight)
    return positive, negative


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
    masks: torch.Tensor | None = None,
    elem_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of one noising draw for a minibatch.

    v_theta (with grad), v_old, v_ref, x_t, x0: [B, ...]; t: [B] noise level σ ∈ (0, 1];
    r: [B] optimality probability; weight: [B] in {0, 1} (samples that train; all when None).
    ``v_ref`` (the reference policy's velocity) is needed when ``kl_beta`` > 0. With ``masks``
    (bool [M, ...] partitioning a sample's elements: the branches of a joint audio-video latent)
    r is [B, M], one optimality probability per part: each part's squared errors take its r, and the
    adaptive weight stays the whole sample's (``weighted_error``), so the same r on every part gives
    the unsplit loss. ``elem_weight`` [B, ...]: weights of the squared errors (routing's token
    weights). The loss is the weighted mean over samples.
    Returns (loss scalar, stats: policy_loss, nft_positive, nft_negative, kl, nft_r).
    """
    if beta <= 0:
        raise ValueError(f"DiffusionNFT needs beta > 0, got {beta}")
    if masks is not None and not torch.equal(masks.sum(0), torch.ones_like(masks[0], dtype=masks.sum(0).dtype)):
        raise ValueError("masks must partition the latent elements")
    weight = torch.ones(r.shape[0], device=r.device) if weight is None else weight.float()
    positive, negative = implicit_errors(v_theta, v_old, x_t, x0, t, beta, masks, elem_weight)
    per_sample = r * positive + (1 - r) * negative
    if masks is not None:  # [B, M]: the parts summed
        per_sample, positive, negative, r = per_sample.sum(1), positive.sum(1), negative.sum(1), r.mean(1)
    per_sample = per_sample / beta
    policy_loss = weighted_mean(per_sample, weight)
    loss, kl = plus_velocity_kl(policy_loss, v_theta, v_ref, kl_beta, weight)
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(),
                 "nft_positive": weighted_mean(positive, weight), "nft_negative": weighted_mean(negative, weight),
                 "nft_r": weighted_mean(r, weight)}
    return loss, stats


def old_policy_decay(epoch: int, rate: float, maximum: float) -> float:
    """Ramped EMA decay of the old policy after ``epoch`` (0-based): min(maximum, rate·epoch).
    Decay 0 makes the old policy the current one (on-policy); the ramp slows it down later."""
    return min(maximum, rate * epoch)


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register, whole_groups_rule  # noqa: E402
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
    checkpointed state. Per-reward advantages are summed with the reward weights; a subclass may
    split the loss by parts of the latent (``parts``: flowalign/experimental/routing.py)."""

    name = "diffusion_nft"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, NFTOptions)
    per_reward_advantages = True

    def __init__(self, ctx):
        super().__init__(ctx)
        t = self.config.train
        self.unit = t.group_size if t.nft_shared_noising else 1  # samples sharing draws train together
        self.old = EMA(ctx.params, 0.0)  # samples the rollouts and anchors v⁺ / v⁻

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        rules = super().validate(config) + [
            ("train.nft_beta", t.nft_beta > 0, "must be > 0"),
            ("train.nft_old_decay_max", 0 <= t.nft_old_decay_max < 1, "must be in [0, 1)"),
        ]
        return rules + [whole_groups_rule(config, "train.nft_shared_noising")] if t.nft_shared_noising else rules

    def sampling_weights(self):
        return self.old.swapped_in()

    def predict_theta(self, x_t: torch.Tensor, timestep: torch.Tensor, cond) -> torch.Tensor:
        """v_θ at x_t (with grad)."""
        return self.ctx.predict(x_t, timestep, cond)

    def parts(self, mb, x0, x_t, sigma, v_theta, v_old):
        """(r [b], None, None): one optimality probability per sample, from the advantages summed
        with the reward weights; a subclass returns (r [b, M], masks [M, ...], element weights)."""
        return optimality_probability(self.ctx.scalarise(mb.advantages), self.config.train.advantage_clip), None, None

    def loss(self, mb, j):
        """DiffusionNFT on one noising draw per sample of the minibatch."""
        ctx, t, cond = self.ctx, self.config.train, mb.traj.cond
        x0, x_t, sigma, timestep, _ = self.noised(mb, j)
        # v_old and v_ref before v_θ's forward: swapping weights in later would break its graph
        v_old = ctx.predict(x_t, timestep, cond, policy="old", weights=self.old)
        v_ref = ctx.predict(x_t, timestep, cond, policy="ref") if t.kl_beta > 0 else None
        v_theta = self.predict_theta(x_t, timestep, cond)
        r, masks, elem_weight = self.parts(mb, x0, x_t, sigma, v_theta, v_old)
        return diffusion_nft_loss(v_theta, v_old, x_t, x0, sigma, r, beta=t.nft_beta, v_ref=v_ref, kl_beta=t.kl_beta,
                                  weight=mb.valid, masks=masks, elem_weight=elem_weight)

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
