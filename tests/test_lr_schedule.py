"""``train.lr_schedule``: the default keeps the linear warm-up; diffusers' schedules by name, per epoch."""

import pytest
import torch

from flowalign.config import CHOICES, ConfigError, load_config
from flowalign.lr_schedule import SCHEDULES, lr_factor


def test_the_default_is_the_warm_up_then_constant():
    assert [lr_factor("constant", e, 3, 10) for e in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor("constant", 0, 0, 10) == 1.0


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "constant"])
def test_diffusers_schedules_by_name(name):
    from diffusers.optimization import get_scheduler

    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=11)
    expected = []
    for _ in range(11):
        optimizer.step()
        scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])  # after step k + 1
    got = [lr_factor(name, e, 2, 10) for e in range(10)]
    assert got == pytest.approx(expected[:10])
    assert all(f > 0 for f in got) and got[1] == pytest.approx(1.0)  # warm-up done at epoch 1; never 0
    if name == "cosine":
        assert got[-1] < 0.05 and got[1:] == sorted(got[1:], reverse=True)  # decays after the warm-up, to near 0


def test_the_choices_are_diffusers_names():
    from diffusers.optimization import SchedulerType

    assert set(CHOICES["train.lr_schedule"]) == set(SCHEDULES) <= {s.value for s in SchedulerType}
    assert load_config(None, ["train.lr_schedule=cosine"]).train.lr_schedule == "cosine"
    with pytest.raises(ConfigError, match="train.lr_schedule must be one of"):
        load_config(None, ["train.lr_schedule=cosin"])


def test_the_trainer_uses_it(tiny_sd3_dir, tmp_path):
    from flowalign.trainer import Trainer

    trainer = Trainer(load_config(None, [
        f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=3", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=1",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0", "train.lr_schedule=cosine",
        "train.learning_rate=1e-3"]))
    trainer.train()
    assert [h["lr"] for h in trainer.history] == pytest.approx([1e-3 * lr_factor("cosine", e, 0, 3) for e in range(3)])
    assert trainer.history[0]["lr"] > trainer.history[1]["lr"] > trainer.history[2]["lr"] > 0
