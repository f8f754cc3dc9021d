"""GARDO: with β = 0 or the gate closed it is Flow-GRPO (kernel and trainer), the gated KL, the
rank uncertainty, the percentile gate, the risk controller and the diversity-aware advantage by
hand, the gradient's sign, the reference refreshed to the policy (KL 0 right after), the terms the
trainer feeds the loss, on-policy ratio 1 and an exact resume."""

import numpy as np
import pytest
import torch

from flowalign.errors import ConfigError
from flowalign.objectives import gardo
from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.objectives.gardo import (RiskController, centred_rewards, descending_ranks, diversity_factor,
                                        gardo_advantages, gardo_loss, nearest_neighbour_distance, uncertainty,
                                        uncertainty_gate)
from flowalign.samplers.flow_sde import gaussian_log_prob
from flowalign.trainer import Trainer
from helpers import tiny_config

GARDO = ("method=gardo", "sampling.eta=1.0", "train.clip_range=0.2", "reward.weights={score: 1.0, soft_score: 0.0}",
         "train.gardo_gate_rewards=[soft_score]")
OPEN_GATE = ("train.gardo_gate_fraction=1.0", "train.gardo_gate_min=1.0", "train.gardo_gate_max=1.0")
# a reward whose auxiliary component disagrees with the trained one (the tiny model's shapes scores
# mostly tie): every sample has its own rank, and the auxiliary order is scrambled from epoch to epoch
BRIGHT = ("reward.weights={score: 1.0, dark: 0.0}", "train.gardo_gate_rewards=[dark]")


class Brightness:
    components = ("score", "dark")

    def __call__(self, samples, prompts, metadata):
        m = samples.float().mean(dim=(1, 2, 3))
        return {"score": m, "dark": torch.sin(1e4 * m)}


def _run(tiny_sd3_dir, out, *overrides):
    trainer = Trainer(tiny_config(tiny_sd3_dir, out, *GARDO, *BRIGHT, *overrides), reward=Brightness())
    trainer.train()
    return trainer


def _step(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(b, 2, 3, generator=g).requires_grad_(True)
    ref_mean = mean.detach() + 0.1 * torch.randn(b, 2, 3, generator=g)
    log_prob = (0.05 * torch.randn(b, generator=g)).requires_grad_(True)
    return mean, ref_mean, log_prob, torch.zeros(b), torch.tensor([1.0, -2.0, 0.5, 0.3])


# -- the kernel -----------------------------------------------------------------------------------
@pytest.mark.parametrize("beta, gate", [(0.0, [True, False, True, True]), (0.5, [False] * 4)])
def test_with_beta_0_or_the_gate_closed_the_loss_and_its_gradients_are_flow_grpo_s(beta, gate):
    mean, ref_mean, log_prob, old, adv = _step()
    weight = torch.tensor([1.0, 1.0, 0.0, 1.0])
    loss, stats = gardo_loss(log_prob, old, adv, clip_range=0.02, beta=beta, gate=torch.tensor(gate), mean=mean,
                             ref_mean=ref_mean, std=torch.tensor(0.3), weight=weight)
    plain, plain_stats = flow_grpo_loss(log_prob, old, adv, clip_range=0.02, weight=weight)
    assert torch.equal(loss, plain)
    assert all(torch.equal(stats[k], plain_stats[k]) for k in plain_stats)
    grads = torch.autograd.grad(loss, (log_prob, mean), allow_unused=True)
    plain_grads = torch.autograd.grad(plain, (log_prob, mean), allow_unused=True)
    assert torch.equal(grads[0], plain_grads[0])
    assert grads[1] is None or not grads[1].any()


def test_the_kl_is_the_flow_grpo_kl_over_the_gated_samples_that_train_by_hand():
    mean = torch.zeros(4, 1, 2)
    ref_mean = torch.tensor([[[1.0, 1.0]], [[2.0, 0.0]], [[0.0, 3.0]], [[4.0, 4.0]]])
    gate = torch.tensor([True, True, False, True])
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last is gated but does not train this step
    loss, stats = gardo_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), clip_range=0.2, beta=0.5, gate=gate,
                             mean=mean, ref_mean=ref_mean, std=torch.tensor(2.0), weight=weight)
    # per sample mean over elements of Δ²/(2·s²) = Δ²/8: sample 0 → (1 + 1)/2/8, sample 1 → (4 + 0)/2/8
    kl = ((2 / 2 / 8) + (4 / 2 / 8)) / 2
    assert stats["kl"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 * kl)
    assert stats["gated"].item() == pytest.approx(2 / 3)


