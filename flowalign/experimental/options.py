"""The config sections of the experimental extras (``explore:``, ``routing:``), joined into
``flowalign.config.RunConfig``; their rules are ``flowalign.experimental.rules``."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowalign.domains import COUNT, Annotated, above, at_least, between


@dataclass
class ExploreConfig:
    # EXPLORENET (flowalign/experimental/explorenet.py): none (isotropic) | shape (learned per-element std, total fixed) |
    # magnitude (learned per-step scale only: the ablation) | both
    mode: str = "none"
    learning_rate: Annotated[float, above(0)] = 1e-3  # Adam learning rate of the exploration net
    hidden: Annotated[int, COUNT] = 32  # hidden width of the exploration net


@dataclass
class RoutingConfig:
    """DiffusionNFT on joint audio-video models (flowalign/experimental/av_routing.py); needs
    method diffusion_nft, an audio_video family and train.per_reward_advantages."""

    # (ii) each reward trains the branches it concerns (component → [video] | [audio] | [video, audio];
    # unnamed components: both), with residual corrections of the weights after `warmup` epochs
    reweight: bool = False
    concerns: dict[str, list[str]] = field(default_factory=dict)  # component → the branches it trains
    warmup: Annotated[int, at_least(0)] = 5  # epochs before the residual corrections start
    strength: Annotated[float, at_least(0)] = 1.0  # residual step: ρ ← clip(ρ + strength·(threshold − cos), 0, max_residual)
    threshold: Annotated[float, between(-1, 1)] = 0.3  # the gradient cosine each routed reward should keep (av_routing.py)
    max_residual: Annotated[float, at_least(0)] = 4.0  # upper bound of a residual ρ
    gram_decay: Annotated[float, between(0, 1)] = 0.9  # EMA of the reward-gradient Gram over epochs
    # reward floors: after warm-up a reward whose training mean falls below its warm-up mean gains a
    # Lagrange multiplier λ_k (step floor_strength per warm-up std of shortfall, at most floor_max); 0 = off
    floor_strength: Annotated[float, at_least(0, "0 = off")] = 1.0
    floor_max: Annotated[float, at_least(0)] = 10.0  # upper bound of a floor multiplier λ
    # with floors on: a reward at or above its floor (not suppressed in outcome) gains no residual
    # from a low gradient cosine; its residual can only decay (the weight goes to rewards that fall)
    floor_gates_residual: bool = False
    # with floors on, while a reward is below its floor (λ > 0), the other rewards of the branches it
    # trains get weight 0 there (a CRPO-style priority): none | all | conflicts (only those whose gradient
    # opposes it there: a negative reward-gradient interaction)
    floor_gate: str = "none"
    # (i) cross-modal influence: per-token loss weights (u / mean u)^token_alpha and gradient scales
    # of the cross-modal attention modules clip(u_l / mean u, layer_scale_min, layer_scale_max)
    influence: bool = False
    token_alpha: Annotated[float, at_least(0)] = 1.0  # exponent of the per-token loss weights
    layer_scale_min: Annotated[float, above(0)] = 0.25  # lower clip of the layers' gradient scales
    layer_scale_max: Annotated[float, above(0)] = 4.0  # upper clip of the layers' gradient scales
