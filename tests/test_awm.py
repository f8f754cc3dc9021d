"""AWM: the constant-advantage reduction to flow matching, a hand-computed value, the gradient's
sign on a toy problem, the KL term, the authors' generalised Huber loss by hand and against their
clipped-ratio form, and the trainer path on the tiny SD3 fixture."""

import pytest
import torch

from flowalign.objectives.awm import awm_loss, ghuber
from flowalign.trainer import Trainer
from helpers import cut_and_resumed, tiny_config

AWM = ("method=awm", "sampling.eta=0", "train.noise_draws=2")


def _problem(b=3, shape=(2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)


def test_constant_advantages_are_flow_matching_toward_the_samples():
    v_theta, target = _problem()
    v_theta.requires_grad_(True)
    loss, _ = awm_loss(v_theta, target, torch.full((3,), 2.5))
    fm = ((v_theta - target) ** 2).mean()  # plain flow-matching loss, mean over samples and elements
    assert loss.item() == pytest.approx(2.5 * fm.item(), rel=1e-6)
    (g_awm,) = torch.autograd.grad(loss, v_theta)
    (g_fm,) = torch.autograd.grad(2.5 * fm, v_theta)
    assert torch.allclose(g_awm, g_fm, atol=1e-7)


def test_hand_computed_value_with_time_weights_and_a_dropped_sample():
    v_theta = torch.tensor([[1.0, 3.0], [0.0, 0.0], [5.0, 5.0]])
    target = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    # errors: mean(1, 4) = 2.5; mean(1, 1) = 1; (dropped)
    loss, stats = awm_loss(v_theta, target, torch.tensor([2.0, -1.0, 7.0]), time_weight=torch.tensor([0.5, 0.2, 1.0]),
                           weight=torch.tensor([1.0, 1.0, 0.0]))
    assert loss.item() == pytest.approx((2.0 * 0.5 * 2.5 + (-1.0) * 0.2 * 1.0) / 2)
    assert stats["awm_fm"].item() == pytest.approx((2.5 + 1.0) / 2)


def test_a_gradient_step_moves_toward_good_samples_and_away_from_bad_ones():
    """Toy: the model's velocity is a free parameter shared by two samples' targets."""
    good, bad = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])
    v = torch.zeros(2, requires_grad=True)
    loss, _ = awm_loss(torch.stack([v, v]), torch.stack([good, bad]), torch.tensor([1.0, -1.0]))
    loss.backward()
    step = -v.grad
    assert step @ good > 0 and step @ bad < 0


def test_kl_term_is_zero_at_the_reference_and_needs_v_ref():
    v_theta, target = _problem()
    loss, stats = awm_loss(v_theta, target, torch.zeros(3), v_ref=v_theta.clone(), kl_beta=0.5)
    assert stats["kl"].item() == 0 and loss.item() == 0
    loss, stats = awm_loss(v_theta, target, torch.zeros(3), v_ref=v_theta + 2.0, kl_beta=0.5)
    assert stats["kl"].item() == pytest.approx(4.0) and loss.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="v_ref"):
        awm_loss(v_theta, target, torch.zeros(3), kl_beta=0.5)