def test_the_gradient_moves_toward_good_samples_and_pulls_only_the_gated_toward_the_reference():
    std = torch.tensor(0.5)
    x_next = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    ref_mean = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    for adv, gate in ((1.0, False), (-1.0, False), (0.0, True)):
        mu = torch.zeros(2, 2, requires_grad=True)
        log_prob = gaussian_log_prob(x_next, mu, std, "mean")
        loss, _ = gardo_loss(log_prob, log_prob.detach(), torch.full((2,), adv), clip_range=0.2, beta=1.0,
                             gate=torch.tensor([gate, False]), mean=mu, ref_mean=ref_mean, std=std)
        loss.backward()
        step = -mu.grad
        if adv != 0:  # A > 0: toward the sample x'; A < 0: away from it; the ungated KL does nothing
            assert adv * (step * (x_next - mu.detach())).sum() > 0
        else:  # only the KL: the gated sample toward its reference, the other not at all
            assert (step[0] * (ref_mean[0] - mu.detach()[0])).sum() > 0
            assert not step[1].any()


# -- the gate --------------------------------------------------------------------------------------
def test_ranks_put_1_at_the_highest_reward_and_break_ties_by_position():
    assert descending_ranks(torch.tensor([0.2, 0.9, 0.5])).tolist() == [3, 1, 2]
    assert descending_ranks(torch.tensor([1.0, 1.0, 0.0, 1.0])).tolist() == [1, 2, 4, 3]


def test_the_uncertainty_is_the_trained_reward_s_rank_minus_the_auxiliary_mean_rank_by_hand():
    main = torch.tensor([0.9, 0.1, 0.5, 0.3])       # ranks 1 4 2 3
    aux = torch.tensor([[0.1, 0.9, 0.5, 0.3],        # ranks 4 1 2 3
                        [0.2, 0.8, 0.1, 0.9]])       # ranks 3 2 4 1
    assert uncertainty(main, aux).tolist() == [1 - 3.5, 4 - 1.5, 2 - 3.0, 3 - 2.0]


def test_the_gate_keeps_the_u_above_the_authors_percentile_of_the_non_negative_u():
    u = torch.tensor([3.0, -3.0, 0.0, 1.0, 2.0, -1.0, 2.5])
    # non-negative: 0 1 2 2.5 3; the 90th percentile lies 0.9·4 = 3.6 places in: 2.5 + 0.6·0.5 = 2.8
    assert uncertainty_gate(u, 0.1).tolist() == [True, False, False, False, False, False, False]
    # the 50th: 2 → the u above it
    assert uncertainty_gate(u, 0.5).tolist() == [True, False, False, False, False, False, True]
    positive = u[u >= 0].numpy()
    for f in (0.02, 0.1, 0.13, 0.2, 0.7):
        assert uncertainty_gate(u, f).tolist() == (u.numpy() > np.percentile(positive, 100 - f * 100)).tolist()
    assert not uncertainty_gate(u, 0.0).any()  # the gate closed: nothing is above the maximum


def test_the_risk_controller_follows_the_authors_rule_by_hand():
    c = RiskController(base=0.1, low=0.02, high=0.2, rate=0.1, fraction=0.1)
    assert c.update(5.0) == 0.1                       # the first epoch: the base
    assert c.update(6.0) == pytest.approx(0.11)       # above every earlier mean: × 1.1
    assert c.update(5.5) == pytest.approx(0.11)       # inside their range: unchanged
    assert c.update(4.0) == pytest.approx(0.099)      # below every earlier mean: × 0.9
    for k in range(20):
        c.update(10.0 + k)                            # rising: × 1.1 until the cap
    assert c.fraction == 0.2
    assert c.history == [10.0 + k for k in range(20)]  # the last 20 epochs only
    for k in range(40):
        c.update(-k - 1.0)
    assert c.fraction == 0.02                         # falling: × 0.9 down to the floor


