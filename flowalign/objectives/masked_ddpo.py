"""DDPO for masked discrete diffusion (the chess world): PPO over unmasking steps, a KL to the
reference policy, an entropy bonus, and a leave-one-out group baseline (METHODS §3).

Per recorded step x_s → x_{s+1} of a sample, with U the positions the step newly unmasked and
π(· | x_s, ℓ) = softmax(logits_ℓ / τ) each position's categorical (``pipelines/unmasking.py``):

    log p_θ = Σ_{ℓ∈U} log π_θ(x_{s+1,ℓ} | x_s, ℓ)            (the unmasking plan cancels)
    ratio   = exp(log p_θ − log p_old)
    L_clip  = max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε))
    KL      = Σ_{ℓ∈U} Σ_v π_θ(v) (log π_θ(v) − log π_ref(v))   (exact, categorical vs categorical)
    H       = Σ_{ℓ∈U} −Σ_v π_θ(v) log π_θ(v)
    L       = mean over samples of (L_clip + β·KL − c_H·H)

KL and H are **summed** over U like the log-prob: the step's distribution factorises over its
positions, so these are the KL and entropy of the whole step. The ratio is per step, not per
token (a per-token clip would be a different objective). The trainer sums L over steps by
gradient accumulation. METHODS: β ≈ 0.1, c_H ≈ 0.2, groups of 16.
"""

from __future__ import annotations

import torch

from flowalign.objectives.base import weighted_mean
from pipelines.unmasking import score_step


