"""Faults a long run meets: SIGKILL at random moments, SIGTERM, corrupt or half-written
checkpoints (flipped bytes included), a full disk (checkpoints, final/), non-finite advantages,
losses and gradients, a reward that hangs, raises or is NaN epoch after epoch. Each is survived, or
refused with a message that names the file or the reward, and a resumed run still equals the
uninterrupted one (docs/faults.md)."""

import errno
import json
import math
import os
import random
import shutil
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import flowalign.checkpoint as checkpoint_module
import flowalign.objectives.flow_grpo as flow_grpo_module
from flowalign.checkpoint import CheckpointError, DiskFullError
from flowalign.faults import RunStopped
from flowalign.integrity import file_sha256
from flowalign.trainer import Trainer
from reward_models.base import Reward, register_reward
from test_distributed import history, run, start, train_command, wait_until_started, write_config
from helpers import tiny_config


EPOCHS = 10
# every epoch checkpointed, two minibatches (the shuffle stream matters), EMA (its state must resume too)
RUN = (f"train.epochs={EPOCHS}", "checkpoint_every=1", "checkpoints_kept=2", "train.train_batch_size=4",
       "train.ema_decay=0.9")


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir, tmp_path_factory):
    """The uninterrupted run: (config, its output folder, seconds from "eval before" to the end)."""
    folder = tmp_path_factory.mktemp("reference")
    config = write_config(tiny_sd3_dir, folder / "faults.yaml", *RUN)
    out, log = folder / "run", folder / "run.log"
    proc = start(train_command(config, out), log)
    wait_until_started(proc, log)
    began = time.time()
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    return config, out, time.time() - began


def assert_same_run(out, reference_out):
    """Bit for bit: every logged statistic but timings, final (EMA) and raw weights, optimizer state."""
    def stats(folder):
        return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history(folder)]

    assert stats(out) == stats(reference_out)
    last = f"checkpoints/epoch-{EPOCHS:06d}"
    for name in ("final/pytorch_lora_weights.safetensors", f"{last}/trained.safetensors", f"{last}/ema.safetensors"):
        got, want = load_file(out / name), load_file(reference_out / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    got, want = (torch.load(f / last / "optimizer.pt", weights_only=True)["state"] for f in (out, reference_out))
    assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])
    metrics = [json.loads((f / "metrics.json").read_text())["after"] for f in (out, reference_out)]
    assert [{k: v for k, v in m.items() if k != "train_seconds"} for m in metrics] == \
        [{k: v for k, v in metrics[1].items() if k != "train_seconds"}] * 2  # wall-clock time differs


def test_killed_at_random_moments_the_run_resumes_to_the_same_result(reference, tmp_path):
    config, reference_out, seconds = reference
    out, rng, kills = tmp_path / "run", random.Random(7), 0
    for attempt in range(4):
        log = tmp_path / f"attempt-{attempt}.log"
        proc = start(train_command(config, out, "resume=auto"), log)
        wait_until_started(proc, log)
        time.sleep(rng.uniform(0.05, 0.3) * seconds)  # mid-epoch, mid-checkpoint, mid-eval: wherever it lands
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
    run(train_command(config, out, "resume=auto"), tmp_path / "last.log")
    assert kills >= 3
    resumed = sum("resuming from" in (tmp_path / f"attempt-{k}.log").read_text() for k in range(1, 4))
    assert resumed >= 2 or "resuming from" in (tmp_path / "last.log").read_text()
    assert_same_run(out, reference_out)


def test_sigterm_checkpoints_exits_cleanly_and_resume_continues_exactly(reference, tmp_path):
    config, reference_out, _ = reference
    out, log = tmp_path / "run", tmp_path / "stopped.log"
    proc = start(train_command(config, out, "checkpoint_every=0"), log)  # the signal alone writes the checkpoint
    wait_until_started(proc, log)
    proc.send_signal(signal.SIGTERM)  # during epoch 1 (or the end of the first eval): stops after epoch 1
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert "stopped by SIGTERM after epoch 1/" in log.read_text()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch-000001"]
    assert not (out / "final").exists()  # the run is not finished
    run(train_command(config, out, "resume=auto", "checkpoint_every=0"), tmp_path / "resumed.log")
    assert_same_run(out, reference_out)


