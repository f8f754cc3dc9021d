"""Online Diffusion-DPO: a group of two is diffusers' Diffusion-DPO at the same β (through the real
objective on the tiny model), the loss and the pairs by hand, log 2 at the reference, the gradient's
sign on a toy problem, the trainer path and the rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from flowalign.objectives.base import Minibatch
from flowalign.objectives.dpo import best_and_worst, dpo_loss
from flowalign.trainer import Trainer
from helpers import cut_and_resumed, tiny_config

DPO = ("method=online_dpo", "sampling.eta=0", "train.noise_draws=2", "train.dpo_beta=50")


# -- diffusers' Diffusion-DPO, written from its source, independently of flowalign/objectives/dpo.py
# huggingface/diffusers examples/research_projects/diffusion_dpo (HEAD 58eb52c): the batch is the
# preferred half then the dispreferred half (``chunk(2)``), one noise and one timestep per pair.
def diffusers_sdxl_dpo(model_pred, ref_pred, target, beta_dpo):
    """train_diffusion_dpo_sdxl.py: model_losses = mse(model_pred, target) per sample; model_diff =
    w − l; the same for the reference; scale_term = −0.5·beta_dpo; inside_term = scale_term·(model_diff
    − ref_diff); loss = −logsigmoid(inside_term).mean()."""
    model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
    model_losses_w, model_losses_l = model_losses.chunk(2)
    model_diff = model_losses_w - model_losses_l
    ref_loss = F.mse_loss(ref_pred.float(), target.float(), reduction="none")
    ref_loss = ref_loss.mean(dim=list(range(1, len(ref_loss.shape))))
    ref_losses_w, ref_losses_l = ref_loss.chunk(2)
    ref_diff = ref_losses_w - ref_losses_l
    scale_term = -0.5 * beta_dpo
    inside_term = scale_term * (model_diff - ref_diff)
    return -1 * F.logsigmoid(inside_term).mean()


def diffusers_sd15_dpo(model_pred, ref_pred, target, beta_dpo):
    """train_diffusion_dpo.py (loss_type "sigmoid"): logits = ref_diff − model_diff; loss =
    −logsigmoid(beta_dpo·logits).mean(): no ½, so its beta_dpo is the SDXL script's (and ours) / 2."""
    model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
    model_losses_w, model_losses_l = model_losses.chunk(2)
    ref_loss = F.mse_loss(ref_pred.float(), target.float(), reduction="none")
    ref_loss = ref_loss.mean(dim=list(range(1, len(ref_loss.shape))))
    ref_losses_w, ref_losses_l = ref_loss.chunk(2)
    logits = (ref_losses_w - ref_losses_l) - (model_losses_w - model_losses_l)
    return -1 * F.logsigmoid(beta_dpo * logits).mean()


def test_the_kernel_on_pairs_is_diffusers_diffusion_dpo_at_the_same_beta():
    g = torch.Generator().manual_seed(0)
    model_pred, ref_pred, target = (torch.randn(6, 2, 3, 3, generator=g) for _ in range(3))
    err = ((model_pred - target) ** 2).flatten(1).mean(1)
    ref = ((ref_pred - target) ** 2).flatten(1).mean(1)
    ours, _ = dpo_loss(err[:3], err[3:], ref[:3], ref[3:], beta=7.0)
    assert ours.item() == pytest.approx(diffusers_sdxl_dpo(model_pred, ref_pred, target, 7.0).item(), rel=1e-6)
    assert ours.item() == pytest.approx(diffusers_sd15_dpo(model_pred, ref_pred, target, 3.5).item(), rel=1e-6)
    assert ours.item() != pytest.approx(diffusers_sd15_dpo(model_pred, ref_pred, target, 7.0).item(), rel=1e-3)


@pytest.fixture
def two_per_group(tiny_sd3_dir, tmp_path):
    """A trainer of groups of two, one epoch sampled and its draws made, the LoRA moved off zero so
    that the policy differs from the reference."""
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DPO, "train.group_size=2", "train.groups_per_epoch=4",
                                  "train.train_batch_size=8"))
    trainer.sampler.prepare(trainer.objective.rollout)
    batch = trainer.sample_epoch()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    trainer.objective.begin_update(batch)
    return trainer, batch


