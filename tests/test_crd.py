"""CRD: zero loss at matched rewards (the per-prompt constant cancels), hand-computed values of the
implicit reward, the centred loss, the centring weights, the reward-adaptive KL and the stratified
steps; the gradient's sign on a toy problem; θ = old at each run's start (r_θ ≡ 0); the decay
schedules of the old and sampling copies; the CFG reference in the KL; and the trainer path on the
tiny SD3 fixture, with an exact resume."""

import math

import pytest
import torch

from flowalign.objectives.crd import (centring_weights, crd_loss, decay_at_step, implicit_reward, parse_decay,
                                      stratified_steps)
from flowalign.trainer import Trainer
from helpers import cut_and_resumed, tiny_config

CRD = ("method=crd", "sampling.eta=0", "train.noise_draws=2", "train.kl_beta=0.1")


def _rewards(seed=0, groups=3, k=4):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(groups, k, generator=g), torch.randn(groups, 1, generator=g)


# -- the reduction: matched rewards ------------------------------------------------------------------
@pytest.mark.parametrize("temp", [-1.0, 0.0, 0.7])
@pytest.mark.parametrize("beta", [1.0, 2.5])
def test_the_loss_is_zero_with_zero_gradient_when_the_implicit_rewards_match_the_centred_ones(temp, beta):
    """r_θ = (r + c)/β with any constant c per prompt (the log-partition the centring removes)."""
    r, c = _rewards()
    r_theta = ((r + 3.0 * c) / beta).requires_grad_(True)
    loss, stats = crd_loss(r_theta, r, beta=beta, advantage_max=5.0, weight_temp=temp)
    assert loss.item() == pytest.approx(0.0, abs=1e-12) and stats["crd_gap"].item() == pytest.approx(0.0, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, r_theta)
    assert torch.allclose(grad, torch.zeros_like(grad), atol=1e-6)  # float32 rounding of the centres
    # bce is not 0 there (the targets' entropy), but it is its minimum: the gradient σ(βR_θ,c) − σ(R_c) vanishes
    loss, _ = crd_loss(r_theta, r, beta=beta, advantage_max=5.0, weight_temp=temp, loss_type="bce")
    (grad,) = torch.autograd.grad(loss, r_theta)
    assert loss.item() > 0 and torch.allclose(grad, torch.zeros_like(grad), atol=1e-6)


def test_a_mismatch_is_positive_and_each_prompt_is_centred_on_its_own():
    r, c = _rewards()
    r_theta = r + 0.3 * torch.randn(r.shape, generator=torch.Generator().manual_seed(1))
    loss, _ = crd_loss(r_theta, r, beta=1.0, advantage_max=5.0)
    assert loss.item() > 0
    shifted, _ = crd_loss(r_theta + 10 * c, r, beta=1.0, advantage_max=5.0)  # another constant per group
    assert shifted.item() == pytest.approx(loss.item(), rel=1e-5)
    mixed, _ = crd_loss(r_theta.reshape(1, -1) + 10 * c.repeat_interleave(4).reshape(1, -1), r.reshape(1, -1),
                        beta=1.0, advantage_max=5.0)  # one centring set across prompts: the constants no longer cancel
    assert mixed.item() > 10 * loss.item()


# -- hand-computed values -----------------------------------------------------------------------------
def test_implicit_reward_by_hand_plain_and_adaptive():
    v_theta, v_old, target = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    # errors θ: (1, 2), old: (0, −1)
    assert implicit_reward(v_theta, v_old, target, adaptive=False).item() == pytest.approx(-((1 - 0) + (4 - 1)) / 2)
    # w_θ = mean(1, 2) = 1.5, w_old = mean(0, 1) = 0.5: −mean(1/1.5 − 0, 4/1.5 − 1/0.5)
    assert implicit_reward(v_theta, v_old, target).item() == pytest.approx(-(1 / 1.5 + (4 / 1.5 - 2)) / 2, rel=1e-6)
    # at θ = old it is exactly 0, and its weight stays detached: the gradient is −2·err_θ/(w_θ·n)
    v = v_old.clone().requires_grad_(True)
    r_theta = implicit_reward(v + 0.0, v_old, target)
    assert r_theta.item() == 0.0
    (grad,) = torch.autograd.grad(r_theta.sum(), v)
    assert torch.allclose(grad, torch.tensor([[0.0, 2.0]]) / (0.5 * 2))


