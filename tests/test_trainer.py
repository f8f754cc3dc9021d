"""The training loop on a tiny SD3: on-policy ratio, KL at init, exact resume, NaN rewards, config errors."""

import json
import math

import pytest
import torch

from helpers import cut_and_resumed, tiny_config  # noqa: F401  (cut_and_resumed: re-exported for older imports)

from flowalign.config import ConfigError, load_config
from flowalign.trainer import Trainer, cpu_extensions
from reward_models.base import Reward, register_reward


def test_one_update_per_rollout_is_exactly_on_policy_and_kl_starts_at_zero(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "train.kl_beta=0.1"))
    trainer.train()
    first = trainer.history[0]
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert first["train/clipfrac"] == 0.0
    assert first["train/approx_kl"] < 1e-12
    assert first["train/kl"] == 0.0  # LoRA starts as the identity: policy = reference
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"before", "after", "delta"} <= set(metrics)
    assert (tmp_path / "grids" / "before_after.png").is_file()
    # what the numbers depend on besides config and seed is recorded beside them
    assert metrics["environment"] == {"threads": 1, "torch": torch.__version__, "processes": 1,
                                      "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                      "cpu_extensions": cpu_extensions(), "sampling_precision": "none"}


def test_the_run_sets_its_thread_count(tiny_sd3_dir, tmp_path):
    before = torch.get_num_threads()
    try:
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "threads=3"))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_second_minibatch_is_off_policy_and_kl_grows(tiny_sd3_dir, tmp_path):
    # guards the test above: after an optimizer step the ratio and KL do move
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=2", "train.kl_beta=0.1",
                                  "train.train_batch_size=2", "train.learning_rate=1e-2"))
    trainer.train()
    assert trainer.history[1]["train/kl"] > 0
    assert trainer.history[1]["train/approx_kl"] > 1e-12


def test_resumed_run_reproduces_the_uninterrupted_losses(tiny_sd3_dir, tmp_path):
    full = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "full", "train.epochs=4", "train.train_batch_size=4",
                               "train.ema_decay=0.9"))
    full.train()
    first = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "cut", "train.epochs=2", "train.train_batch_size=4",
                                "train.ema_decay=0.9"))
    first.train()
    resumed = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "cut", "train.epochs=4", "train.train_batch_size=4",
                                  "train.ema_decay=0.9", "resume=auto"))
    resumed.train()
    keys = ["train/policy_loss", "train/ratio", "reward/mean", "train/grad_norm"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
    assert resumed.evals["after"]["score"] == full.evals["after"]["score"]


@register_reward("test_nan_every_third")
class NanEveryThird(Reward):
    components = ("value",)

    def __call__(self, samples, prompts, metadata):
        value = samples.mean(dim=(1, 2, 3))
        value[::3] = float("nan")
        return {"value": value}


def test_nan_rewards_are_dropped_and_counted(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "reward.name=test_nan_every_third",
                                  "reward.weights={value: 1.0}"))
    trainer.train()
    stats = trainer.history[0]
    assert stats["reward/dropped_nan"] == 3  # samples 0, 3, 6 of 8
    assert math.isfinite(stats["train/policy_loss"]) and math.isfinite(stats["reward/mean"])
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_bad_config_fails_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: /definitely/missing\ntrain:\n  learning_rte: 1e-4\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*train\.learning_rte.*did you mean 'train\.learning_rate'"):
        Trainer(load_config(bad))
    bad.write_text("model:\n  path: /definitely/missing\ntrain:\n  epochs: ten\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: train\.epochs must be int, got str 'ten'"):
        Trainer(load_config(bad))


def test_reward_weight_naming_a_missing_component_fails_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="reward.weights names \\['acuracy'\\]"):
        Trainer(load_config(None, ["model.path=/definitely/missing", "reward.weights={acuracy: 1.0}"]))


def test_missing_model_folder_names_the_path(tmp_path):
    from pipelines.base import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "nothing")):
        Trainer(load_config(None, [f"model.path={tmp_path / 'nothing'}", "tracker=none", f"output_dir={tmp_path}"]))


def test_balanced_prompt_weights_give_every_category_the_same_mass():
    from flowalign.epoch_sampler import prompt_weights
    from reward_models.worlds.shapes import CATEGORIES, prompt_split

    specs = prompt_split("train")
    tags = [spec["tag"] for spec in specs]
    for balance in (False, True):
        weights = prompt_weights(specs, balance)
        mass = {c: sum(w for w, t in zip(weights.tolist(), tags) if t == c) / weights.sum().item() for c in CATEGORIES}
        expected = {c: 1 / len(CATEGORIES) if balance else tags.count(c) / len(tags) for c in CATEGORIES}
        assert mass == pytest.approx(expected)
    assert tags.count("color_attr") / len(tags) > 0.5  # why balancing matters in this world


def test_scoring_in_a_thread_changes_nothing(tiny_sd3_dir, tmp_path):
    runs = {}
    for flag in ("true", "false"):
        trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / flag, "train.epochs=1", "train.sample_batch_size=2",
                                      f"train.async_reward={flag}"))
        trainer.train()
        runs[flag] = trainer.history[0]
    keys = ["reward/mean", "reward/std", "train/policy_loss", "train/grad_norm"]
    assert [runs["true"][k] for k in keys] == [runs["false"][k] for k in keys]


@register_reward("test_mean_brightness")
class _Brightness(Reward):
    components = ("brightness",)

    def __call__(self, samples, prompts, metadata):
        return {"brightness": samples.mean((1, 2, 3))}


