"""Stochastic steps for rectified-flow models with exact per-step log-probabilities: Flow-GRPO's
SDE, CPS and DanceGRPO's SDE with and without its score term (``FLOW_SDE_STEPS``; all share one
signature).

Notation (``../shared/METHODS.md`` §1): x_σ = (1 − σ)·x0 + σ·ε, the model predicts v ≈ ε − x0,
one step goes from σ to σ' < σ with dt = σ' − σ. The ODE (Euler) step is x' = x + v·dt. The SDE
step samples x' ~ N(μ, std²) with

    σ_t = η·sqrt(σ / (1 − σ))                       (σ = 1 uses σ_fallback in the denominator)
    μ   = x + v·dt + σ_t² / (2σ) · (x + (1 − σ)·v)·dt  (Euler step + score term: keeps the marginals)
    std = σ_t·sqrt(−dt)

CPS (coefficient-preserving) and DanceGRPO are documented at their functions. Every step also
returns x̂0 = x − σ·v, the clean sample the model predicts (DanceGRPO decodes the last step's x̂0;
that is the Euler step to σ' = 0 our rollouts end with, so the two decode the same image). All
Flow-GRPO's and DanceGRPO's steps are defined at σ' = 0 too (std σ_t·sqrt(σ) and η·sqrt(σ), as their
sources compute the last step; Flow-GRPO trains it with ``timestep_fraction`` 1); CPS is not (its std
σ'·sin(ηπ/2) is 0 there). Our rollouts end with the deterministic ``ode_step``. All arithmetic is
float32 whatever the model's dtype. The log-density is reduced over every
non-batch element by ``"mean"`` (what Flow-GRPO and DanceGRPO do; clip ranges are then ~1e-4)
or ``"sum"`` (the true log-density of the whole latent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """One transition x → x'. Tensors: prev_sample, mean [B, ...]; std [B, 1, ...] (broadcastable);
    log_prob [B] (reduced as asked); pred_x0 [B, ...] the model's clean-sample prediction x̂0 at x
    (None where a step does not form one)."""

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    pred_x0: torch.Tensor | None = None


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] value as float32 [B, 1, 1, ...] broadcastable against ``like`` [B, ...]."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def reduce_elements(values: torch.Tensor, reduction: str) -> torch.Tensor:
    """values [B, ...] → [B] by ``"mean"`` or ``"sum"`` over all non-batch elements."""
    if reduction == "mean":
        return values.flatten(1).mean(1)
    if reduction == "sum":
        return values.flatten(1).sum(1)
    raise ValueError(f"log-prob reduction must be 'mean' or 'sum', got {reduction!r}")


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """log N(x; mean, std²) per element, reduced to [B]. x, mean: [B, ...]; std broadcastable."""
    x, mean, std = x.float(), mean.float(), std.float()
    elementwise = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return reduce_elements(elementwise, reduction)


def ode_step(v: torch.Tensor, x: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Euler step x' = x + dt·v in float32, the exact arithmetic of diffusers'
    ``FlowMatchEulerDiscreteScheduler.step``. v, x: [B, ...]; σ, σ': scalars or [B]."""
    x32 = x.float()
    dt = _per_sample(sigma_next, x32) - _per_sample(sigma, x32)
    return x32 + dt * v.float()


def _step_inputs(v, x, sigma, sigma_next, eta, step: str, positive_next: bool = False):
    """float32 x, v [B, ...]; σ, σ' as [B, 1, ...]; η as [B, 1, ...] or, per element, x's shape.
    ``positive_next``: ValueError naming ``step`` when some σ' ≤ 0 (CPS: its std σ'·sin(ηπ/2) is 0
    there, so the step has no density)."""
    given = torch.as_tensor(sigma_next)  # checked where it lives (the schedule's CPU tensor): no device sync
    if positive_next and bool((given <= 0).any()):
        raise ValueError(f"the {step} step needs σ' > 0 (got σ' = {given.flatten().tolist()}): at σ' = 0 its "
                         "std is 0 and it has no density; the last step of a rollout is the deterministic ode_step")
    x32, v32 = x.float(), v.float()
    eta = torch.as_tensor(eta, dtype=torch.float32, device=x.device)
    eta = eta if eta.shape == x.shape else _per_sample(eta, x32)
    return x32, v32, _per_sample(sigma, x32), _per_sample(sigma_next, x32), eta


def _gaussian_step(mean, std, noise, prev_sample, reduction: str, std_scale, pred_x0) -> StepOutput:
    """Sample x' = μ + std·noise (or take ``prev_sample``) and its log-density. ``std_scale``: a
    learned per-element exploration multiplier of the std (EXPLORENET); the mean is unchanged."""
    if std_scale is not None:
        std = std * std_scale.float()
    if prev_sample is None:
        prev_sample = mean + std * noise.float()
    return StepOutput(prev_sample.float(), mean, std, gaussian_log_prob(prev_sample, mean, std, reduction), pred_x0)


def _check_one_of(noise, prev_sample) -> None:
    if (noise is None) == (prev_sample is None):
        raise ValueError("give exactly one of noise (to sample) or prev_sample (to score)")


