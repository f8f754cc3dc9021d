"""DGPO: the group-of-two reduction to Diffusion-DPO, the advantage-weighted group margin by hand,
the cancellation that makes it a group preference, the gradient's sign and its agreement with the
authors' surrogate, the timestep clip, the trainer path."""

import pytest
import torch
import torch.nn.functional as F

from flowalign.objectives.dgpo import dgpo_loss
from flowalign.trainer import Trainer
from helpers import tiny_config

DGPO = ("method=dgpo", "sampling.eta=0", "train.noise_draws=2", "train.dgpo_beta=10")


def diffusion_dpo(mse_w, mse_l, ref_w, ref_l, beta):
    """Diffusion-DPO (Wallace et al. 2023) as diffusers' train_diffusion_dpo.py computes it, in
    flow-matching form, written independently: −log σ(−½·β·[(mse_θ,w − mse_ref,w) − (mse_θ,l − mse_ref,l)])."""
    return -F.logsigmoid(-0.5 * beta * ((mse_w - ref_w) - (mse_l - ref_l)))


def test_a_group_of_two_is_diffusion_dpo():
    g = torch.Generator().manual_seed(0)
    mse_theta, mse_ref = torch.rand(5, 2, generator=g), torch.rand(5, 2, generator=g)
    loss, _ = dgpo_loss(mse_theta, mse_ref, torch.tensor([[1.0, -1.0]] * 5), beta=3.0)
    expected = diffusion_dpo(mse_theta[:, 0], mse_theta[:, 1], mse_ref[:, 0], mse_ref[:, 1], 3.0).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # the same β as Diffusion-DPO's
    # the winner is whichever has the positive advantage; a magnitude a scales β
    loss, _ = dgpo_loss(mse_theta, mse_ref, torch.tensor([[-0.5, 0.5]] * 5), beta=3.0)
    expected = diffusion_dpo(mse_theta[:, 1], mse_theta[:, 0], mse_ref[:, 1], mse_ref[:, 0], 1.5).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_hand_computed_group_margin():
    mse_theta = torch.tensor([[0.1, 0.4, 0.3]])
    mse_ref = torch.tensor([[0.2, 0.2, 0.3]])
    adv = torch.tensor([[1.0, -0.5, -0.5]])
    # s = −2·(Δ) = (0.2, −0.4, 0); margin = (1·0.2 − 0.5·(−0.4) − 0.5·0) / 3 = 0.4 / 3  (w = |A| / k)
    loss, stats = dgpo_loss(mse_theta, mse_ref, adv, beta=2.0)
    assert stats["dgpo_margin"].item() == pytest.approx(0.4 / 3)
    assert loss.item() == pytest.approx(-torch.log(torch.sigmoid(torch.tensor(0.4 / 3))).item())
    assert stats["dgpo_accuracy"].item() == 1.0


def test_the_kl_enters_at_beta_times_kl_beta_so_the_total_is_beta_times_the_authors_loss():
    """Their loss: surrogate + β_kl·mean‖v_θ − v_ref‖²; ours: L + β·kl_beta·KL, i.e. β times theirs."""
    mse_theta = torch.tensor([[0.2, 0.5]], requires_grad=True)
    mse_ref = torch.tensor([[0.3, 0.3]])
    kl = torch.tensor([[0.04, 0.16]], requires_grad=True)
    loss, stats = dgpo_loss(mse_theta, mse_ref, torch.tensor([[1.0, -1.0]]), beta=10.0, kl=kl, kl_beta=0.02,
                            weight=torch.tensor([[1.0, 1.0]]))
    margin = (1.0 * -10.0 * (0.2 - 0.3) - 1.0 * -10.0 * (0.5 - 0.3)) / 2  # = 1.5
    assert stats["kl"].item() == pytest.approx(0.1)
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(margin)).item() + 10.0 * 0.02 * 0.1, rel=1e-6)
    (g_kl,) = torch.autograd.grad(loss, kl)
    assert torch.allclose(g_kl, torch.tensor([[0.1, 0.1]]))  # β·kl_beta / 2 samples
    with pytest.raises(ValueError, match="kl"):
        dgpo_loss(mse_theta, mse_ref, torch.tensor([[1.0, -1.0]]), beta=10.0, kl_beta=0.02)


