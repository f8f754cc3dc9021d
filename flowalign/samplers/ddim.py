"""The DDIM step with noise level η for ε-/v-prediction diffusion models, with exact per-step
log-probabilities (DDPO, ``../shared/METHODS.md`` §1).

Notation (DDIM, Song et al. 2021, eqs. 12 and 16): x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε, ᾱ_t the
cumulative product of the scheduler's alphas at timestep t; one step goes from t to the previous
timestep t' (less noise, ᾱ' = ᾱ_{t'} > ᾱ_t). From the model output:

    epsilon:       x̂0 = (x − sqrt(1 − ᾱ_t)·out) / sqrt(ᾱ_t),  ε̂ = out
    v_prediction:  x̂0 = sqrt(ᾱ_t)·x − sqrt(1 − ᾱ_t)·out,      ε̂ = sqrt(ᾱ_t)·out + sqrt(1 − ᾱ_t)·x
    sample:        x̂0 = out,                                    ε̂ = (x − sqrt(ᾱ_t)·x̂0) / sqrt(1 − ᾱ_t)

then x̂0 is clipped to [−r, r] when the scheduler says so (``clip_sample``; off for SD), and

    σ_t = η·sqrt((1 − ᾱ')/(1 − ᾱ_t))·sqrt(1 − ᾱ_t/ᾱ')
    μ   = sqrt(ᾱ')·x̂0 + sqrt(1 − ᾱ' − σ_t²)·ε̂
    x'  ~ N(μ, σ_t²)

η = 0 is deterministic DDIM, η = 1 the DDPM posterior variance (DDPO's setting). Where ᾱ' = 1
(a scheduler with ``set_alpha_to_one``, after its last step) σ_t = 0 for every η: that step has
no density and must be run with η = 0 (``plan_steps`` never makes the last step stochastic;
SD's own config keeps ᾱ' = ᾱ_0 < 1, so DDPO can train it). This is the
arithmetic of diffusers' ``DDIMScheduler.step`` (with ``use_clipped_model_output=False``, as the
pipelines call it), in float32 whatever the model's dtype; the log-density reuses
``flow_sde.gaussian_log_prob``, reduced over the non-batch elements by "mean" (DDPO's reference
code) or "sum".
"""

from __future__ import annotations

import torch

from flowalign.samplers.flow_sde import StepOutput, _per_sample, gaussian_log_prob

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def predicted_x0_and_noise(model_output: torch.Tensor, x: torch.Tensor, alpha_cumprod,
                           prediction_type: str = "epsilon") -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂0, ε̂) [B, ...] float32 from the model output and x [B, ...] at ᾱ_t (scalar or [B])."""
    x32, out = x.float(), model_output.float()
    a = _per_sample(alpha_cumprod, x32)
    b = 1 - a
    if prediction_type == "epsilon":
        return (x32 - b**0.5 * out) / a**0.5, out
    if prediction_type == "v_prediction":
        return a**0.5 * x32 - b**0.5 * out, a**0.5 * out + b**0.5 * x32
    if prediction_type == "sample":
        return out, (x32 - a**0.5 * out) / b**0.5
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def ddim_step(
    model_output: torch.Tensor,
    x: torch.Tensor,
    alpha_cumprod,
    alpha_cumprod_prev,
    eta,
    *,
    prediction_type: str = "epsilon",
    clip_sample_range: float | None = None,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """One DDIM transition x_t → x_{t'} and the log-density of its result.

    model_output, x: [B, ...] (ε, v or x0 as ``prediction_type`` says, and the current latent);
    ᾱ_t, ᾱ', η: scalars or [B] (η all 0 or all > 0). ``clip_sample_range``: clip x̂0 to [−r, r],
    None for no clipping.
    Give ``noise`` ([B, ...], standard normal) to sample x' = μ + σ_t·noise, or ``prev_sample`` to
    score a given x'. With η = 0 the step is deterministic: x' = μ (``noise`` may be left out) and
    log_prob is 0 (a point mass has no density; the trajectory stores 0 at deterministic steps).
    Returns std [B, 1, ...] = σ_t and log_prob [B].
    """
    eta = _per_sample(eta, x)
    deterministic = bool((eta == 0).all())
    if not deterministic and bool((eta == 0).any()):
        raise ValueError("η is 0 for some samples and > 0 for others: run the two groups as separate steps")
    if deterministic and prev_sample is not None:
        raise ValueError("cannot score a deterministic (η = 0) step: it has no density")
    if not deterministic and (noise is None) == (prev_sample is None):
        raise ValueError("give exactly one of noise (to sample) or prev_sample (to score)")
    x0, eps = predicted_x0_and_noise(model_output, x, alpha_cumprod, prediction_type)
    if clip_sample_range is not None:
        x0 = x0.clamp(-clip_sample_range, clip_sample_range)
    a, a_prev = _per_sample(alpha_cumprod, x0), _per_sample(alpha_cumprod_prev, x0)
    std = eta * ((1 - a_prev) / (1 - a) * (1 - a / a_prev)) ** 0.5
    direction = 1 - a_prev - std**2
    if bool((direction < 0).any()):
        raise ValueError(f"η = {eta.flatten().tolist()} is too large: 1 − ᾱ' − σ_t² < 0 (η ≤ 1 always "
                         "works)")
    mean = a_prev**0.5 * x0 + direction**0.5 * eps
    if deterministic:
        return StepOutput(mean, mean, std, torch.zeros(x.shape[0], device=x.device))
    if bool(((std == 0) & (eta > 0)).any()):
        raise ValueError("σ_t = 0 at a step with η > 0 (ᾱ' = 1: the scheduler's set_alpha_to_one at the last "
                         "step): its log-density is undefined; make that step deterministic (η = 0)")
    if prev_sample is None:
        prev_sample = mean + std * noise.float()
    return StepOutput(prev_sample.float(), mean, std, gaussian_log_prob(prev_sample, mean, std, reduction))
