"""DDIM step with log-prob: hand-computed moments, diffusers' own step, closed-form density."""

import math

import pytest
import torch
from diffusers import DDIMScheduler

from flowalign.samplers.ddim import ddim_step

# ᾱ_t = 0.36, ᾱ' = 0.64: sqrt(ᾱ_t) = 0.6, sqrt(1 − ᾱ_t) = 0.8, sqrt(ᾱ') = 0.8, sqrt(1 − ᾱ') = 0.6
A_T, A_PREV = 0.36, 0.64


def test_epsilon_step_matches_hand_computed_moments():
    x, eps = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    # η = 0: x̂0 = (1 − 0.8·0.5)/0.6 = 1, μ = 0.8·1 + 0.6·0.5 = 1.1
    out = ddim_step(eps, x, A_T, A_PREV, 0.0)
    assert out.prev_sample.item() == pytest.approx(1.1, abs=1e-6)
    assert out.log_prob.item() == 0.0
    # η = 1: σ_t² = (0.36/0.64)·(1 − 0.36/0.64) = 63/256, sqrt(1 − 0.64 − 63/256) = 0.3375,
    # μ = 0.8·1 + 0.3375·0.5 = 0.96875; x' = μ + σ_t·1
    out = ddim_step(eps, x, A_T, A_PREV, 1.0, noise=torch.ones(1, 1))
    std = math.sqrt(63) / 16
    assert out.mean.item() == pytest.approx(0.96875, abs=1e-6)
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.prev_sample.item() == pytest.approx(0.96875 + std, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-0.5 - math.log(std) - 0.5 * math.log(2 * math.pi), abs=1e-5)


def test_v_prediction_step_matches_hand_computed_moments():
    # x̂0 = 0.6·1 − 0.8·0.5 = 0.2, ε̂ = 0.6·0.5 + 0.8·1 = 1.1; η = 0: μ = 0.8·0.2 + 0.6·1.1 = 0.82
    out = ddim_step(torch.tensor([[0.5]]), torch.tensor([[1.0]]), A_T, A_PREV, 0.0, prediction_type="v_prediction")
    assert out.prev_sample.item() == pytest.approx(0.82, abs=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("eta", [0.0, 0.7, 1.0])
def test_step_equals_diffusers_ddim_step(prediction_type, clip, eta):
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=clip,
                              clip_sample_range=0.5, set_alpha_to_one=False, steps_offset=1,
                              prediction_type=prediction_type)
    scheduler.set_timesteps(5)
    g = torch.Generator().manual_seed(0)
    for t in scheduler.timesteps:
        x, out, z = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(3))
        prev_t = int(t) - 1000 // 5
        a_prev = scheduler.alphas_cumprod[prev_t] if prev_t >= 0 else scheduler.final_alpha_cumprod
        ours = ddim_step(out, x, scheduler.alphas_cumprod[t], a_prev, eta, prediction_type=prediction_type,
                         clip_sample_range=0.5 if clip else None, noise=z)
        expected = scheduler.step(out, t, x, eta=eta, variance_noise=z).prev_sample
        assert (ours.prev_sample - expected).abs().max().item() <= 1e-5


def test_log_prob_is_the_closed_form_gaussian_and_rescores_exactly():
    g = torch.Generator().manual_seed(1)
    x, eps, z = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    a_t, a_prev = torch.tensor([0.1, 0.4, 0.7]), torch.tensor([0.3, 0.6, 0.9])
    sampled = ddim_step(eps, x, a_t, a_prev, 1.0, noise=z, reduction="sum")
    x0 = (x - (1 - a_t).sqrt().view(-1, 1, 1, 1) * eps) / a_t.sqrt().view(-1, 1, 1, 1)
    var = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    mean = a_prev.sqrt().view(-1, 1, 1, 1) * x0 + (1 - a_prev - var).sqrt().view(-1, 1, 1, 1) * eps
    normal = torch.distributions.Normal(mean, var.sqrt().view(-1, 1, 1, 1).expand_as(mean))
    reference = normal.log_prob(sampled.prev_sample).flatten(1)
    assert torch.allclose(sampled.log_prob, reference.sum(1), atol=1e-4)
    scored = ddim_step(eps, x, a_t, a_prev, 1.0, prev_sample=sampled.prev_sample, reduction="mean")
    assert torch.allclose(scored.log_prob, reference.mean(1), atol=1e-5)
    again = ddim_step(eps, x, a_t, a_prev, 1.0, prev_sample=sampled.prev_sample, reduction="sum")
    assert torch.equal(again.log_prob, sampled.log_prob)


def test_invalid_steps_are_named():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="exactly one"):
        ddim_step(x, x, A_T, A_PREV, 1.0)
    with pytest.raises(ValueError, match="deterministic"):
        ddim_step(x, x, A_T, A_PREV, 0.0, prev_sample=x)
    with pytest.raises(ValueError, match="set_alpha_to_one"):
        ddim_step(x, x, A_T, 1.0, 1.0, noise=x)
    with pytest.raises(ValueError, match="too large"):
        ddim_step(x, x, A_T, A_PREV, 3.0, noise=x)
    with pytest.raises(ValueError, match="separate steps"):
        ddim_step(torch.zeros(2, 2), torch.zeros(2, 2), A_T, A_PREV, torch.tensor([0.0, 1.0]), noise=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_step(x, x, A_T, A_PREV, 0.0, prediction_type="velocity")
