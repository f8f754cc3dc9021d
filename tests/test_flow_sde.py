"""Flow-GRPO SDE step: closed-form density, hand-computed moments, marginal preservation."""

import math

import pytest
import torch

from flowalign.samplers.flow_sde import flow_grpo_sde_step, gaussian_log_prob, ode_step
from flowalign.samplers.steps import plan_steps, sliding_window_start


def test_log_prob_equals_closed_form_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    std = torch.rand(3, 1, 1, generator=g) + 0.1
    reference = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).flatten(1)
    assert torch.allclose(gaussian_log_prob(x, mean, std, "sum"), reference.sum(1), atol=1e-5)
    assert torch.allclose(gaussian_log_prob(x, mean, std, "mean"), reference.mean(1), atol=1e-6)


def test_sde_moments_match_hand_computed_values():
    # σ = 0.5 → 0.4, η = 0.7: σ_t = 0.7·sqrt(0.5/0.5) = 0.7, std = 0.7·sqrt(0.1),
    # μ = x + v·dt + σ_t²/(2σ)·(x + (1 − σ)·v)·dt with dt = −0.1
    x, v = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    out = flow_grpo_sde_step(v, x, 0.5, 0.4, 0.7, noise=torch.zeros(1, 1))
    expected_mean = 2.0 + (-1.0) * -0.1 + 0.49 / 1.0 * (2.0 + 0.5 * -1.0) * -0.1
    assert out.mean.item() == pytest.approx(expected_mean, abs=1e-6)
    assert out.std.item() == pytest.approx(0.7 * math.sqrt(0.1), abs=1e-6)
    x_next = torch.tensor([[1.5]])
    scored = flow_grpo_sde_step(v, x, 0.5, 0.4, 0.7, prev_sample=x_next)
    z = (1.5 - expected_mean) / (0.7 * math.sqrt(0.1))
    assert scored.log_prob.item() == pytest.approx(-0.5 * z * z - math.log(0.7 * math.sqrt(0.1)) - 0.5 * math.log(2 * math.pi), abs=1e-5)


def test_sampled_step_scores_to_its_own_log_prob():
    g = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(4, 2, 3, 3, generator=g) for _ in range(3))
    sampled = flow_grpo_sde_step(v, x, torch.tensor([1.0, 0.8, 0.6, 0.4]), 0.3, 1.0, noise=noise, sigma_fallback=0.9)
    scored = flow_grpo_sde_step(v, x, torch.tensor([1.0, 0.8, 0.6, 0.4]), 0.3, 1.0,
                                prev_sample=sampled.prev_sample, sigma_fallback=0.9)
    assert torch.allclose(sampled.log_prob, scored.log_prob, atol=1e-6)


def test_small_eta_mean_tends_to_the_euler_step():
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    out = flow_grpo_sde_step(v, x, 0.7, 0.6, 1e-4, noise=torch.zeros(2, 8))
    assert torch.allclose(out.mean, ode_step(v, x, 0.7, 0.6), atol=1e-6)


def test_sigma_one_needs_a_fallback():
    with pytest.raises(ValueError, match="sigma_fallback"):
        flow_grpo_sde_step(torch.zeros(1, 2), torch.zeros(1, 2), 1.0, 0.9, 1.0, noise=torch.zeros(1, 2))


@pytest.mark.parametrize("eta", [0.0, 0.7, 1.0])
def test_sde_keeps_the_marginals_of_a_gaussian_world(eta):
    # x0 ~ N(0, a²) has the exact velocity v(x, σ) = (σ − (1 − σ)a²) / ((1 − σ)²a² + σ²) · x. With the
    # score correction the SDE ends at var a² for every η; dropping it (a plain Euler + noise
    # step) would inflate the variance.
    a, steps = 0.5, 200
    sigmas = torch.linspace(1, 0, steps + 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 1, generator=g)
    for i in range(steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        v = (s - (1 - s) * a**2) / ((1 - s) ** 2 * a**2 + s**2) * x
        if eta == 0 or s_next == 0:
            x = ode_step(v, x, s, s_next)
        else:
            x = flow_grpo_sde_step(v, x, s, s_next, eta, noise=torch.randn(x.shape, generator=g),
                                   sigma_fallback=float(sigmas[1])).prev_sample
    assert x.std().item() == pytest.approx(a, rel=0.04)


def test_plan_modes():
    plan = plan_steps(6, 3, 0.8, "all")
    assert plan.noise_levels.tolist() == pytest.approx([0.8] * 5 + [0.0])
    assert plan.trained.all(dim=0).tolist() == [True] * 5 + [False]
    frac = plan_steps(11, 4, 1.0, "fraction", fraction=0.6, generator=torch.Generator().manual_seed(0))
    assert frac.trained.sum(1).tolist() == [6] * 4 and not frac.trained[:, -1].any()
    assert len({tuple(r) for r in frac.trained.tolist()}) > 1  # drawn per sample
    win = plan_steps(8, 2, 1.0, "window", window_size=3, window_start=2)
    assert (win.noise_levels > 0).tolist() == [False, False, True, True, True, False, False, False]
    assert torch.equal(win.trained[0], win.noise_levels > 0)
    with pytest.raises(ValueError, match="window_size"):
        plan_steps(4, 1, 1.0, "window", window_size=4)


def test_sliding_window_moves_later_every_shift_and_stops_at_the_end():
    # 10 steps, window 2: the last valid start is 10 - 1 - 2 = 7
    starts = [sliding_window_start(epoch, 10, 2, shift_every=3, stride=2) for epoch in range(15)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 7, 7, 7]
    assert sliding_window_start(0, 10, 2, shift_every=1, start=5) == 5
    for start in set(starts):  # every scheduled window is a valid plan
        plan_steps(10, 1, 1.0, "window", window_size=2, window_start=start)
    with pytest.raises(ValueError, match="shift_every"):
        sliding_window_start(0, 10, 2, shift_every=0)


def test_window_range_places_the_random_window_inside_it_like_flow_grpo_fast():
    """Flow-GRPO's sde_window_range (0, num_steps // 2) with window 3 on 10 steps: starts 0, 1 or 2
    only, each reached; without a range the same draws reach every start up to 9 − 3 = 6."""
    g = torch.Generator().manual_seed(0)
    starts = {int(plan_steps(10, 1, 1.0, "window", window_size=3, window_range=(0, 5), generator=g)
                  .noise_levels.nonzero()[0]) for _ in range(60)}
    assert starts == {0, 1, 2}
    g = torch.Generator().manual_seed(0)
    anywhere = {int(plan_steps(10, 1, 1.0, "window", window_size=3, generator=g).noise_levels.nonzero()[0])
                for _ in range(200)}
    assert anywhere == set(range(7))
    with pytest.raises(ValueError, match="window_range"):
        plan_steps(10, 1, 1.0, "window", window_size=3, window_range=(0, 2))


def test_window_range_is_refused_where_it_would_be_ignored(tmp_path):
    from flowalign.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="sampling.window_range"):
        load_config("configs/shapes_flow_grpo.yaml", ["sampling.window_range=[0,5]"])  # step_mode all
    with pytest.raises(ConfigError, match="sampling.window_range"):
        load_config("configs/shapes_flow_grpo.yaml", ["sampling.step_mode=window", "sampling.window_size=3",
                                                      "sampling.window_range=[0,12]"])
    cfg = load_config("configs/shapes_flow_grpo.yaml", ["sampling.step_mode=window", "sampling.window_size=3",
                                                        "sampling.window_range=[0,5]"])
    assert cfg.sampling.window_range == [0, 5]
