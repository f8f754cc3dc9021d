"""GRPO-Guard: an already normalised ratio is Flow-GRPO, RatioNorm by hand on Gaussian steps, the
bias it removes, the 1/|dt| reweighting by hand on real SDE steps, the gradient's sign, on-policy
ratio 1 through the trainer."""

import pytest
import torch

from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.objectives.grpo_guard import grpo_guard_loss, ratio_norm
from flowalign.samplers.flow_sde import dance_grpo_sde_step, flow_grpo_sde_step, gaussian_log_prob
from flowalign.trainer import Trainer
from helpers import tiny_config

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


def _velocity_grad(sigma, sigma_next, eta, z, adv, step_weight, kl_beta=0.0, step=flow_grpo_sde_step):
    """∂L/∂v of GRPO-Guard's loss on one real SDE step, on-policy (v = v_old), the rollout's
    x' = μ_old + std·z; with a reference velocity 0.1 away when kl_beta > 0."""
    g = torch.Generator().manual_seed(3)
    x, v_old = torch.randn(*z.shape, generator=g), torch.randn(*z.shape, generator=g)
    old = step(v_old, x, sigma, sigma_next, eta, noise=z)
    v = v_old.clone().requires_grad_(True)
    new = step(v, x, sigma, sigma_next, eta, prev_sample=old.prev_sample)
    ref = step(v_old + 0.1, x, sigma, sigma_next, eta, prev_sample=old.prev_sample)
    loss, stats = grpo_guard_loss(new.log_prob, old.log_prob, adv, mean=new.mean, old_mean=old.mean, std=new.std,
                                  clip_range=0.2, step_weight=step_weight, beta=kl_beta, ref_mean=ref.mean)
    (grad,) = torch.autograd.grad(loss, v)
    return grad, stats


def test_the_inverse_dt_reweighting_gives_every_step_the_same_velocity_gradient_by_hand():
    """On-policy ∇ log r̃ = ⟨z, ∂μ/∂v⟩ with ∂μ/∂v = dt·(1 + η²/2) for Flow-GRPO's SDE (σ_t² = η²σ/(1 − σ)),
    so the loss −A·r̃/|dt| (mean reduction over N elements) has ∂L/∂v = A·(1 + η²/2)·z/N at every step,
    whatever its σ and step size; without the reweighting it is |dt| times that."""
    z = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    adv, eta, n = torch.tensor([1.5, -0.5]), 0.7, 12
    by_hand = adv.view(-1, 1, 1) * (1 + eta**2 / 2) * z / n / 2  # / 2: the mean over the batch of two
    for sigma, sigma_next in ((0.9, 0.6), (0.3, 0.25), (0.1, 0.02)):
        dt = sigma_next - sigma
        grad, _ = _velocity_grad(sigma, sigma_next, eta, z, adv, step_weight=1 / abs(dt))
        assert torch.allclose(grad, by_hand, rtol=1e-4, atol=1e-7)
        plain, _ = _velocity_grad(sigma, sigma_next, eta, z, adv, step_weight=1.0)
        assert torch.allclose(plain, abs(dt) * by_hand, rtol=1e-4, atol=1e-8)


def test_with_dance_grpo_s_sde_the_reweighted_gradient_is_its_drift_factor_times_z():
    """DanceGRPO's μ = x + v·dt − ½η²·score·dt, score = −(x − (1 − σ)·x̂0)/σ²: ∂μ/∂v = dt·(1 + η²(1 − σ)/(2σ)),
    so with 1/|dt| the on-policy ∂L/∂v is A·(1 + η²(1 − σ)/(2σ))·z/N, free of the step size."""
    z = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(4))
    adv, eta = torch.tensor([2.0]), 0.3
    for sigma, sigma_next in ((0.8, 0.5), (0.4, 0.38)):
        grad, _ = _velocity_grad(sigma, sigma_next, eta, z, adv, 1 / (sigma - sigma_next), step=dance_grpo_sde_step)
        assert torch.allclose(grad, 2.0 * (1 + eta**2 * (1 - sigma) / (2 * sigma)) * z / 6, rtol=1e-4, atol=1e-7)


def test_the_reweighting_scales_the_policy_term_and_not_the_kl():
    z = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    adv = torch.tensor([1.0, -1.0])
    with_kl, stats = _velocity_grad(0.5, 0.4, 0.7, z, adv, step_weight=10.0, kl_beta=0.3)
    policy_only, _ = _velocity_grad(0.5, 0.4, 0.7, z, adv, step_weight=10.0)
    kl_only, _ = _velocity_grad(0.5, 0.4, 0.7, z, torch.zeros(2), step_weight=10.0, kl_beta=0.3)
    kl_unweighted, _ = _velocity_grad(0.5, 0.4, 0.7, z, torch.zeros(2), step_weight=1.0, kl_beta=0.3)
    assert torch.allclose(with_kl, policy_only + kl_only, atol=1e-7)
    assert torch.allclose(kl_only, kl_unweighted)  # the KL keeps Flow-GRPO's strength
    assert stats["kl"].item() > 0


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


def test_the_step_weight_through_the_trainer_is_one_over_dt(tiny_sd3_dir, tmp_path, monkeypatch):
    """The objective passes 1/|dt| = 1/(σ − σ') of each trained step to the loss (``none``: 1)."""
    import flowalign.objectives.grpo_guard as guard

    seen = []

    def recording(*args, step_weight, **kwargs):  # the real loss, recording the weight it was given
        seen.append(step_weight)
        return grpo_guard_loss(*args, step_weight=step_weight, **kwargs)

    monkeypatch.setattr(guard, "grpo_guard_loss", recording)
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "a", *GUARD, "train.epochs=1"))
    trainer.train()
    sigmas = trainer.adapter.schedule(4).sigmas.tolist()
    expected = {round(1 / (a - b), 4) for a, b in zip(sigmas[:-2], sigmas[1:-1])}  # the last step is not trained
    assert {round(w, 4) for w in seen} == expected
    seen.clear()
    Trainer(tiny_config(tiny_sd3_dir, tmp_path / "b", *GUARD, "train.epochs=1", "train.guard_step_weight=none")).train()
    assert seen and all(w == 1.0 for w in seen)


def test_cps_is_rejected_before_the_model_loads(tmp_path):
    from flowalign.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.sde"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GUARD, "sampling.sde=cps"))
    with pytest.raises(ConfigError, match="sampling.eta"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GUARD, "sampling.eta=0"))
    with pytest.raises(ConfigError, match="train.guard_step_weight"):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GUARD, "train.guard_step_weight=dt"))


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
