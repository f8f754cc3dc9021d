"""``reward.components``: two built-in rewards trained together, each logged under its name, the
trained reward their weighted sum; with ``train.per_reward_advantages`` each gets its advantage."""

import json

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.trainer import Trainer

COMPONENTS = "reward.components={shapes: 1.0, jpeg_compressibility: {weight: 0.1, kwargs: {}}}"


def _run(tiny_sd3_dir, out, *extra):
    config = load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=1",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0", COMPONENTS, *extra])
    trainer = Trainer(config)
    return trainer, trainer.train()


@pytest.mark.parametrize("per_reward", [False, True])
def test_two_built_in_rewards_are_logged_and_trained(tiny_sd3_dir, tmp_path, per_reward):
    trainer, summary = _run(tiny_sd3_dir, tmp_path / "run", f"train.per_reward_advantages={str(per_reward).lower()}")
    assert trainer.config.reward.name == "combined"
    assert trainer.config.reward.weights == {"shapes": 1.0, "jpeg_compressibility": 0.1}
    for stats in trainer.history:
        shapes, jpeg = stats["reward/shapes"], stats["reward/jpeg_compressibility"]
        assert "reward/shapes/accuracy" in stats and "reward/shapes/soft_score" in stats  # logged, not trained
        assert stats["reward/mean"] == pytest.approx(shapes + 0.1 * jpeg, rel=1e-5)  # the trained sum
        assert stats["train/grad_norm"] > 0  # it trains
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert {"reward/shapes", "reward/jpeg_compressibility"} <= set(history[0])
    assert {"shapes", "jpeg_compressibility"} <= set(summary["after"])  # evaluated under their names
    shipped = load_config(tmp_path / "run" / "final" / "flowalign_config.yaml")  # the expanded config reloads
    assert shipped.reward.weights == trainer.config.reward.weights


def test_per_reward_advantages_give_one_column_per_reward(tiny_sd3_dir, tmp_path):
    trainer = Trainer(load_config(None, [
        f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
        "train.train_batch_size=8", "train.per_reward_advantages=true", COMPONENTS]))
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    assert advantages.shape == (8, 2)
    from flowalign.advantages import group_advantages

    t = trainer.config.train
    for column, name in enumerate(("shapes", "jpeg_compressibility")):  # each its own group-normalised reward
        expected, _ = group_advantages(batch.components[name], batch.group_ids, global_std=t.global_std,
                                       clip=t.advantage_clip)
        assert torch.allclose(advantages[:, column], expected, equal_nan=True)
    assert not torch.allclose(advantages[:, 0], advantages[:, 1])


@pytest.mark.parametrize("override, expected", [
    ("reward.components={shapes: 1, jpeg_compresibility: 0.1}", "unknown reward 'jpeg_compresibility'"),
    ("reward.components={shapes: {weight: 1, kwargs: {min_aera: 3}}}", "takes no argument 'min_aera'"),
    ("reward.components={shapes: {wieght: 1}}", "must be a weight or a mapping of weight, kwargs, component"),
])
def test_a_bad_component_fails_before_any_model_loads(override, expected):
    from flowalign.preflight import validate

    with pytest.raises(ConfigError, match=expected):
        validate(load_config(None, [override]))


def test_components_replace_name_kwargs_and_weights():
    with pytest.raises(ConfigError, match="reward.name 'pickscore' and reward.components are both set"):
        load_config(None, ["reward.name=pickscore", COMPONENTS])
    with pytest.raises(ConfigError, match="reward.weights is set beside reward.components"):
        load_config(None, ["reward.weights={accuracy: 1}", COMPONENTS])