def test_advantages_rank_each_groups_own_samples_by_their_reward(tiny_sd3_dir, tmp_path):
    # guards the pairing of samples, rewards, groups and advantages (a shuffle would train on noise)
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=test_mean_brightness",
                                  "reward.weights={brightness: 1.0}", "train.sample_batch_size=4"))
    batch = trainer.sample_epoch()
    rescored = trainer.adapter.decode(batch.traj.samples).mean((1, 2, 3))
    torch.testing.assert_close(batch.rewards, rescored, rtol=0, atol=1e-6)
    advantages, _ = trainer.compute_advantages(batch)
    for gid in batch.group_ids.unique():
        members = batch.group_ids == gid
        assert len({spec["prompt"] for spec, m in zip(batch.specs, members) if m}) == 1
        assert torch.equal(advantages[members].argsort(), batch.rewards[members].argsort())
        assert abs(advantages[members].mean().item()) < 1e-4


def test_dance_grpo_options_train_only_the_extremes_with_one_advantage_per_reward(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "train.keep_extremes=1",
                                  "train.per_reward_advantages=true", "reward.weights={score: 1.0, accuracy: 0.5}",
                                  "sampling.step_mode=fraction", "sampling.shared_group_noise=true"))
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    assert advantages.shape == (8, 2)
    kept = torch.isfinite(advantages).all(dim=1)
    assert kept.sum() == 4  # the best and the worst of each of the two groups of 4
    trainer.train()
    assert math.isfinite(trainer.history[0]["train/policy_loss"])


def test_mixgrpo_window_slides_one_step_later_per_epoch(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "sampling.step_mode=window", "sampling.window_size=1",
                                  "sampling.window_shift_every=1"))
    stochastic = []
    for epoch in range(4):  # 4 steps: windows of one step start at 0, 1, 2, then stay at 2
        trainer.epoch = epoch
        levels = trainer.sample_epoch().traj.noise_levels
        stochastic.append([j for j in range(len(levels)) if levels[j] > 0])
    assert stochastic == [[0], [1], [2], [2]]


def test_latent_diversity_is_zero_for_identical_samples_and_the_rms_distance_otherwise():
    from flowalign.evaluator import latent_diversity

    same = torch.ones(6, 2, 2)
    assert latent_diversity(same, 3) == 0.0
    pair = torch.stack([torch.zeros(4), torch.full((4,), 2.0)])  # one prompt, two seeds, RMS distance 2
    assert latent_diversity(pair, 2) == pytest.approx(2.0)


def test_time_budget_stops_the_run_and_extra_rewards_are_only_measured(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=50", "train.max_minutes=0.0001",
                                  "eval.extra_rewards=[jpeg_compressibility]", "eval.seeds=2"))
    summary = trainer.train()
    assert summary["epochs"] == 1  # the budget ran out after the first epoch; the run still ends normally
    after = summary["after"]
    assert "jpeg_compressibility" in after and after["train_samples"] == 8 and after["train_seconds"] > 0
    assert after["latent_diversity"] > 0
    assert "reward/jpeg_compressibility" not in trainer.history[0]


def test_a_trainer_is_freed_without_the_garbage_collector(tiny_sd3_dir, tmp_path):
    """No reference cycle holds a trainer: its rewards are released as soon as it goes (a chess
    reward's engine threads would otherwise keep the process from exiting)."""
    import gc
    import weakref

    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=0"))
    trainer.train()
    alive = weakref.ref(trainer.reward)
    gc.disable()
    try:
        del trainer
        assert alive() is None
    finally:
        gc.enable()


def test_a_step_trained_by_some_samples_rescores_those_alone_with_the_same_loss_and_gradient(tiny_sd3_dir, tmp_path):
    """step_mode fraction: FlowGRPO.loss rescores only the rows that train step j; the loss, its
    statistics and the LoRA gradient equal the whole minibatch's rescoring with the untrained rows
    weighted 0 (what it computed before), to float tolerance."""
    from flowalign.objectives.base import Minibatch
    from flowalign.objectives.flow_grpo import flow_grpo_loss

    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "sampling.step_mode=fraction",
                                  "sampling.fraction=0.4"))
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    objective, params = trainer.objective, [p for p in trainer.params if p.requires_grad]
    mb = Minibatch.of(batch, torch.arange(len(batch.specs)), torch.nan_to_num(advantages), advantages.isfinite())
    partial = [j for j in objective.terms(batch) if 0 < int(mb.traj.trained[:, j].sum()) < len(batch.specs)]
    assert partial, "the plan trains every step for every sample: nothing to compare"
    trainer.model.train()
    seen = []
    hook = trainer.adapter.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        len(kwargs.get("hidden_states", args[0] if args else None))), with_kwargs=True)
    for j in partial:
        seen.clear()
        loss, stats = objective.loss(mb, j)
        assert seen == [int(mb.traj.trained[:, j].sum())]  # the denoiser ran on the trained rows only
        fast = torch.autograd.grad(loss, params)
        out = objective.transition(mb, j)  # the whole minibatch, untrained rows weighted 0
        whole, whole_stats = flow_grpo_loss(out.log_prob, mb.traj.log_probs[:, j], mb.advantages,
                                            clip_range=trainer.config.train.clip_range,
                                            weight=objective.trained_weight(mb, j))
        slow = torch.autograd.grad(whole, params)
        torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-7)
        for key in ("ratio", "clipfrac", "policy_loss"):
            torch.testing.assert_close(stats[key], whole_stats[key], rtol=1e-5, atol=1e-7)
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
    hook.remove()