def test_the_gradient_is_beta_times_the_authors_surrogate():
    """The authors' code (written here independently from its description) back-propagates
    mean_i σ(Σ_group A·β·Δmse / k)·A_i·mse_θ,i with the sigmoid detached; ours is −log σ of the group
    margin, whose gradient is β times that."""
    g = torch.Generator().manual_seed(2)
    mse_theta = torch.rand(3, 4, generator=g).requires_grad_(True)
    mse_ref = torch.rand(3, 4, generator=g)
    adv = torch.randn(3, 4, generator=g)
    adv = adv - adv.mean(1, keepdim=True)
    beta, k = 7.0, 4
    group_sum = (adv * beta * (mse_theta.detach() - mse_ref) / k).sum(1, keepdim=True)
    theirs = (torch.sigmoid(group_sum) * adv * mse_theta).mean()
    ours, _ = dgpo_loss(mse_theta, mse_ref, adv, beta=beta)
    (g_theirs,) = torch.autograd.grad(theirs, mse_theta)
    (g_ours,) = torch.autograd.grad(ours, mse_theta)
    assert torch.allclose(g_ours, beta * g_theirs, rtol=1e-5, atol=1e-8)


def test_at_the_reference_the_loss_is_log_2_and_a_shared_shift_cancels():
    """s = 0 at the reference: L = log 2. A change that moves every sample's error by the same
    amount (what a prompt-wide partition term does) leaves the margin unchanged, since Σ A = 0."""
    mse = torch.rand(3, 4)
    adv = torch.tensor([[1.5, 0.5, -1.0, -1.0]] * 3)
    loss, _ = dgpo_loss(mse, mse, adv, beta=5.0)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item())
    shifted, _ = dgpo_loss(mse + 0.3, mse, adv, beta=5.0)
    assert shifted.item() == pytest.approx(loss.item(), rel=1e-6)


def test_the_gradient_lowers_the_error_of_good_samples_and_raises_that_of_bad_ones():
    mse_theta = torch.tensor([[0.5, 0.5, 0.5]], requires_grad=True)
    loss, _ = dgpo_loss(mse_theta, torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([[1.0, 0.0, -1.0]]), beta=1.0)
    loss.backward()
    step = -mse_theta.grad[0]
    assert step[0] < 0 and step[2] > 0 and step[1] == 0  # a zero-advantage sample is left alone


def test_dgpo_trains_whole_groups_through_the_trainer(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DGPO, "train.train_batch_size=4", "train.kl_beta=0.01"))
    assert trainer.objective.unit == 4
    trainer.train()
    assert 0 <= trainer.history[0]["train/kl"] < 1e-5  # the first step is at the reference, the second one step off
    assert trainer.history[1]["train/kl"] > trainer.history[0]["train/kl"]
    assert all(h["train/grad_norm"] > 0 for h in trainer.history)
    # the first update starts at the reference (LoRA initialised to zero): every margin is 0, loss log 2
    assert trainer.history[0]["train/policy_loss"] == pytest.approx(0.6931, abs=2e-3)


def test_the_timestep_clip_draws_only_the_high_noise_levels(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DGPO, "train.train_batch_size=4", "train.epochs=1",
                                  "train.dgpo_noise_levels=2"))
    trainer.train()
    steps = trainer.objective.draws[0]
    assert set(steps.unique().tolist()) == {0, 1}  # two draws per group among the first two levels
    assert torch.equal(steps.view(-1, 4, 2), steps.view(-1, 4, 2)[:, :1].expand(-1, 4, -1))  # shared in a group


def test_rules_are_checked_before_the_model_loads(tmp_path):
    from flowalign.errors import ConfigError

    missing = tmp_path / "no-model-here"
    with pytest.raises(ConfigError, match="train.train_batch_size"):
        Trainer(tiny_config(missing, tmp_path, *DGPO, "train.train_batch_size=6"))
    with pytest.raises(ConfigError, match="model.lora_rank"):
        Trainer(tiny_config(missing, tmp_path, *DGPO, "model.lora_rank=0"))
    with pytest.raises(ConfigError, match="train.dgpo_noise_levels"):
        Trainer(tiny_config(missing, tmp_path, *DGPO, "train.dgpo_noise_levels=1"))  # fewer than noise_draws