# -- the advantage ---------------------------------------------------------------------------------
def test_the_diversity_aware_advantage_by_hand():
    # one group of 4 (the features' lengths do not matter), one of 2
    features = torch.tensor([[2.0, 0.0], [0.8, 0.6], [0.0, 3.0], [-1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])
    # cosine distances in group 7: (1,2) 0.2, (1,3) 1, (1,4) 2, (2,3) 0.4, (2,4) 1.8, (3,4) 1 → nearest 0.2 0.2 0.4 1
    d = nearest_neighbour_distance(features, groups)
    assert torch.allclose(d, torch.tensor([0.2, 0.2, 0.4, 1.0, 1.0, 1.0], dtype=torch.float64))
    factor = diversity_factor(d, groups)  # / the group's mean distance 0.45 (group 3: 1)
    assert torch.allclose(factor, torch.tensor([0.2 / 0.45, 0.2 / 0.45, 0.4 / 0.45, 1 / 0.45, 1, 1], dtype=torch.float64))
    rewards = torch.tensor([1.0, 0.0, 0.6, 0.2, 0.5, 0.1])
    base = centred_rewards(rewards, groups)  # group means 0.45 and 0.3; no division by the std
    assert torch.allclose(base, torch.tensor([0.55, -0.45, 0.15, -0.25, 0.2, -0.2]))
    adv = gardo_advantages(base, factor, clip=5.0)  # only the above-mean samples are scaled
    assert torch.allclose(adv, torch.tensor([0.55 * 0.2 / 0.45, -0.45, 0.15 * 0.4 / 0.45, -0.25, 0.2, -0.2]))
    assert gardo_advantages(torch.tensor([4.0, -9.0]), torch.tensor([2.0, 2.0]), clip=5.0).tolist() == [5.0, -5.0]


def test_degenerate_groups_a_duplicate_a_lone_sample_and_a_dropped_reward():
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    groups = torch.tensor([0, 0, 1, 2])
    d = nearest_neighbour_distance(features, groups)
    assert d.tolist()[:2] == [0.0, 0.0] and d[2] == 0 and d[3] == 0  # identical pair; lone samples
    assert diversity_factor(d, groups).tolist() == [1.0, 1.0, 1.0, 1.0]  # no division by 0
    base = centred_rewards(torch.tensor([1.0, float("nan"), 0.5, 0.2]), groups)
    assert base[0] == 0 and torch.isnan(base[1]) and base[2] == 0


# -- through the trainer ---------------------------------------------------------------------------
def _history(trainer):
    return [{k: v for k, v in h.items() if not k.startswith("time/") and not k.startswith("train/gardo")}
            for h in trainer.history]


@pytest.mark.parametrize("extra", [("train.kl_beta=0",), ("train.kl_beta=0.5", "train.gardo_gate_fraction=0",
                                                          "train.gardo_gate_min=0", "train.gardo_gate_max=0")])
def test_with_beta_0_or_the_gate_closed_a_run_is_flow_grpo_s_to_the_last_digit(extra, tiny_sd3_dir, tmp_path):
    """No diversity and the trainer's advantages: GARDO's run equals Flow-GRPO's (β = 0), every number."""
    common = ("sampling.eta=1.0", "train.clip_range=0.2", "train.epochs=2", "train.train_batch_size=4")
    flow = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "flow", *common, "reward.weights={score: 1.0, soft_score: 0.0}"))
    flow.train()
    ours = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "gardo", *GARDO, *common, *extra, "train.gardo_diversity=false",
                               "train.gardo_advantage_scale=std"))
    ours.train()
    flow_history = _history(flow)
    assert [{k: h[k] for k in flow_history[0]} for h in _history(ours)] == flow_history
    assert all(torch.equal(a, b) for a, b in zip(ours.params, flow.params))


def test_the_loss_gets_the_epoch_s_diversity_aware_advantages_and_gate(tiny_sd3_dir, tmp_path, monkeypatch):
    seen, rows = [], []

    def recording(log_prob, old_log_prob, advantages, *, gate, **kwargs):
        seen.append((advantages.clone(), gate.clone()))
        return gardo_loss(log_prob, old_log_prob, advantages, gate=gate, **kwargs)

    monkeypatch.setattr(gardo, "gardo_loss", recording)
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GARDO, *BRIGHT, *OPEN_GATE, "train.kl_beta=0.1",
                                  "train.epochs=1", "train.train_batch_size=4"), reward=Brightness())
    objective_loss, begin_update, batches = trainer.objective.loss, trainer.objective.begin_update, []
    trainer.objective.loss = lambda mb, j: (rows.append(mb.idx.clone()), objective_loss(mb, j))[1]
    trainer.objective.begin_update = lambda batch: (batches.append(batch), begin_update(batch))[1]
    trainer.train()
    batch = batches[0]
    features = batch.traj.samples.flatten(1)
    expected = gardo_advantages(centred_rewards(batch.rewards, batch.group_ids),
                                diversity_factor(nearest_neighbour_distance(features, batch.group_ids), batch.group_ids),
                                5.0)
    gate = uncertainty_gate(uncertainty(batch.rewards, batch.components["dark"][None]), 1.0)
    assert gate.any() and not gate.all() and (expected != 0).all()
    assert len(seen) == len(rows) == 2 * 3  # two minibatches × three trained steps
    for (advantages, g), idx in zip(seen, rows):
        assert torch.allclose(advantages, expected[idx]) and torch.equal(g, gate[idx])
    assert trainer.history[0]["train/gardo_gated"] == pytest.approx(gate.float().mean().item())