def test_a_group_of_two_is_diffusers_diffusion_dpo_through_the_objective(two_per_group):
    trainer, batch = two_per_group
    objective, adapter, traj = trainer.objective, trainer.adapter, batch.traj
    n = len(batch.specs)
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(1))
    idx = torch.arange(n)
    mb = Minibatch.of(batch, idx, advantages, torch.ones(n, dtype=torch.bool))
    beta = trainer.config.train.dpo_beta
    for j in range(2):
        ours, stats = objective.loss(mb, j)
        # the winner of each group of two is its sample with the higher advantage; diffusers' layout
        first = torch.arange(0, n, 2)
        up = (advantages[first + 1] > advantages[first]).long()
        w, lo = first + up, first + 1 - up
        rows = torch.cat([w, lo])
        steps, noise = objective.draws[0][rows, j], objective.draws[1][rows, j]
        assert torch.equal(noise[: n // 2], noise[n // 2:]) and torch.equal(steps[: n // 2], steps[n // 2:])
        x0 = traj.samples[rows]
        sigma = traj.sigmas[steps].view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x0 + sigma * noise
        timesteps, cond = traj.timesteps[steps], traj.cond[rows]
        with torch.no_grad():
            model_pred = adapter.predict(noisy, timesteps, cond, 1.0, model=trainer.model)
            with adapter.reference():
                ref_pred = adapter.predict(noisy, timesteps, cond, 1.0)
        target = noise - x0  # the flow-matching velocity target (flow_grpo / Flow-Factory)
        expected = diffusers_sdxl_dpo(model_pred, ref_pred, target, beta)
        assert ours.item() == pytest.approx(expected.item(), rel=1e-5)
        assert ours.item() == pytest.approx(diffusers_sd15_dpo(model_pred, ref_pred, target, beta / 2).item(), rel=1e-5)
        assert abs(ours.item() - math.log(2)) > 1e-4  # the policy is off the reference: a real comparison


def test_hand_computed_loss():
    # pair 1: Δ = (0.1 − 0.2) − (0.4 − 0.3) = −0.2, inside = −½·2·(−0.2) = 0.2
    # pair 2: Δ = (0.5 − 0.3) − (0.2 − 0.2) = 0.2, inside = −0.2; pair 3 has no pair (weight 0)
    err_w, ref_w = torch.tensor([0.1, 0.5, 9.0]), torch.tensor([0.2, 0.3, 0.0])
    err_l, ref_l = torch.tensor([0.4, 0.2, 0.0]), torch.tensor([0.3, 0.2, 9.0])
    loss, stats = dpo_loss(err_w, err_l, ref_w, ref_l, beta=2.0, weight=torch.tensor([1.0, 1.0, 0.0]))
    expected = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(0.2))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["dpo_accuracy"].item() == pytest.approx(0.5)
    assert stats["dpo_reward_chosen"].item() == pytest.approx((-1 * -0.1 + -1 * 0.2) / 2)  # −½β·(err − ref)
    assert stats["dpo_reward_rejected"].item() == pytest.approx((-1 * 0.1 + -1 * 0.0) / 2)
    assert stats["dpo_err_chosen"].item() == pytest.approx(0.3)


def test_pairs_are_the_best_and_the_worst_of_each_group():
    adv = torch.tensor([[0.5, -1.0, 2.0, 0.1],  # best 2, worst 1
                        [1.0, 1.0, 1.0, 1.0],   # tied: the first index both times (Flow-Factory's (x, x))
                        [3.0, -2.0, 0.0, 5.0],  # 3 and 1 have no reward: best 0, worst 2
                        [3.0, 0.0, 0.0, 0.0],   # one scored sample: no pair
                        [0.0, 2.0, 2.0, -1.0]])  # first of the tied maxima
    valid = torch.tensor([[True] * 4, [True] * 4, [True, False, True, False], [True, False, False, False], [True] * 4])
    chosen, rejected, has_pair = best_and_worst(adv, valid)
    assert chosen.tolist()[:3] == [2, 0, 0] and rejected.tolist()[:3] == [1, 0, 2]
    assert chosen[4].item() == 1 and rejected[4].item() == 3
    assert has_pair.tolist() == [True, True, True, False, True]


def test_at_the_reference_the_loss_is_log_2_and_a_tied_pair_has_no_gradient():
    err = torch.rand(5, requires_grad=True)
    loss, stats = dpo_loss(err, err.detach().flip(0), err.detach(), err.detach().flip(0), beta=100.0)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    assert stats["dpo_accuracy"].item() == 0.0
    e = torch.tensor([0.3], requires_grad=True)  # a pair (x, x): the same error on both sides
    loss, _ = dpo_loss(e, e, torch.tensor([0.1]), torch.tensor([0.1]), beta=100.0)
    (grad,) = torch.autograd.grad(loss, e)
    assert loss.item() == pytest.approx(math.log(2)) and grad.item() == 0.0


def test_the_first_update_of_a_run_is_at_the_reference(tiny_sd3_dir, tmp_path):
    """The LoRA starts at zero, so the policy is the reference: every pair's Δ is 0, L = log 2."""
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DPO))
    trainer.sampler.prepare(trainer.objective.rollout)
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    trainer.objective.begin_update(batch)
    valid = torch.isfinite(advantages)
    mb = Minibatch.of(batch, torch.arange(len(batch.specs)), torch.nan_to_num(advantages), valid)
    loss, stats = trainer.objective.loss(mb, 0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert stats["dpo_reward_chosen"].item() == pytest.approx(0.0, abs=1e-6)


def test_the_gradient_lowers_the_preferred_error_and_raises_the_other_on_a_toy_problem():
    """A toy velocity model v_θ(x) = a·x + b on 1-D data: one SGD step on the DPO loss of a pair, from
    the reference, moves the policy's error on the preferred sample down and on the other one up."""
    x_w, x_l, eps, sigma = torch.tensor([1.0, 0.5]), torch.tensor([-1.0, 0.2]), torch.tensor([0.3, -0.7]), 0.6
    theta = torch.tensor([0.2, -0.1], requires_grad=True)  # (a, b); the reference: the same values, frozen
    ref = theta.detach().clone()

    def err(params, x0):
        x_t = (1 - sigma) * x0 + sigma * eps
        return ((params[0] * x_t + params[1] - (eps - x0)) ** 2).mean().reshape(1)

    loss, _ = dpo_loss(err(theta, x_w), err(theta, x_l), err(ref, x_w), err(ref, x_l), beta=10.0)
    loss.backward()
    with torch.no_grad():
        stepped = theta - 0.01 * theta.grad
    assert err(stepped, x_w) < err(ref, x_w) and err(stepped, x_l) > err(ref, x_l)
    # the gradient on the errors themselves: +β/2·σ(½βΔ) on the preferred, − on the other (Δ = 0: ±β/4)
    e_w, e_l = torch.tensor([0.4], requires_grad=True), torch.tensor([0.4], requires_grad=True)
    loss, _ = dpo_loss(e_w, e_l, torch.tensor([0.4]), torch.tensor([0.4]), beta=10.0)
    g_w, g_l = torch.autograd.grad(loss, [e_w, e_l])
    assert g_w.item() == pytest.approx(2.5) and g_l.item() == pytest.approx(-2.5)


def test_online_dpo_trains_through_the_trainer(tiny_sd3_dir, tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DPO, "train.train_batch_size=4"))
    assert trainer.objective.unit == 4
    sizes = []
    predict = trainer.adapter.predict

    def recorded(x, *args, **kwargs):
        sizes.append(len(x))
        return predict(x, *args, **kwargs)

    monkeypatch.setattr(trainer.adapter, "predict", recorded)
    before = [p.detach().clone() for p in trainer.params]
    trainer.train()
    assert all(math.isfinite(h["train/policy_loss"]) and h["train/grad_norm"] > 0 for h in trainer.history)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.params, before))
    assert 2 in sizes  # a minibatch of one group of four runs only its pair through the model