def _probs_and_finite_log_probs(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(π, log π with 0 at disallowed tokens). Zeroing *before* any product keeps 0·(−∞) out of
    both the value and the gradient (a ``where`` after the product still back-propagates NaN)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.exp(), torch.where(torch.isfinite(log_p), log_p, torch.zeros_like(log_p))


def categorical_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(π ‖ π_ref) per position. logits, ref_logits: [B, L, V] (−inf = disallowed, the same
    tokens in both); returns [B, L] (0·log 0 taken as 0)."""
    p, log_p = _probs_and_finite_log_probs(logits, temperature)
    _, log_q = _probs_and_finite_log_probs(ref_logits, temperature)
    return (p * (log_p - log_q)).sum(-1)


def categorical_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H(π) per position. logits: [B, L, V] → [B, L] (0·log 0 taken as 0)."""
    p, log_p = _probs_and_finite_log_probs(logits, temperature)
    return -(p * log_p).sum(-1)


def masked_ddpo_loss(
    logits: torch.Tensor,
    next_tokens: torch.Tensor,
    unmask: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    ref_logits: torch.Tensor | None = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The masked-DDPO loss of one step for a minibatch.

    logits: [B, L, V] of the policy at x_s (with grad); next_tokens: long [B, L] = x_{s+1};
    unmask: bool [B, L] the step's newly unmasked positions; old_log_prob: [B] recorded at
    sampling; advantages: [B]; ref_logits: [B, L, V] of the reference at x_s (needed when β > 0);
    temperature: the τ the rollout sampled with; weight: [B] in {0, 1}, which samples train this
    step (default: those whose step unmasks at least one position; a step that unmasks nothing
    has no gradient). The loss is the weighted mean over samples. Returns (loss scalar, stats:
    policy_loss, kl, entropy, ratio, clipfrac, approx_kl).
    """
    weight = unmask.any(-1).float() if weight is None else weight.float()

    def mean(values: torch.Tensor) -> torch.Tensor:
        return weighted_mean(values, weight)

    log_prob = score_step(logits, next_tokens, unmask, temperature=temperature).log_prob
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = mean(torch.maximum(-advantages * ratio, -advantages * clipped))
    zero = torch.zeros_like(unmask, dtype=torch.float32)
    entropy = mean(torch.where(unmask, categorical_entropy(logits, temperature), zero).sum(-1))
    loss = policy_loss - entropy_coef * entropy
    kl = torch.zeros((), device=logits.device)
    if beta > 0:
        if ref_logits is None:
            raise ValueError("beta > 0 needs ref_logits (the reference policy's logits at the same state)")
        kl = mean(torch.where(unmask, categorical_kl(logits, ref_logits, temperature), zero).sum(-1))
        loss = loss + beta * kl
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(), "kl": kl.detach(), "entropy": entropy.detach(),
            "ratio": mean(ratio), "clipfrac": mean(((ratio - 1).abs() > clip_range).float()),
            "approx_kl": mean(0.5 * (log_prob - old_log_prob) ** 2),
        }
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.objectives.base import BaseObjective, register  # noqa: E402
from flowalign.domains import Annotated, finite  # noqa: E402


@dataclass
class MaskedDDPOOptions:
    entropy_coef: Annotated[float, finite()] = 0.0  # entropy bonus (train.entropy_coef): L − c_H·H of each step's categoricals


def masked_trained_steps(num_steps: int, schedule: str, length: int) -> list[int]:
    """The unmasking steps that unmask at least one position of a fully masked sequence of
    ``length`` (the family's ``sequence_length``; the trainer's rollouts: prompts carry no partial
    state, so every sample follows these counts); a step that unmasks nothing (e.g. the first
    cosine step) has no log-prob to train."""
    from pipelines.unmasking import unmask_counts

    counts = unmask_counts(torch.tensor([length]), num_steps, schedule)[0]
    return [j for j in range(num_steps) if counts[j + 1] > counts[j]]


@register
class MaskedDDPO(BaseObjective):
    """DDPO over unmasking steps (``method: ddpo`` on a masked-diffusion family, e.g. chess): the
    policy's logits at each recorded state rescore the tokens the step drew (at the rollout's
    temperature); the reference (LoRA off, or the frozen copy) gives the KL's other side. One loss
    term per unmasking step that unmasks a position."""

    name = "ddpo"
    rollout = "unmasking"
    predictions = ("logits",)
    options = (MaskedDDPOOptions,)
    progress = ("clipfrac",)

    def __init__(self, ctx):
        super().__init__(ctx)
        s = self.config.sampling
        self.steps = masked_trained_steps(s.num_steps, s.unmask_schedule, ctx.adapter.sequence_length)

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        return [("sampling.eta", config.sampling.eta > 0,
                 "must be > 0 to train with log-probabilities (η = 0 is ODE sampling; diffusion_nft and gdro allow it)"),
                ("train.entropy_coef", config.train.entropy_coef >= 0, "must be ≥ 0")]

    @classmethod
    def sampler_text(cls, config, prediction: str) -> str:
        s = config.sampling
        return (f"unmasking steps ({s.unmask_schedule} schedule, temperature {s.temperature:g}), {s.num_steps} steps, "
                f"CFG {s.guidance_scale:g}")

    @classmethod
    def validate_family(cls, config) -> list[tuple[str, bool, str]]:
        """What masked discrete diffusion does not support."""
        return [
            ("sampling.step_mode", config.sampling.step_mode == "all",
             "must be all for masked diffusion (every unmasking step is sampled from the policy and trained)"),
        ]

    @classmethod
    def num_terms(cls, config) -> int:
        from pipelines import adapter_class

        s = config.sampling
        length = adapter_class(config.model.family).sequence_length
        return len(masked_trained_steps(s.num_steps, s.unmask_schedule, length))

    def terms(self, batch) -> list[int]:
        return self.steps

    def loss(self, mb, j):
        t, s, sub = self.config.train, self.config.sampling, mb.traj
        x = sub.states[:, j]
        logits = self.ctx.predict(x, None, sub.cond, s.guidance_scale)
        ref_logits = self.ctx.predict(x, None, sub.cond, s.guidance_scale, policy="ref") if t.kl_beta > 0 else None
        return masked_ddpo_loss(logits, sub.states[:, j + 1], sub.unmask[:, j], sub.log_probs[:, j], mb.advantages,
                                clip_range=t.clip_range, ref_logits=ref_logits, beta=t.kl_beta,
                                entropy_coef=t.entropy_coef, temperature=s.temperature,
                                weight=sub.trained[:, j] & mb.valid)