def flow_grpo_sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma,
    sigma_next,
    eta,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    sigma_fallback: float | None = None,
    reduction: str = "mean",
    std_scale: torch.Tensor | None = None,
) -> StepOutput:
    """One Flow-GRPO SDE transition and the log-density of its result.

    v, x: [B, ...] velocity and current latent; σ, σ', η: scalars or [B] (η may also be a
    per-element std multiplier of x's shape, for learned exploration noise). Give ``noise``
    ([B, ...], standard normal) to sample x' = μ + std·noise, or ``prev_sample`` to score a given
    x'. ``sigma_fallback`` replaces σ in the denominator 1 − σ where σ = 1 (Flow-GRPO uses the
    schedule's σ_1). ``std_scale`` ([B, ...], > 0) multiplies the std element-wise and leaves
    the mean as it is (EXPLORENET). Requires η > 0; σ' = 0 gives std σ_t·sqrt(σ), as
    Flow-GRPO's ``sde_step_with_logprob`` computes its last step.
    """
    _check_one_of(noise, prev_sample)
    x32, v32, s, s_next, eta = _step_inputs(v, x, sigma, sigma_next, eta, "flow_grpo")
    denom_sigma = torch.where(s >= 1, torch.full_like(s, sigma_fallback if sigma_fallback is not None else 0.0), s)
    if sigma_fallback is None and bool((s >= 1).any()):
        raise ValueError("σ = 1 needs sigma_fallback (the schedule's next σ) to keep 1 − σ > 0")
    dt = s_next - s
    sigma_t = eta * torch.sqrt(s / (1 - denom_sigma))
    mean = x32 + v32 * dt + sigma_t**2 / (2 * s) * (x32 + (1 - s) * v32) * dt
    std = sigma_t * torch.sqrt(-dt)
    return _gaussian_step(mean, std, noise, prev_sample, reduction, std_scale, x32 - s * v32)


def cps_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma,
    sigma_next,
    eta,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    sigma_fallback: float | None = None,
    reduction: str = "mean",
    std_scale: torch.Tensor | None = None,
) -> StepOutput:
    """Coefficient-preserving sampling: x' = (1 − σ')·x̂0 + sqrt(σ'² − σ_t²)·ε̂ + σ_t·z with
    σ_t = σ'·sin(η·π/2), x̂0 = x − σ·v and ε̂ = x + (1 − σ)·v. The noise and the predicted ε̂
    together keep the coefficient σ' of the noise exact, so no score correction is needed.

    Same arguments as ``flow_grpo_sde_step`` (``sigma_fallback`` is unused: σ = 1 is fine here).
    The log-prob is the exact Gaussian one with std σ_t; the reference implementation keeps only
    −mean((x' − μ)²), which differs by the factor 1 / (2σ_t²) and a constant (so its clip ranges
    are not ours). Requires σ' > 0 and η > 0: the last step is an ``ode_step``.
    """
    _check_one_of(noise, prev_sample)
    x32, v32, s, s_next, eta = _step_inputs(v, x, sigma, sigma_next, eta, "cps", positive_next=True)
    std = s_next * torch.sin(eta * math.pi / 2)
    x0_hat, eps_hat = x32 - s * v32, x32 + (1 - s) * v32
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp(min=0)) * eps_hat
    return _gaussian_step(mean, std, noise, prev_sample, reduction, std_scale, x0_hat)


def dance_grpo_sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma,
    sigma_next,
    eta,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    sigma_fallback: float | None = None,
    reduction: str = "mean",
    std_scale: torch.Tensor | None = None,
    score_term: bool = True,
) -> StepOutput:
    """DanceGRPO's SDE (``flux_step`` in its train_grpo_*.py): a constant diffusion coefficient η,
    std = η·sqrt(σ − σ'), and μ = x + v·dt − ½·η²·score·dt with score = −(x − (1 − σ)·x̂0) / σ²
    = −ε̂ / σ (η ≈ 0.3).

    Same arguments as ``flow_grpo_sde_step``; it equals that step with σ_t ≡ η, i.e. the same
    drift correction under a flat noise schedule (``sigma_fallback`` is unused). ``score_term``
    False is its ``sde_solver=False``: μ = x + v·dt, the Euler mean with noise added (the sample
    marginals then drift from the ODE's; ``sampling.sde: dance_grpo_euler``). σ' = 0 gives std
    η·sqrt(σ), as ``flux_step`` computes its last step.
    """
    _check_one_of(noise, prev_sample)
    x32, v32, s, s_next, eta = _step_inputs(v, x, sigma, sigma_next, eta, "dance_grpo")
    dt = s_next - s
    x0_hat = x32 - s * v32
    mean = x32 + v32 * dt
    if score_term:
        score = -(x32 - (1 - s) * x0_hat) / s**2
        mean = mean - 0.5 * eta**2 * score * dt
    std = eta * torch.sqrt(-dt)
    return _gaussian_step(mean, std, noise, prev_sample, reduction, std_scale, x0_hat)


def dance_grpo_euler_step(v, x, sigma, sigma_next, eta, **kwargs) -> StepOutput:
    """DanceGRPO's step with ``sde_solver=False``: x' ~ N(x + v·dt, η²·(σ − σ')), no score term."""
    return dance_grpo_sde_step(v, x, sigma, sigma_next, eta, score_term=False, **kwargs)


FLOW_SDE_STEPS = {"flow_grpo": flow_grpo_sde_step, "cps": cps_step, "dance_grpo": dance_grpo_sde_step,
                  "dance_grpo_euler": dance_grpo_euler_step}