def test_flow_grpos_refreshed_reference_samples_and_is_copied_every_n_steps(tiny_sd3_dir, tmp_path):
    """train.dpo_ref_update_every = 2 at one optimizer step per epoch: the copy stays at the initial
    weights after epoch 1 (1 step) and is the trained weights after epoch 2 (2 steps, a multiple of 2);
    the rollouts are sampled with it swapped in, and the loss compares against it."""
    over = (*DPO, "train.dpo_ref_update_every=2")
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "a", *over, "train.epochs=1"))
    start = [p.detach().clone() for p in trainer.params]
    assert trainer.objective.stateful and trainer.config.train.train_batch_size == 8  # one step per epoch
    trainer.train()
    assert trainer.history[0]["train/dpo_ref_refreshed"] == 0.0
    assert all(torch.equal(s, p0) for s, p0 in zip(trainer.objective.reference.shadow, start))
    assert any(not torch.equal(p, p0) for p, p0 in zip(trainer.params, start))
    with trainer.objective.sampling_weights():  # the rollouts' weights: the reference copy
        assert all(torch.equal(p, p0) for p, p0 in zip(trainer.params, start))
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "b", *over))
    trainer.train()
    assert [h["train/dpo_ref_refreshed"] for h in trainer.history] == [0.0, 1.0]
    assert all(torch.equal(s, p) for s, p in zip(trainer.objective.reference.shadow, trainer.params))
    # at the refreshed reference the next loss is log 2 again: the reference is the copy, not the LoRA off
    batch = trainer.sample_epoch()
    trainer.objective.begin_update(batch)
    n = len(batch.specs)
    mb = Minibatch.of(batch, torch.arange(n), torch.randn(n), torch.ones(n, dtype=torch.bool))
    loss, _ = trainer.objective.loss(mb, 0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_the_refreshed_reference_resumes_exactly(tiny_sd3_dir, tmp_path):
    full, resumed = cut_and_resumed(tiny_sd3_dir, tmp_path, *DPO, "train.dpo_ref_update_every=2", "checkpoint_every=1")
    keys = ["train/policy_loss", "train/dpo_ref_refreshed", "reward/mean"]
    assert [h["train/dpo_ref_refreshed"] for h in full.history] == [0.0, 1.0, 0.0]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]