def test_the_ema_kl_term_by_hand_and_needs_v_ema():
    v_theta, target = _problem()
    loss, stats = awm_loss(v_theta, target, torch.zeros(3), v_ref=v_theta + 1.0, kl_beta=0.5, v_ema=v_theta - 2.0,
                           ema_beta=0.25)
    assert stats["ema_kl"].item() == pytest.approx(4.0) and stats["kl"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(0.5 * 1.0 + 0.25 * 4.0)
    with pytest.raises(ValueError, match="v_ema"):
        awm_loss(v_theta, target, torch.zeros(3), ema_beta=1.0)


def test_ghuber_by_hand_and_its_power_one_is_the_mse():
    v_theta = torch.tensor([[0.25, 0.25], [1.0, -1.0]])
    target = torch.zeros(2, 2)
    # errors m: 0.0625 and 1; ρ(m) = ((m + 1e-10)^¼ − 1e-10^¼)/¼ = 4·(0.5 − 10^-2.5) and 4·(1 − 10^-2.5)
    eps_p = 10 ** -2.5
    loss, stats = awm_loss(v_theta, target, torch.tensor([2.0, -1.0]), time_weight=torch.tensor([0.5, 0.8]),
                           ghuber_power=0.25)
    by_hand = (2.0 * 0.5 * 4 * (0.5 - eps_p) + (-1.0) * 0.8 * 4 * (1 - eps_p)) / 2
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert stats["awm_fm"].item() == pytest.approx((0.0625 + 1.0) / 2)  # the logged error stays the MSE
    m = torch.rand(5) + 0.01
    assert torch.allclose(ghuber(m, 1.0), m, atol=1e-7)  # p = 1: the plain flow-matching error
    # dρ/dm = (m + ε)^(p − 1): 0.0625^(−¾) = 8 at p = ¼, so errors the model fits well weigh more
    m = torch.tensor([0.0625, 1.0], requires_grad=True)
    (grad,) = torch.autograd.grad(ghuber(m, 0.25).sum(), m)
    assert torch.allclose(grad, torch.tensor([8.0, 1.0]), rtol=1e-6)


def test_ghuber_with_sigma_weights_has_the_gradient_of_the_authors_ratio_loss_at_ratio_one():
    """The authors' code (written here independently from its description): log p = −t·ρ(m) with
    their 'ghuber' ρ, ratio = exp(log p − log p_old), loss = mean −A·ratio (clip range 1: no clip at
    ratio 1). At the rollout weights (log p_old = log p) its gradient is AWM's with ghuber and w = σ."""
    g = torch.Generator().manual_seed(0)
    v_theta, target = torch.randn(4, 3, 2, generator=g).requires_grad_(True), torch.randn(4, 3, 2, generator=g)
    sigma, adv = torch.rand(4, generator=g), torch.tensor([1.0, -0.3, 0.7, -1.4])
    m = ((v_theta.double() - target.double()) ** 2).mean(dim=(1, 2))
    log_p = -(torch.pow(m + 1e-10, 0.25) - torch.pow(torch.tensor(1e-10, dtype=torch.float64), 0.25)) * sigma / 0.25
    theirs = (-adv * torch.exp(log_p - log_p.detach())).mean()
    ours, _ = awm_loss(v_theta, target, adv, time_weight=sigma, ghuber_power=0.25)
    (g_theirs,) = torch.autograd.grad(theirs, v_theta)
    (g_ours,) = torch.autograd.grad(ours, v_theta)
    assert torch.allclose(g_ours, g_theirs.float(), rtol=1e-5, atol=1e-7)


def test_awm_trains_on_ode_rollouts_through_the_trainer(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *AWM, "train.kl_beta=0.1",
                                  "train.awm_time_weighting=sigma"))
    trainer.train()
    assert type(trainer.objective).__name__ == "AWM"
    assert len(trainer.history) == 2
    assert all(h["train/grad_norm"] > 0 for h in trainer.history)
    assert trainer.history[0]["train/kl"] == pytest.approx(0.0, abs=1e-8)  # starts at the reference


def test_the_authors_ghuber_setting_trains_through_the_trainer(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *AWM, "train.epochs=1", "train.awm_loss=ghuber",
                                  "train.awm_time_weighting=sigma"))
    trainer.train()
    assert trainer.history[0]["train/grad_norm"] > 0


def test_the_ema_kl_averages_once_per_epoch_with_the_authors_ramp_and_resumes_exactly(tiny_sd3_dir, tmp_path):
    """One optimizer step per epoch here: the decay is min(0.3, 0.001·steps) = 0.001 after the first
    epoch, so the EMA is 0.001·(initial weights) + 0.999·(weights after it); it starts at the policy
    (ema_kl 0 on the first minibatch). The EMA and the step count are checkpointed."""
    over = (*AWM, "train.awm_ema_beta=1.0", "train.learning_rate=1e-2")
    one = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "one", *over, "train.epochs=1"))
    start = [p.detach().clone() for p in one.params]
    one.train()
    assert one.history[0]["train/ema_kl"] == pytest.approx(0.0, abs=1e-10)
    assert one.history[0]["train/awm_ema_decay"] == pytest.approx(0.001)
    for s, p0, p1 in zip(one.objective.ema.shadow, start, one.params):
        assert torch.allclose(s, 0.001 * p0 + 0.999 * p1.detach(), atol=1e-6)
    full, resumed = cut_and_resumed(tiny_sd3_dir, tmp_path, *over, "checkpoint_every=1")
    assert [h["train/awm_ema_decay"] for h in full.history] == pytest.approx([0.001, 0.002, 0.003])
    assert full.history[1]["train/ema_kl"] > 0
    keys = ["train/policy_loss", "train/ema_kl", "train/awm_ema_decay", "reward/mean"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]


def test_the_time_weighting_is_validated_before_the_model_loads(tmp_path):
    from flowalign.errors import ConfigError

    with pytest.raises(ConfigError, match="train.awm_time_weighting"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *AWM, "train.awm_time_weighting=t2"))
    with pytest.raises(ConfigError, match="train.awm_loss"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *AWM, "train.awm_loss=huber"))
    with pytest.raises(ConfigError, match="train.awm_ghuber_power"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *AWM, "train.awm_loss=ghuber",
                            "train.awm_ghuber_power=0"))
    with pytest.raises(ConfigError, match="train.awm_ema_decay"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *AWM, "train.awm_ema_decay=1"))
