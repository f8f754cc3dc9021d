"""GRPO-Guard: an already normalised ratio is Flow-GRPO, RatioNorm by hand on Gaussian steps, the
bias it removes, the gradient's sign, on-policy ratio 1 through the trainer."""

import pytest
import torch

from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.objectives.grpo_guard import grpo_guard_loss, ratio_norm
from flowalign.samplers.flow_sde import gaussian_log_prob
from flowalign.trainer import Trainer
from test_trainer import tiny_config

GUARD = ("method=grpo_guard", "sampling.eta=1.0", "train.clip_range=0.2")


def _step(b=4, shape=(2, 3), s=0.3, seed=0, shift=0.05):
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(b, *shape, generator=g)
    z = torch.randn(b, *shape, generator=g)
    delta = shift * torch.randn(b, *shape, generator=g)
    std = torch.full((b, 1, 1), s)
    return mu_old, z, delta, std, mu_old + s * z


def test_with_an_already_normalised_ratio_it_is_flow_grpo():
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(4, 2, 3, generator=g)
    log_prob = (0.01 * torch.randn(4, generator=g)).requires_grad_(True)
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    std = torch.ones(4, 1, 1)  # s = 1 and no mean shift (μ_θ = μ_old): RatioNorm is the identity
    guard, gs = grpo_guard_loss(log_prob, old, adv, mean=mean, old_mean=mean, std=std, clip_range=0.005)
    plain, ps = flow_grpo_loss(log_prob, old, adv, clip_range=0.005)
    assert guard.item() == pytest.approx(plain.item(), rel=1e-6)
    assert gs["clipfrac"].item() == ps["clipfrac"].item()
    (g1,) = torch.autograd.grad(guard, log_prob)
    (g2,) = torch.autograd.grad(plain, log_prob)
    assert torch.allclose(g1, g2)
    assert torch.equal(ratio_norm(torch.tensor([0.3]), torch.tensor([0.0]), torch.tensor([1.0])), torch.tensor([0.3]))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ratio_norm_of_a_gaussian_step_is_the_inner_product_of_the_mean_shift_and_the_draw(reduction):
    mu_old, z, delta, std, x_next = _step()
    log_ratio = gaussian_log_prob(x_next, mu_old + delta, std, reduction) - gaussian_log_prob(x_next, mu_old, std,
                                                                                            reduction)
    shift = (delta**2).flatten(1).sum(1) if reduction == "sum" else (delta**2).flatten(1).mean(1)
    normed = ratio_norm(log_ratio, shift, std.flatten())
    by_hand = (delta * z).flatten(1).sum(1) if reduction == "sum" else (delta * z).flatten(1).mean(1)
    assert torch.allclose(normed, by_hand, atol=1e-5)


def test_ratio_norm_removes_the_negative_bias_and_the_noise_level_dependence():
    """Over many rollout draws z: raw log r has mean −‖Δ‖²/(2s²) < 0 and spread ‖Δ‖/s; the
    normalised one has mean 0 and spread ‖Δ‖ at every noise level s."""
    g = torch.Generator().manual_seed(0)
    delta = 0.1 * torch.randn(1, 16, generator=g)
    z = torch.randn(20000, 16, generator=g)
    norm2 = (delta**2).sum()
    for s in (0.05, 0.5):
        std = torch.tensor(s)
        x_next = s * z  # μ_old = 0
        log_r = gaussian_log_prob(x_next, delta.expand_as(z), std, "sum") - gaussian_log_prob(x_next, torch.zeros_like(z),
                                                                                          std, "sum")
        assert log_r.mean().item() == pytest.approx(-norm2.item() / (2 * s * s), rel=0.05)
        assert log_r.std().item() == pytest.approx(norm2.sqrt().item() / s, rel=0.05)
        normed = ratio_norm(log_r, norm2.expand(20000), std.expand(20000))
        assert abs(normed.mean().item()) < 4 * norm2.sqrt().item() / 20000**0.5
        assert normed.std().item() == pytest.approx(norm2.sqrt().item(), rel=0.05)


def test_a_gradient_step_moves_the_mean_toward_a_good_sample_and_away_from_a_bad_one():
    mu_old, z, _, std, x_next = _step(b=1)
    for adv, sign in ((1.0, 1), (-1.0, -1)):
        mu = mu_old.clone().requires_grad_(True)
        log_prob = gaussian_log_prob(x_next, mu, std, "mean")
        old = gaussian_log_prob(x_next, mu_old, std, "mean")
        loss, _ = grpo_guard_loss(log_prob, old, torch.tensor([adv]), mean=mu, old_mean=mu_old, std=std, clip_range=0.2)
        loss.backward()
        step = -mu.grad
        assert sign * (step * (x_next - mu_old)).sum() > 0


def test_grpo_guard_is_on_policy_through_the_trainer_and_keeps_the_rollout_policy(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GUARD, "train.kl_beta=0.1"))
    trainer.train()
    first = trainer.history[0]
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)  # one update per rollout: Δμ = 0
    assert first["train/clipfrac"] == 0
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-8)
    assert all(h["train/grad_norm"] > 0 for h in trainer.history)
    # after the last epoch the kept rollout policy is the trained weights (they sample the next epoch)
    assert all(torch.equal(s, p.detach()) for s, p in zip(trainer.objective.rollout_policy.shadow, trainer.params))
    assert "rollout_policy" in trainer.objective.components()


def test_cps_is_rejected_before_the_model_loads(tmp_path):
    from flowalign.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.sde"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GUARD, "sampling.sde=cps"))
    with pytest.raises(ConfigError, match="sampling.eta"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GUARD, "sampling.eta=0"))


def test_off_policy_minibatches_use_the_rollout_policy_and_resume_exactly(tiny_sd3_dir, tmp_path):
    """Two optimizer steps per epoch: the second minibatch is off-policy (r̃ ≠ 1), scored against the
    kept rollout policy, which is checkpointed: a resumed run repeats the uninterrupted one."""
    over = (*GUARD, "train.train_batch_size=4", "train.learning_rate=1e-2")
    full = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "full", *over, "train.epochs=3"))
    full.train()
    assert any(abs(h["train/ratio"] - 1) > 1e-6 for h in full.history)
    cut = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "cut", *over, "train.epochs=1", "checkpoint_every=1"))
    cut.train()
    resumed = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "cut", *over, "train.epochs=3", "checkpoint_every=1",
                                  "resume=auto"))
    resumed.train()
    keys = ["train/policy_loss", "train/ratio", "train/raw_ratio", "reward/mean", "train/grad_norm"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