def short_run(tiny_sd3_dir, out, *overrides):
    trainer = Trainer(tiny_config(tiny_sd3_dir, out, "train.epochs=2", "checkpoint_every=1", "checkpoints_kept=3",
                                  "train.train_batch_size=4", *overrides))
    trainer.train()
    return trainer


def resumed(tiny_sd3_dir, out, resume="auto"):
    trainer = Trainer(tiny_config(tiny_sd3_dir, out, "train.epochs=2", "train.train_batch_size=4", f"resume={resume}"))
    trainer.resume(resume)
    return trainer


def test_leftovers_of_a_killed_save_are_ignored(tiny_sd3_dir, tmp_path, capsys):
    short_run(tiny_sd3_dir, tmp_path)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "epoch-000004.tmp").mkdir()  # killed while writing
    (ckpts / "epoch-000004.tmp" / "state.json").write_text('{"epoch": 4')
    shutil.copytree(ckpts / "epoch-000002", ckpts / "epoch-000003")
    (ckpts / "epoch-000003" / "trained.safetensors").unlink()  # killed while deleting
    assert resumed(tiny_sd3_dir, tmp_path).epoch == 2
    err = capsys.readouterr().err
    assert "skipping" in err and "epoch-000003/trained.safetensors: missing" in err and "epoch-000004" not in err