def test_the_loss_and_the_reward_adaptive_kl_by_hand():
    r = torch.tensor([[1.0, 0.5, 0.0]])
    r_theta = torch.tensor([[0.2, 0.0, -0.1]])
    kl = torch.tensor([[1.0, 2.0, 3.0]])
    # R_c = (0.5, 0, −0.5); R_θ,c = r_θ − 0.1/3; β = 2
    diff = [2 * (0.2 - 0.1 / 3) - 0.5, 2 * (0.0 - 0.1 / 3) - 0.0, 2 * (-0.1 - 0.1 / 3) + 0.5]
    matching = sum(d * d for d in diff) / 3
    loss, stats = crd_loss(r_theta, r, beta=2.0, advantage_max=5.0)
    assert stats["crd_matching"].item() == pytest.approx(matching, rel=1e-6)
    assert loss.item() == pytest.approx(matching * 5.0 / 2.0, rel=1e-6)
    # KL weight c_min + r·(1 − c_min), c_min = 1e-4 / λ = 1e-3
    c_min = 1e-3
    adaptive = 0.1 * sum((c_min + ri * (1 - c_min)) * ki for ri, ki in zip([1.0, 0.5, 0.0], [1.0, 2.0, 3.0])) / 3
    loss_kl, stats = crd_loss(r_theta, r, beta=2.0, advantage_max=5.0, kl=kl, kl_beta=0.1)
    assert loss_kl.item() == pytest.approx(matching * 2.5 + adaptive, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(2.0)
    plain, _ = crd_loss(r_theta, r, beta=2.0, advantage_max=5.0, kl=kl, kl_beta=0.1, reward_adaptive_kl=False)
    assert plain.item() == pytest.approx(matching * 2.5 + 0.1 * 2.0, rel=1e-6)
    # a sample with a NaN reward (valid false) leaves the centring and the means
    loss_v, _ = crd_loss(torch.tensor([[0.2, 0.0, 7.0]]), torch.tensor([[1.0, 0.0, 0.3]]), beta=1.0, advantage_max=5.0,
                         valid=torch.tensor([[True, True, False]]))
    assert loss_v.item() == pytest.approx(5.0 * ((0.1 - 0.5) ** 2 + (-0.1 + 0.5) ** 2) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="kl"):
        crd_loss(r_theta, r, beta=2.0, advantage_max=5.0, kl_beta=0.1)


def test_the_centring_weights_by_hand_including_the_authors_hard_selection():
    r, valid = torch.tensor([[1.0, 0.5, 0.0]]), torch.ones(1, 3, dtype=torch.bool)
    (uniform,) = centring_weights(r, -1.0, valid)
    assert torch.allclose(uniform, torch.full((1, 3), 1 / 3))
    plus, minus = centring_weights(r, 0.5, valid)
    e = torch.exp(torch.tensor([2.0, 1.0, 0.0]))
    assert torch.allclose(plus, e / e.sum()) and torch.allclose(minus, e.flip(0) / e.sum())
    # hard selection: softmax of r over r > 0 (not temperature-scaled); r ∈ [0, 1] has no r < 0 → uniform
    plus, minus = centring_weights(r, 0.0, valid)
    e = torch.tensor([math.e, math.exp(0.5), 0.0])
    assert torch.allclose(plus, e / e.sum()) and torch.allclose(minus, torch.full((1, 3), 1 / 3))
    # the two-way loss is the mean of the two directions' losses
    r_theta = torch.tensor([[0.3, -0.2, 0.1]])
    both, _ = crd_loss(r_theta, r, beta=1.0, advantage_max=1.0, weight_temp=0.5)
    one = [((r_theta - (r_theta * p).sum()) - (r - (r * p).sum())).pow(2).mean() for p in centring_weights(r, 0.5, valid)]
    assert both.item() == pytest.approx(((one[0] + one[1]) / 2).item(), rel=1e-6)


def test_the_authors_stratified_steps_and_decay_schedules():
    g = torch.Generator().manual_seed(0)
    steps = stratified_steps(5000, 10, 4, g)  # strata of linspace(0, 9, 5) = 0, 2.25, 4.5, 6.75, 9
    for j, allowed in enumerate([{0, 1}, {2, 3}, {4, 5}, {6, 7, 8}]):
        assert set(steps[:, j].tolist()) == allowed
    steps = stratified_steps(2000, 10, 20, g)  # their SD3.5 setting: 20 steps over 10, each about twice, never the last
    assert set(steps.flatten().tolist()) == set(range(9))
    assert decay_at_step(0, "0-0.25-0.005-0.999") == 0.25
    assert decay_at_step(10, "0-0.25-0.005-0.999") == pytest.approx(0.30)
    assert decay_at_step(1000, "0-0.25-0.005-0.999") == 0.999
    assert decay_at_step(74, "75-0.0-0.0075-0.999") == 0.0 and decay_at_step(95, "medium") == pytest.approx(0.15)
    assert parse_decay("slow") == (0, 0.0, 0.001, 0.5) and parse_decay("3") == (0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        parse_decay("0.5")


# -- the gradient's sign ------------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [True, False])
def test_a_gradient_step_moves_toward_the_better_sample_and_away_from_the_worse(adaptive):
    """Toy: one free velocity v shared by a group of two samples whose flow-matching targets differ;
    θ = old at the start (r_θ = 0); the better sample has r = 1, the worse r = 0."""
    good, bad = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.5])
    v = torch.zeros(2, requires_grad=True)
    target = torch.stack([good, bad])
    r_theta = implicit_reward(torch.stack([v, v]), torch.zeros(2, 2), target, adaptive)
    loss, _ = crd_loss(r_theta.view(1, 2), torch.tensor([[1.0, 0.0]]), beta=1.0, advantage_max=5.0)
    loss.backward()
    step = -v.grad
    assert step @ good > 0 and step @ bad < 0
    moved = implicit_reward(torch.stack([v, v]).detach() + 0.01 * step, torch.zeros(2, 2), target, adaptive)
    assert moved[0] > 0 > moved[1]  # implicit reward up for the better sample, down for the worse