def test_the_reference_is_refreshed_to_the_policy_and_the_kl_is_0_right_after(tiny_sd3_dir, tmp_path):
    """One optimizer step per epoch, a tiny threshold: epoch 0 is on-policy to the initial reference
    (KL 0, no refresh), epoch 1 has moved (KL > 0: refreshed at its end to the weights then), so
    epoch 2 measures its KL against exactly the weights it starts from: 0 again."""
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GARDO, *BRIGHT, *OPEN_GATE, "train.kl_beta=0.1",
                                  "train.epochs=3", "train.gardo_kl_threshold=1e-12", "train.gardo_refresh_every=100"),
                      reward=Brightness())
    initial = [p.detach().clone() for p in trainer.params]
    trainer.train()
    h = trainer.history
    assert all(x["train/gardo_gated"] > 0 for x in h)
    assert h[0]["train/ratio"] == pytest.approx(1.0, abs=1e-6) and h[0]["train/clipfrac"] == 0  # on-policy
    assert h[0]["train/kl"] == 0 and h[1]["train/kl"] > 0 and h[2]["train/kl"] == 0
    assert [x["train/gardo_refresh"] for x in h] == [0.0, 1.0, 0.0]
    reference = trainer.objective.reference.shadow
    assert not all(torch.equal(s, p) for s, p in zip(reference, initial))
    assert not all(torch.equal(s, p.detach()) for s, p in zip(reference, trainer.params))  # epoch 2 moved on


def test_the_reference_is_refreshed_every_refresh_every_epochs(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GARDO, "train.kl_beta=0.1", "train.epochs=3",
                                  "train.gardo_kl_threshold=1e9", "train.gardo_refresh_every=1"))
    trainer.train()
    # the authors' rule: refresh at epoch E when E − (last refresh) > refresh_every, decided after epoch E − 1
    assert [x["train/gardo_refresh"] for x in trainer.history] == [0.0, 1.0, 0.0]
    assert "reference" in trainer.objective.components()


def test_the_gate_and_its_controller_move_once_per_epoch_whatever_the_inner_epochs(tiny_sd3_dir, tmp_path):
    trainer = _run(tiny_sd3_dir, tmp_path, "train.kl_beta=0.1", "train.epochs=2", "train.inner_epochs=2")
    assert len(trainer.objective.controller.history) == 2


def test_a_resumed_run_repeats_the_uninterrupted_one(tiny_sd3_dir, tmp_path):
    """The reference, the refresh flag and the controller are checkpointed."""
    over = ("train.kl_beta=0.1", "train.train_batch_size=4", "train.gardo_kl_threshold=1e-12", "checkpoint_every=1")
    full = _run(tiny_sd3_dir, tmp_path / "full", *over, "train.epochs=3")
    _run(tiny_sd3_dir, tmp_path / "cut", *over, "train.epochs=1")
    resumed = _run(tiny_sd3_dir, tmp_path / "cut", *over, "train.epochs=3", "resume=auto")
    keys = ["reward/mean", "train/policy_loss", "train/kl", "train/gardo_gate_fraction", "train/gardo_refresh",
            "train/gardo_gated", "train/grad_norm"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
    assert any(h["train/gardo_refresh"] for h in full.history) and any(h["train/kl"] > 0 for h in full.history)
    assert len({h["train/gardo_gate_fraction"] for h in full.history}) > 1  # the controller moved


@pytest.mark.parametrize("overrides, key", [
    (("train.kl_beta=0.1", "train.gardo_gate_rewards=[]"), "train.gardo_gate_rewards"),
    (("train.kl_beta=0.1", "train.gardo_gate_rewards=[aesthetic]"), "train.gardo_gate_rewards"),
    (("train.gardo_gate_min=0.3",), "train.gardo_gate_min"),
    (("train.gardo_advantage_scale=group",), "train.gardo_advantage_scale"),
    (("train.per_reward_advantages=true",), "train.per_reward_advantages"),
    (("sampling.eta=0",), "sampling.eta"),
])
def test_a_wrong_setting_fails_before_the_model_loads_naming_the_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *GARDO, *overrides))