def test_corrupt_checkpoint_files_are_rejected_with_their_name(tiny_sd3_dir, tmp_path, capsys):
    first = short_run(tiny_sd3_dir, tmp_path)
    one, two = tmp_path / "checkpoints" / "epoch-000001", tmp_path / "checkpoints" / "epoch-000002"
    weights = two / "trained.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"epoch-000002/trained\.safetensors: \d+ bytes, \d+ when written"):
        resumed(tiny_sd3_dir, tmp_path, str(two))
    # auto falls back to the newest good checkpoint, says why, and continues exactly
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=2", "checkpoint_every=1",
                                  "train.train_batch_size=4", "resume=auto"))
    trainer.train()
    assert "skipping" in capsys.readouterr().err
    keys = ["reward/mean", "train/policy_loss", "train/grad_norm"]
    assert [[h[k] for k in keys] for h in trainer.history] == [[h[k] for k in keys] for h in first.history]

    (one / "state.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=r"epoch-000001/state\.json: unreadable, not JSON"):
        resumed(tiny_sd3_dir, tmp_path, str(one))
    optimizer = two / "optimizer.pt"
    optimizer.write_bytes(b"\0" * optimizer.stat().st_size)  # same size: the content hash tells
    with pytest.raises(CheckpointError, match=r"epoch-000002/optimizer\.pt: content differs"):
        resumed(tiny_sd3_dir, tmp_path, str(two))
    state = json.loads((two / "state.json").read_text())
    del state["sha256"]  # as a checkpoint from before the hashes: only parsing can tell
    (two / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"epoch-000002/optimizer\.pt: unreadable"):
        resumed(tiny_sd3_dir, tmp_path, str(two))
    with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*epoch-000002: .*epoch-000001: "):
        resumed(tiny_sd3_dir, tmp_path)


class Pickled:  # not a tensor: weights_only loading must refuse to run its pickle
    pass


def test_only_tensors_are_unpickled_from_a_checkpoint(tiny_sd3_dir, tmp_path):
    short_run(tiny_sd3_dir, tmp_path, "train.epochs=1")
    folder = tmp_path / "checkpoints" / "epoch-000001"
    torch.save({"state": {}, "param_groups": [], "payload": Pickled()}, folder / "optimizer.pt")
    state = json.loads((folder / "state.json").read_text())
    state["files"]["optimizer.pt"] = (folder / "optimizer.pt").stat().st_size  # a consistent manifest
    state["sha256"]["optimizer.pt"] = file_sha256(folder / "optimizer.pt")
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: unreadable \(Weights only load failed"):
        resumed(tiny_sd3_dir, tmp_path, str(folder))


def test_a_full_disk_is_named_and_the_previous_checkpoint_kept(tiny_sd3_dir, tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=2"))
    trainer.train_epoch()
    trainer.epoch = 1
    good = trainer.save_checkpoint()
    before = {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()}
    trainer.train_epoch()
    trainer.epoch = 2
    real_save_file = checkpoint_module.save_file

    def full_disk(tensors, path, *args, **kwargs):
        if str(path).endswith("trained.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_file", full_disk)
    with pytest.raises(DiskFullError, match=r"disk full while writing checkpoint .*epoch-000002\.tmp .*"
                                            r"epoch-000001\) is untouched"):
        trainer.save_checkpoint()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch-000001"]  # partial folder removed
    assert {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()} == before
    assert resumed(tiny_sd3_dir, tmp_path).epoch == 1


def test_a_nan_loss_skips_the_step_on_unchanged_weights_and_is_counted(tiny_sd3_dir, tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path))  # one minibatch of 3 trained steps per epoch
    calls, real_loss = [], flow_grpo_module.flow_grpo_loss

    def nan_on_second_call(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), stats) if len(calls) == 2 else (loss, stats)

    monkeypatch.setattr(flow_grpo_module, "flow_grpo_loss", nan_on_second_call)
    initial = [p.detach().clone() for p in trainer.params]
    stats = trainer.train_epoch()
    assert stats["train/skipped_nonfinite"] == 1 and "train/policy_loss" not in stats
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, initial))  # the step was not taken
    assert not trainer.optimizer.state  # nor did Adam's moments see it
    stats = trainer.train_epoch()  # the next step is clean
    assert stats["train/skipped_nonfinite"] == 0 and math.isfinite(stats["train/policy_loss"])
    assert not all(torch.equal(p, q) for p, q in zip(trainer.params, initial))
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_a_nonfinite_gradient_skips_the_step_and_is_counted(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.train_batch_size=4"))  # two minibatches
    fired = []

    def inf_once(grad):
        fired.append(1)
        return torch.full_like(grad, float("inf")) if len(fired) == 1 else grad

    trainer.params[0].register_hook(inf_once)  # the loss stays finite; only this gradient overflows
    stats = trainer.train_epoch()
    assert stats["train/skipped_nonfinite"] == 1 and math.isfinite(stats["train/grad_norm"])
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert next(iter(trainer.optimizer.state.values()))["step"].item() == 1  # the second minibatch stepped


@register_reward("test_overflowing_group")
class OverflowingGroup(Reward):
    """Group 0 scores near float32's maximum, so its mean overflows and its advantages are NaN."""

    components = ("value",)

    def __call__(self, samples, prompts, metadata):
        huge = torch.tensor([3e38 - 1e37 * k for k in range(len(prompts))])
        first = torch.tensor([spec["group_id"] == 0 for spec in metadata])
        return {"value": torch.where(first, huge, samples.mean(dim=(1, 2, 3)))}


def test_nonfinite_advantages_are_dropped_and_counted(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=test_overflowing_group",
                                  "reward.weights={value: 1.0}"))
    stats = trainer.train_epoch()
    assert stats["adv/nonfinite"] == 4 and stats["reward/dropped_nan"] == 0  # group 0's four samples
    assert stats["train/skipped_nonfinite"] == 0 and math.isfinite(stats["train/policy_loss"])
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_a_checkpoint_is_never_written_with_nan_weights(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path))
    with torch.no_grad():
        trainer.params[0][0] = float("nan")
    with pytest.raises(CheckpointError, match="refusing to write checkpoint epoch-000000: the trained weights hold"):
        trainer.save_checkpoint()
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_flipped_bytes_inside_tensor_data_are_caught_by_the_content_hash(tiny_sd3_dir, tmp_path, capsys):
    short_run(tiny_sd3_dir, tmp_path)
    two = tmp_path / "checkpoints" / "epoch-000002"
    weights = two / "trained.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x40  # inside the last tensor's data: same size, header intact, a finite float still
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"epoch-000002/trained\.safetensors: content differs from when it "
                                              r"was written \(SHA-256"):
        resumed(tiny_sd3_dir, tmp_path, str(two))
    assert resumed(tiny_sd3_dir, tmp_path).epoch == 1  # auto falls back, saying why
    assert "skipping" in capsys.readouterr().err


