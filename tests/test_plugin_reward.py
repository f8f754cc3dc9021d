"""A reward from a separately installed package (tests/plugin_reward), found only through the
``flowalign.rewards`` entry point, drives a short training run."""

import math
from importlib.metadata import entry_points

import pytest

from flowalign.trainer import Trainer
from reward_models.base import ENTRY_POINT_GROUP, available_rewards, build_reward
from helpers import tiny_config


def test_the_plugin_package_is_installed_and_discovered():
    names = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]
    assert "plugin_redness" in names, "install it: pip install -e tests/plugin_reward (the README's test command does)"
    assert "plugin_redness" in available_rewards()
    assert build_reward("plugin_redness", scale=2.0).scale == 2.0


def test_a_short_training_run_uses_the_plugin_reward(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=plugin_redness",
                                  "reward.weights={redness: 1.0}", "train.epochs=2"))
    trainer.train()
    for epoch in trainer.history:
        assert epoch["reward/redness"] == pytest.approx(epoch["reward/mean"])
    assert math.isfinite(trainer.evals["after"]["redness"])  # held-out samples are scored too
