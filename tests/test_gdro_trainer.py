"""GDRO end to end on a tiny SD3: generate groups to disk, then train on them without sampling."""

import json

import pytest
from helpers import tiny_config

from flowalign.config import ConfigError
from flowalign.group_generation import generate_groups
from flowalign.offline import load_groups
from flowalign.trainer import Trainer

GDRO = ("method=gdro", "sampling.eta=0.0", "train.noise_draws=2", "train.group_size=4", "train.train_batch_size=4")


def test_groups_are_written_once_and_training_reads_only_them(tiny_sd3_dir, tmp_path, monkeypatch):
    groups = tmp_path / "groups"
    config = tiny_config(tiny_sd3_dir, tmp_path / "gen", *GDRO, f"data.offline_groups={groups}")
    generate_groups(config, 4)
    data = load_groups(groups, 4)
    assert data["samples"].shape[:2] == (4, 4) and len(data["specs"]) == 4
    assert set(data["components"]) == {"accuracy", "score", "soft_score"}
    assert json.loads((groups / "index.json").read_text())["groups"] == 4
    assert not (tmp_path / "groups.tmp").exists()

    # one minibatch per epoch: the first epoch's statistics are all taken at the initial weights
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "run", *GDRO, f"data.offline_groups={groups}",
                                  "train.train_batch_size=8"))
    monkeypatch.setattr("flowalign.epoch_sampler.rollout", _no_sampling_in_training)
    monkeypatch.setattr(trainer, "evaluate", lambda label: {})
    trainer.train()
    first = trainer.history[0]
    assert first["train/gdro_score_gap"] == 0.0  # at init the policy is the reference: every implicit reward is 0
    assert first["train/grad_norm"] > 0
    assert trainer.history[1]["train/gdro_score_gap"] != 0.0


def _no_sampling_in_training(*args, **kwargs):
    raise AssertionError("GDRO training must not sample")


def test_gdro_without_groups_names_the_missing_setting(tiny_sd3_dir, tmp_path):
    with pytest.raises(ConfigError, match="generate-groups"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GDRO)).train()
    with pytest.raises(ConfigError, match="multiple of train.group_size"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, *GDRO[:-1], "train.train_batch_size=6"))