@register_reward("test_always_nan")
class AlwaysNaN(Reward):
    components = ("score",)

    def __call__(self, samples, prompts, metadata):
        return {"score": torch.full((len(prompts),), float("nan"))}


def strict_json(text):
    def refuse(constant):
        raise AssertionError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_resumed_run_has_every_output_its_time_and_strict_json(tiny_sd3_dir, tmp_path):
    Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "checkpoint_every=1")).train()
    first = json.loads((tmp_path / "checkpoints" / "epoch-000001" / "state.json").read_text())["elapsed_s"]
    for output in ("metrics.json", "grids/before_after.png"):
        (tmp_path / output).unlink()
    Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=2", "resume=auto")).train()
    assert (tmp_path / "grids" / "before_after.png").is_file()  # "before" was drawn by the first session
    metrics = strict_json((tmp_path / "metrics.json").read_text())
    assert metrics["train_minutes"] * 60 > first > 0  # both sessions count
    # an undefined metric (every reward NaN) is written as null, not as a bare NaN
    Trainer(tiny_config(tiny_sd3_dir, tmp_path / "nan", "train.epochs=1", "reward.name=test_always_nan",
                        "train.max_nan_epochs=0")).train()
    metrics = strict_json((tmp_path / "nan" / "metrics.json").read_text())
    assert metrics["after"]["score"] is None
    history = [strict_json(line) for line in (tmp_path / "nan" / "history.jsonl").read_text().splitlines()]
    assert history[0]["reward/mean"] is None and history[0]["reward/dropped_nan"] == 8


def test_every_reward_nan_for_epochs_on_end_stops_the_run_keeping_the_checkpoints(tiny_sd3_dir, tmp_path, capsys):
    from flowalign.cli import main
    from test_distributed import write_config

    config = write_config(tiny_sd3_dir, tmp_path / "nan.yaml", "train.epochs=5", "checkpoint_every=1",
                          "reward.name=test_always_nan", "train.max_nan_epochs=2")
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "every reward was NaN for 2 consecutive epochs (the last: epoch 2; train.max_nan_epochs=2)" in err
    # it stops before checkpointing the second NaN epoch: resuming redoes it
    assert "Kept: " in err and "epoch-000001" in err and "resume=auto" in err
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch-000001"]
    assert not (tmp_path / "final").exists()


RELEASE = threading.Event()  # ends the hung calls (a test sets it; no assertion depends on a clock)
STARTED: list[int] = []  # the hung calls begun
RETURNED: list[int] = []  # the hung calls that have returned


@register_reward("test_hanging")
class Hanging(Reward):
    """Hangs on the training batches (their specs carry a group_id), not on evaluation, until
    ``RELEASE`` is set (at most ``seconds``)."""

    components = ("score",)

    def __init__(self, seconds: float = 600.0, sigterm: bool = False):
        self.seconds, self.sigterm = seconds, sigterm

    def __call__(self, samples, prompts, metadata):
        if "group_id" in metadata[0]:
            if self.sigterm:  # a scheduler's SIGTERM arrives while the call hangs
                os.kill(os.getpid(), signal.SIGTERM)
            STARTED.append(1)
            RELEASE.wait(self.seconds)
            RETURNED.append(1)
        return {"score": samples.mean(dim=(1, 2, 3))}


@pytest.fixture
def hung_calls():
    """The hung calls that returned; at the end every hung call is released and has returned, so none
    returns into the next test."""
    RELEASE.clear()
    STARTED.clear()
    RETURNED.clear()
    yield RETURNED
    RELEASE.set()
    _wait_for(lambda: len(RETURNED) == len(STARTED))


