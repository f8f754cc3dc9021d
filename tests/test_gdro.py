"""GDRO: the Plackett–Luce loss by hand, the reduction to Diffusion-DPO, gradient directions."""

import math

import pytest
import torch

from flowalign.objectives.gdro import gdro_loss, implicit_rewards, plackett_luce_loss


def test_k2_small_tau_is_the_diffusion_dpo_loss():
    mse_theta = torch.tensor([[0.30, 0.50], [0.70, 0.20]])
    mse_ref = torch.tensor([[0.40, 0.45], [0.60, 0.25]])
    rewards = torch.tensor([[1.0, 0.0], [0.2, 0.9]])  # winner: sample 0, then sample 1
    beta = 5.0
    loss, _ = gdro_loss(mse_theta, mse_ref, rewards, beta=beta, tau=1e-4, gamma=0.0)
    s = implicit_rewards(mse_theta, mse_ref, beta)
    dpo = [-torch.nn.functional.logsigmoid(s[0, 0] - s[0, 1]), -torch.nn.functional.logsigmoid(s[1, 1] - s[1, 0])]
    # Diffusion-DPO written out: −log σ(−β[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))])
    by_hand = -math.log(1 / (1 + math.exp(beta * ((0.30 - 0.40) - (0.50 - 0.45)))))
    assert dpo[0].item() == pytest.approx(by_hand, rel=1e-6)
    assert loss.item() == pytest.approx(((dpo[0] + dpo[1]) / 2).item(), rel=1e-5)


def test_plackett_luce_matches_a_hand_computation_for_k3():
    scores = torch.tensor([[0.5, -1.0, 2.0]])
    rewards = torch.tensor([[0.3, 0.1, 0.9]])  # order: item 2, item 0, item 1
    tau = 0.5
    q = torch.softmax(torch.tensor([0.9, 0.3, 0.1]) / tau, 0)
    s = [2.0, 0.5, -1.0]
    stage1 = math.log(sum(math.exp(v) for v in s)) - sum(q[j].item() * s[j] for j in range(3))
    q2 = q[1:] / q[1:].sum()
    stage2 = math.log(math.exp(0.5) + math.exp(-1.0)) - (q2[0].item() * 0.5 + q2[1].item() * -1.0)
    assert plackett_luce_loss(scores, rewards, tau).item() == pytest.approx(stage1 + stage2, rel=1e-6)


def test_gradient_lowers_the_best_samples_error_and_raises_the_worst():
    mse_theta = torch.full((1, 4), 0.5, requires_grad=True)
    mse_ref = torch.full((1, 4), 0.5)
    rewards = torch.tensor([[0.1, 0.9, 0.4, 0.0]])
    loss, stats = gdro_loss(mse_theta, mse_ref, rewards, beta=6.0, tau=0.05, gamma=0.0)
    assert stats["gdro_score_gap"] == 0  # at the reference every implicit reward is 0
    loss.backward()
    g = mse_theta.grad[0]
    assert g[1] > 0 > g[3]  # descent (−g): the best sample's error goes down, the worst one's up
    # with γ > 0 the best sample also gets the flow-matching pull
    mse2 = mse_theta.detach().clone().requires_grad_(True)
    gdro_loss(mse2, mse_ref, rewards, beta=6.0, tau=0.05, gamma=1.0)[0].backward()
    assert mse2.grad[0, 1] == pytest.approx(g[1].item() + 1.0)