# -- through the trainer ---------------------------------------------------------------------------------
def test_crd_trains_through_the_trainer_from_theta_equal_old_with_the_cfg_reference(tiny_sd3_dir, tmp_path):
    """One optimizer step per epoch: epoch 1's terms all see θ = old (r_θ ≡ 0) and θ = reference, so the
    KL is 0 against the unguided reference and > 0 against the guided one, which therefore is used."""
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "cfg", *CRD))
    trainer.train()
    assert type(trainer.objective).__name__ == "CRD"
    first, second = trainer.history
    assert all(h["train/grad_norm"] > 0 for h in trainer.history)
    assert first["train/crd_r_theta"] == 0.0 and second["train/crd_r_theta"] != 0.0
    assert first["train/kl"] > 0
    unguided = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "no-cfg", *CRD, "train.epochs=1", "train.crd_kl_cfg=1"))
    unguided.train()
    assert unguided.history[0]["train/kl"] == pytest.approx(0.0, abs=1e-10)


def test_the_copies_follow_the_authors_schedules_and_resume_exactly(tiny_sd3_dir, tmp_path):
    """After epoch 1 (one optimizer step): old ← 0.255·old + 0.745·θ (0.25 + 1·0.005), sampling ← θ
    (its schedule starts at step 75); the copies and the step count are checkpointed."""
    over = (*CRD, "train.learning_rate=1e-2")
    one = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "one", *over, "train.epochs=1"))
    start = [p.detach().clone() for p in one.params]
    one.train()
    assert one.history[0]["train/crd_old_decay"] == pytest.approx(0.255)
    assert one.history[0]["train/crd_sampling_decay"] == 0.0
    for old, sampling, p0, p1 in zip(one.objective.old.shadow, one.objective.sampling.shadow, start, one.params):
        assert torch.allclose(old, 0.255 * p0 + 0.745 * p1.detach(), atol=1e-6)
        assert torch.equal(sampling, p1.detach())
    full, resumed = cut_and_resumed(tiny_sd3_dir, tmp_path, *over, "checkpoint_every=1",
                                    "train.crd_sampling_decay=0-0.5-0.1-0.9")
    assert [h["train/crd_sampling_decay"] for h in full.history] == pytest.approx([0.6, 0.7, 0.8])
    keys = ["train/policy_loss", "train/kl", "train/crd_r_theta", "train/crd_old_decay", "reward/mean"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]


@pytest.mark.parametrize("override, key", [("train.crd_loss=huber", "train.crd_loss"),
                                           ("train.crd_old_decay=fastest", "train.crd_old_decay"),
                                           ("train.crd_sampling_decay=1-2-3", "train.crd_sampling_decay"),
                                           ("train.train_batch_size=6", "train.train_batch_size"),
                                           ("train.crd_beta=0", "train.crd_beta")])
def test_bad_settings_fail_before_the_model_loads(tmp_path, override, key):
    from flowalign.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *CRD, override))


def test_rollouts_come_from_the_sampling_copy(tiny_sd3_dir, tmp_path):
    """With the sampling copy frozen (the authors' preset "offline") epoch 2 samples what an untrained
    run samples, although the weights moved; with the default schedule (a copy of θ until step 75) not."""
    runs = {}
    for name, over in (("frozen", ["train.crd_sampling_decay=offline"]), ("untrained", ["train.learning_rate=0"]),
                       ("default", [])):
        trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / name, *CRD, "train.learning_rate=5e-2", *over))
        trainer.train()
        runs[name] = trainer.history[1]["reward/mean"]
    assert runs["frozen"] == runs["untrained"] != runs["default"]