def _wait_for(condition) -> None:
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("a released reward call did not return within 60 s")


def release_the_hung_call():
    """End the call hanging now (and only it: the next one hangs again)."""
    returned = len(RETURNED)
    RELEASE.set()
    RELEASE.clear()  # a waiter already notified returns all the same
    _wait_for(lambda: len(RETURNED) > returned)


def test_a_hung_reward_scores_its_batch_nan_at_the_deadline(tiny_sd3_dir, tmp_path, capsys, hung_calls):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=test_hanging", "reward.timeout_s=0.3"))
    stats = trainer.train_epoch()
    assert hung_calls == []  # the epoch ended while its reward call still hung: it was not waited for
    assert stats["reward/dropped_nan"] == 8 and stats["train/skipped"] == 1
    assert "reward 'test_hanging' did not score batch 1 (8 samples" in capsys.readouterr().err
    stats = trainer.train_epoch()  # the late call still runs: no second concurrent call, NaN at once
    assert stats["reward/dropped_nan"] == 8 and hung_calls == []
    assert "is still running an earlier batch past its deadline; batch 2" in capsys.readouterr().err
    release_the_hung_call()
    assert trainer.train_epoch()["reward/dropped_nan"] == 8  # the reward still hangs on every training batch
    assert len(hung_calls) == 1


def test_sigterm_during_a_hung_reward_call_stops_at_the_deadline_with_a_checkpoint(tiny_sd3_dir, tmp_path,
                                                                                   hung_calls):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=test_hanging", "reward.timeout_s=0.5",
                                  "reward.kwargs={sigterm: true}", "train.epochs=3"))
    summary = trainer.train()
    assert summary["interrupted"] == "SIGTERM" and summary["epochs"] == 1
    assert hung_calls == []  # one signal was enough: the run stopped while the call still hung
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch-000001"]


@register_reward("test_raising")
class Raising(Reward):
    components = ("score",)

    def __call__(self, samples, prompts, metadata):
        if "group_id" in metadata[0]:
            raise ValueError("the verifier crashed\nsecond line of its message")
        return {"score": samples.mean(dim=(1, 2, 3))}


def test_a_reward_that_raises_is_named_in_one_line_or_scored_nan(tiny_sd3_dir, tmp_path, capsys):
    from flowalign.cli import main
    from test_distributed import write_config

    config = write_config(tiny_sd3_dir, tmp_path / "raise.yaml", "train.epochs=3", "checkpoint_every=1",
                          "reward.name=test_raising")
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flowalign: error: reward 'test_raising' raised on batch 2 (8 samples; first prompt")
    assert "ValueError: the verifier crashed (reward.on_error=nan" in err and "second line" not in err
    assert "Kept: no checkpoint yet" in err
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "nan", "reward.name=test_raising",
                                  "reward.on_error=nan", "train.epochs=1"))
    with pytest.raises(RunStopped, match=r"every reward was NaN in all 1 epoch\(s\) of this run: reward 'test_raising'"):
        trainer.train()  # scored NaN, then: a run that trained on nothing does not end as if it had
    assert trainer.history[0]["reward/dropped_nan"] == 8
    assert not (tmp_path / "nan" / "final").exists()
    assert "raised on batch 2 (8 samples" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["final", "policy"])
def test_a_full_disk_while_final_or_policy_is_written_is_named(tiny_sd3_dir, tmp_path, monkeypatch, folder):
    from safetensors import SafetensorError

    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1"))
    real_save = trainer.adapter.save_trained

    def full_disk(directory):
        if directory.name == folder:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(directory)

    monkeypatch.setattr(trainer.adapter, "save_trained", full_disk)
    expected = r"disk full while writing the run's outputs in .*final/, metrics.json.*epoch-000001\) is complete" \
        if folder == "final" else r"disk full while writing checkpoint .*epoch-000001\.tmp"
    with pytest.raises(DiskFullError, match=expected):
        trainer.train()
    if folder == "final":  # the last checkpoint holds the run: resuming writes the outputs
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.epochs=1", "resume=auto")).train()
        assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