def test_rules_are_checked_before_the_model_loads(tmp_path):
    from flowalign.errors import ConfigError

    missing = tmp_path / "no-model-here"
    for override, key in (("train.train_batch_size=6", "train.train_batch_size"), ("model.lora_rank=0", "model.lora_rank"),
                          ("train.kl_beta=0.01", "train.kl_beta"), ("train.dpo_beta=0", "train.dpo_beta"),
                          ("train.dpo_ref_update_every=-1", "train.dpo_ref_update_every")):
        with pytest.raises(ConfigError, match=key):
            Trainer(tiny_config(missing, tmp_path, *DPO, override))
    # full fine-tuning is valid with a refreshed copy of the weights as the reference
    from flowalign.config import load_config
    from flowalign.objectives.dpo import DPO as Objective

    config = load_config("configs/shapes_online_dpo.yaml", ["model.lora_rank=0", "train.dpo_ref_update_every=40"])
    assert all(ok for _, ok, _ in Objective.validate(config))
    with pytest.raises(ConfigError, match="train.group_size"):
        Trainer(tiny_config(missing, tmp_path, *DPO, "train.group_size=1", "train.train_batch_size=4",
                            "train.sample_batch_size=2"))
    with pytest.raises(ConfigError, match="train.dpo_beta"):
        Trainer(tiny_config(missing, tmp_path, "train.dpo_beta=10"))  # an option of online_dpo only


def test_the_real_model_recipe_mirrors_flow_factorys_sd35_example():
    """X-GenGroup/Flow-Factory examples/dpo/lora/sd3_5/default.yaml, key by key (see the recipe)."""
    from flowalign.config import load_config

    c = load_config("configs/sd35m_online_dpo_pickscore.yaml")
    assert (c.method, c.model.path, c.model.lora_rank, c.model.lora_alpha, c.model.height) == (
        "online_dpo", "stabilityai/stable-diffusion-3.5-medium", 32, 64.0, 512)
    assert (c.sampling.num_steps, c.sampling.eta, c.sampling.guidance_scale, c.eval.num_steps) == (40, 0.0, 1.0, 40)
    assert (c.train.dpo_beta, c.train.group_size, c.train.learning_rate, c.train.noise_draws, c.train.kl_beta) == (
        100.0, 4, 1e-5, 1, 0.0)
    assert c.train.train_batch_size == c.train.groups_per_epoch * c.train.group_size  # one step per epoch
