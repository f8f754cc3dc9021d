"""Advantages and the Flow-GRPO objective: values, NaN handling, ratio 1 on-policy, KL, gradient sign."""

import pytest
import torch

from flowalign.advantages import PerPromptStatTracker, combine_rewards, extremes_mask, group_advantages
from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.samplers.flow_sde import gaussian_log_prob


def test_group_advantages_normalise_within_groups_and_skip_nan():
    rewards = torch.tensor([1.0, 3.0, 5.0, float("nan"), 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv, stats = group_advantages(rewards, groups, eps=0.0)
    assert adv[:2].tolist() == pytest.approx([-1.0, 1.0])
    assert adv[2].item() == 0.0 and adv[3].item() == 0.0  # single valid member, dropped member
    assert adv[4:].tolist() == [0.0, 0.0]
    assert stats["zero_spread_groups"] == pytest.approx(2 / 3)
    adv_global, _ = group_advantages(torch.tensor([1.0, 3.0, 0.0, 4.0]), torch.tensor([0, 0, 1, 1]), global_std=True, eps=0.0)
    assert adv_global.tolist() == pytest.approx([d / 2.5**0.5 for d in (-1, 1, -2, 2)], rel=1e-3)


def test_combine_rewards_weights_and_marks_invalid():
    total, valid = combine_rewards({"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([2.0, 2.0])},
                                   {"a": 0.5, "b": 2.0})
    assert total[0].item() == pytest.approx(4.5) and torch.isnan(total[1])
    assert valid.tolist() == [True, False]
    with pytest.raises(KeyError, match="'c'"):
        combine_rewards({"a": torch.ones(2)}, {"c": 1.0})


def test_per_prompt_tracker_uses_history_and_round_trips():
    tracker = PerPromptStatTracker(buffer_size=8, min_count=2, eps=0.0)
    tracker.update(["p", "p"], torch.tensor([0.0, 2.0]))
    adv = tracker.update(["p"], torch.tensor([4.0]))  # history 0, 2, 4: mean 2, std sqrt(8/3)
    assert adv.item() == pytest.approx(2.0 / (8 / 3) ** 0.5)
    clone = PerPromptStatTracker(buffer_size=8, min_count=2, eps=0.0)
    clone.load_state_dict(tracker.state_dict())
    assert clone.state_dict() == tracker.state_dict()


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    logp = torch.randn(5)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    loss, stats = flow_grpo_loss(logp, logp.clone(), adv, clip_range=1e-4)
    assert stats["ratio"].item() == 1.0 and stats["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-adv.mean().item())


def test_kl_is_zero_at_the_reference_and_matches_closed_form():
    mean, std = torch.randn(2, 3), torch.full((2, 1), 0.5)
    _, stats = flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), clip_range=0.1, beta=1.0,
                              mean=mean, ref_mean=mean.clone(), std=std)
    assert stats["kl"].item() == 0.0
    _, stats = flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), clip_range=0.1, beta=1.0,
                              mean=mean + 0.25, ref_mean=mean, std=std, reduction="sum")
    assert stats["kl"].item() == pytest.approx(3 * 0.25**2 / (2 * 0.25))  # KL of N(μ+d, s²) ‖ N(μ, s²), summed


def test_clipping_stops_the_gradient_outside_the_trust_region():
    logp = torch.tensor([0.5, -0.5], requires_grad=True)
    loss, stats = flow_grpo_loss(logp, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=0.2)
    loss.backward()
    assert stats["clipfrac"].item() == 1.0
    assert torch.equal(logp.grad, torch.zeros(2))


def test_gradient_steps_move_a_gaussian_policy_toward_rewarded_samples():
    # policy N(θ, 1) over 1-D actions; reward = action. Gradient descent on the objective must raise θ.
    theta = torch.zeros(1, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        with torch.no_grad():
            actions = theta + torch.randn(64, 1, generator=g)
            old = gaussian_log_prob(actions, theta.expand(64, 1), torch.ones(1, 1), "sum")
            rewards = actions.squeeze(1)
            adv = (rewards - rewards.mean()) / rewards.std()
        logp = gaussian_log_prob(actions, theta.expand(64, 1), torch.ones(1, 1), "sum")
        loss, _ = flow_grpo_loss(logp, old, adv, clip_range=0.2)
        loss.backward()
        with torch.no_grad():
            theta -= 0.1 * theta.grad
            theta.grad = None
    assert theta.item() > 1.0


def test_extremes_mask_keeps_each_groups_best_and_worst():
    rewards = torch.tensor([0.5, 0.1, 0.9, 0.3, float("nan"), 2.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert extremes_mask(rewards, groups, 1).tolist() == [False, True, True, False, False, False, True, True]
    assert extremes_mask(rewards, groups, 2).tolist() == [True, True, True, True, False, True, True, True]


def test_per_reward_loss_is_the_weighted_sum_of_each_rewards_clipped_loss():
    g = torch.Generator().manual_seed(0)
    log_prob, old = torch.randn(6, generator=g) * 1e-3, torch.randn(6, generator=g) * 1e-3
    adv = torch.randn(6, 2, generator=g)
    w = torch.tensor([0.7, 0.3])
    both, _ = flow_grpo_loss(log_prob, old, adv, clip_range=1e-4, advantage_weights=w)
    parts = [flow_grpo_loss(log_prob, old, adv[:, c], clip_range=1e-4)[0] for c in range(2)]
    assert both.item() == pytest.approx((0.7 * parts[0] + 0.3 * parts[1]).item(), rel=1e-6)
    # clipping acts per reward: this differs from the loss of the combined advantage
    combined, _ = flow_grpo_loss(log_prob, old, adv @ w, clip_range=1e-4)
    assert combined.item() != pytest.approx(both.item(), rel=1e-6)
