"""CPS and DanceGRPO SDE steps: hand-computed moments, exact rescoring, marginals, the reduction to Flow-GRPO."""

import math

import pytest
import torch

from flowalign.samplers.flow_sde import FLOW_SDE_STEPS, cps_step, dance_grpo_sde_step, flow_grpo_sde_step


def test_cps_moments_match_hand_computed_values():
    # σ = 0.5 → 0.4, η = 0.5: σ_t = 0.4·sin(π/4); x̂0 = x − σ·v, ε̂ = x + (1 − σ)·v
    x, v = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    out = cps_step(v, x, 0.5, 0.4, 0.5, noise=torch.zeros(1, 1))
    std = 0.4 * math.sin(math.pi / 4)
    x0_hat, eps_hat = 2.0 + 0.5, 2.0 - 0.5
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.mean.item() == pytest.approx(0.6 * x0_hat + math.sqrt(0.16 - std**2) * eps_hat, abs=1e-6)
    scored = cps_step(v, x, 0.5, 0.4, 0.5, prev_sample=torch.tensor([[1.0]]))
    z = (1.0 - out.mean.item()) / std
    assert scored.log_prob.item() == pytest.approx(-0.5 * z * z - math.log(std) - 0.5 * math.log(2 * math.pi), abs=1e-5)


def test_cps_with_the_true_velocity_keeps_the_noise_coefficient_exact():
    # x_σ = (1 − σ)·x0 + σ·ε and v = ε − x0: then x' − (1 − σ')·x0 must be noise of std σ' exactly
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(20000, 1, generator=g), torch.randn(20000, 1, generator=g)
    sigma, sigma_next = 0.8, 0.5
    out = cps_step(eps - x0, (1 - sigma) * x0 + sigma * eps, sigma, sigma_next, 0.7,
                   noise=torch.randn(20000, 1, generator=g))
    residual = out.prev_sample - (1 - sigma_next) * x0
    assert residual.std().item() == pytest.approx(sigma_next, rel=0.02)


def test_dance_grpo_is_flow_grpo_with_a_flat_noise_schedule():
    # DanceGRPO's σ_t ≡ η is Flow-GRPO's σ_t = η'·sqrt(σ / (1 − σ)) with η' = η·sqrt((1 − σ) / σ)
    g = torch.Generator().manual_seed(1)
    x, v, z = (torch.randn(3, 2, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.9, 0.6, 0.3])
    dance = dance_grpo_sde_step(v, x, sigma, sigma - 0.1, 0.3, noise=z)
    flow = flow_grpo_sde_step(v, x, sigma, sigma - 0.1, 0.3 * torch.sqrt((1 - sigma) / sigma), noise=z)
    torch.testing.assert_close(dance.mean, flow.mean)
    torch.testing.assert_close(dance.prev_sample, flow.prev_sample)
    torch.testing.assert_close(dance.log_prob, flow.log_prob)
    assert dance.std.flatten().tolist() == pytest.approx((0.3 * torch.sqrt(torch.tensor(0.1))).repeat(3).tolist())


@pytest.mark.parametrize("name", sorted(FLOW_SDE_STEPS))
def test_every_sde_rescores_its_sample_to_the_same_log_prob(name):
    step = FLOW_SDE_STEPS[name]
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    sampled = step(v, x, 0.7, 0.55, 0.8, noise=torch.randn(4, 3, 8, generator=g), sigma_fallback=0.9)
    scored = step(v, x, 0.7, 0.55, 0.8, prev_sample=sampled.prev_sample, sigma_fallback=0.9)
    assert torch.equal(torch.exp(scored.log_prob - sampled.log_prob), torch.ones(4))
    with pytest.raises(ValueError, match="exactly one"):
        step(v, x, 0.7, 0.55, 0.8)
