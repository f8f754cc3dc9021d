"""What many test files share: the tiny SD3 run config and the cut-and-resumed pair of runs
(fixtures live in conftest.py; adapter checks every family runs in adapter_checks.py)."""

from __future__ import annotations

from flowalign.config import load_config
from flowalign.trainer import Trainer


def tiny_config(tiny_sd3_dir, out, *overrides):
    return load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0", "train.learning_rate=1e-3", *overrides])


def cut_and_resumed(tiny_sd3_dir, out, *overrides, epochs: int = 3):
    """(full, resumed): a run of ``epochs`` epochs in one go, and the same run stopped after one epoch
    and resumed (``resume=auto``), for the exact-resume checks of the objectives' tests."""
    full = Trainer(tiny_config(tiny_sd3_dir, out / "full", *overrides, f"train.epochs={epochs}"))
    full.train()
    Trainer(tiny_config(tiny_sd3_dir, out / "cut", *overrides, "train.epochs=1")).train()
    resumed = Trainer(tiny_config(tiny_sd3_dir, out / "cut", *overrides, f"train.epochs={epochs}", "resume=auto"))
    resumed.train()
    return full, resumed
