"""flowalign.Callback: each event fires at its point of a run with what it promises, after the
built-in tracker logging (itself a callback)."""

import torch
from PIL import Image

import flowalign
from flowalign.callbacks import HubPush, TrackerLogging
from flowalign.config import load_config


class Recorder(flowalign.Callback):
    def __init__(self):
        self.events = []

    def on_rollouts(self, trainer, epoch, batch):
        self.events.append(("rollouts", epoch, len(batch.specs), float(batch.rewards.mean())))

    def on_epoch_end(self, trainer, epoch, stats):
        self.events.append(("epoch_end", epoch, stats))

    def on_evaluate(self, trainer, label, epoch, result, grid, rewards):
        self.events.append(("evaluate", label, epoch, result, grid, rewards))

    def on_checkpoint(self, trainer, epoch, path):
        self.events.append(("checkpoint", epoch, path))

    def on_train_end(self, trainer, summary):
        self.events.append(("train_end", summary))


def test_every_event_fires_in_order_with_its_data(tiny_sd3_dir, tmp_path):
    recorder = Recorder()
    config = load_config(None, [
        f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2",
        "eval.grid_seeds=1", "eval.every=1", "checkpoint_every=2"])
    trainer = flowalign.Trainer(config, callbacks=[recorder])
    summary = trainer.train()
    assert isinstance(trainer.callbacks[0], TrackerLogging) and isinstance(trainer.callbacks[1], HubPush)
    assert trainer.callbacks[-1] is recorder
    kinds = [e[0] if e[0] != "evaluate" else f"evaluate {e[1]}" for e in recorder.events]
    assert kinds == ["evaluate before", "rollouts", "epoch_end", "evaluate epoch-1", "rollouts", "epoch_end",
                     "checkpoint", "evaluate after", "train_end"]
    rollouts = [e for e in recorder.events if e[0] == "rollouts"]
    assert [e[1] for e in rollouts] == [0, 1] and all(e[2] == 8 for e in rollouts)
    assert [e[2] for e in recorder.events if e[0] == "epoch_end"] == trainer.history  # what history.jsonl holds
    for _, label, epoch, result, grid, rewards in (e for e in recorder.events if e[0] == "evaluate"):
        assert result == summary["evals"][label] and isinstance(grid, Image.Image)
        assert set(rewards) >= {"score", "accuracy"} and len(rewards["score"]) == len(trainer.eval_specs)
        assert abs(float(torch.nanmean(rewards["score"])) - result["score"]) < 1e-6
    (_, epoch, path), = [e for e in recorder.events if e[0] == "checkpoint"]
    assert epoch == 2 and (path / "state.json").is_file()
    assert recorder.events[-1][1] is summary and (tmp_path / "final" / "README.md").is_file()
