"""Data parallelism for real: two CPU processes (``accelerate launch``, gloo) against one process
with the same global batch and the same random streams (``train.rng_shards=2``); groups stay on
the shard that drew them and every shard draws its own samples, reproducibly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowalign.config import to_dict
from flowalign.trainer import Trainer
from helpers import tiny_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


# in-process runs on one thread, like the subprocesses (OMP_NUM_THREADS=1; conftest)


def write_config(tiny_sd3_dir, path: Path, *overrides) -> Path:
    """The tests' tiny run (test_trainer.tiny_config) as a YAML recipe for the command line."""
    path.write_text(yaml.safe_dump(to_dict(tiny_config(tiny_sd3_dir, path.parent, *overrides))))
    return path


def train_command(config: Path, out: Path, *overrides, processes: int = 1) -> list[str]:
    """``flowalign train`` in one process, or under ``accelerate launch`` with ``processes`` CPU ranks."""
    args = ["-m", "flowalign.cli", "train", str(config), f"output_dir={out}", *overrides]
    if processes == 1:
        return [sys.executable, *args]
    with socket.socket() as s:  # a free rendezvous port: other runs may hold 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), *args]


def subprocess_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1"}


def run(command: list[str], log: Path, timeout: float = 300) -> None:
    with open(log, "w") as f:
        done = subprocess.run(command, cwd=REPO, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    assert done.returncode == 0, log.read_text()[-3000:]


def start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)


STARTED = ("eval before:", "resuming from")  # what a run prints once its training loop is about to begin


def wait_until_started(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not any(marker in log.read_text() for marker in STARTED):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "the run did not start training in time"
        time.sleep(0.05)


def history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_each_shard_draws_its_own_samples_reproducibly(tiny_sd3_dir, tmp_path):
    def batch(*overrides):
        return Trainer(tiny_config(tiny_sd3_dir, tmp_path, "train.group_size=2", "train.train_batch_size=4",
                                   *overrides)).sample_epoch()

    two = batch("train.groups_per_epoch=4", "train.rng_shards=2")
    again = batch("train.groups_per_epoch=4", "train.rng_shards=2")
    one = batch("train.groups_per_epoch=2")  # the default: one shard per process, seeded like shard 0
    assert two.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # a group never straddles two shards
    noise = two.traj.latents[:, 0]
    assert not torch.equal(noise[:4], noise[4:])  # shard 1 has streams of its own
    assert torch.equal(two.traj.latents, again.traj.latents) and torch.equal(two.rewards, again.rewards)
    assert torch.equal(two.traj.latents[:4], one.traj.latents)  # adding shards leaves shard 0 as it was
    assert [s["prompt"] for s in two.specs[:4]] == [s["prompt"] for s in one.specs]


def test_two_processes_stopped_and_resumed_train_like_one_process(tiny_sd3_dir, tmp_path):
    """2 processes × 2 groups against 1 process × 4 groups with ``rng_shards=2``: rank r draws
    exactly what the single process draws for shard r (same seeds, same batch shapes), so the
    comparison is sample for sample, not statistical. The two-process run is also stopped by
    SIGTERM to its launcher after epoch 1 and resumed: both ranks must stop at the same epoch,
    write their own streams and continue them.

    What must match, and how closely:

    * epoch 1, every gathered reward and advantage statistic: **exactly** (``adv/abs_mean``, a
      mean of per-rank means, to 1e-6). The samples are the same bits and the gather
      concatenates them in shard order, the single process's order.
    * every later statistic, the losses, grad norms: **rel 1e-4 or abs 1e-7**; the final LoRA
      weights: **rtol 1e-4, atol 1e-5** (weights are of order 1). Two processes average two
      per-rank gradients in an all-reduce and run their forwards on half-size batches, where one
      process sums one batch: the same numbers up to float32 rounding, which then carries into the
      next epochs' samples. Observed: statistics within 1e-5 relative, weights within 1e-6
      absolute; ``policy_loss`` and ``approx_kl`` are near-zero differences of order-1 terms, so
      only their absolute error is small (1.5e-8, 1.4e-13). A real fault is far outside these
      bounds: other streams on rank 1 (or rank 0's streams restored on rank 1) change a whole
      epoch's samples, summed instead of averaged gradients move the weights by about the learning
      rate (3e-3). The reward (redness, a mean of pixels) is smooth, so rounding cannot flip a
      decision as a verifier's threshold could.
    * ``time/*``: not compared (throughput: docs/distributed.md).
    """
    config = write_config(tiny_sd3_dir, tmp_path / "tiny.yaml", "reward.name=plugin_redness",
                          "reward.weights={redness: 1.0}", "train.epochs=3", "train.group_size=4",
                          "train.learning_rate=3e-3", "checkpoint_every=0")
    two, one = tmp_path / "two", tmp_path / "one"
    per_rank = ("train.groups_per_epoch=2", "train.train_batch_size=4")
    proc = start(train_command(config, two, *per_rank, processes=2), tmp_path / "two-stopped.log")
    wait_until_started(proc, tmp_path / "two-stopped.log")
    proc.send_signal(signal.SIGTERM)  # the launcher passes it on to both ranks
    proc.wait(timeout=120)  # the launcher itself exits 143 (128 + SIGTERM), its ranks 0
    log = (tmp_path / "two-stopped.log").read_text()
    assert log.count("SIGTERM received") == 2 and "stopped by SIGTERM after epoch 1/3" in log, log[-3000:]
    stopped = two / "checkpoints" / "epoch-000001"
    assert {"rng-shard0.safetensors", "rng-shard1.safetensors"} <= {p.name for p in stopped.iterdir()}
    state = json.loads((stopped / "state.json").read_text())
    assert state["num_processes"] == 2 and state["rng_shards"] == 2
    run(train_command(config, two, *per_rank, "resume=auto", processes=2), tmp_path / "two-resumed.log")
    run(train_command(config, one, "train.groups_per_epoch=4", "train.train_batch_size=8", "train.rng_shards=2"),
        tmp_path / "one.log")

    h2, h1 = history(two), history(one)
    exact = [k for k in h1[0] if k.startswith(("reward/", "adv/")) and k != "adv/abs_mean"]
    assert h2[0]["adv/groups"] == 4.0  # groups counted over both ranks
    assert {k: h2[0][k] for k in exact} == {k: h1[0][k] for k in exact}
    assert h2[0]["adv/abs_mean"] == pytest.approx(h1[0]["adv/abs_mean"], rel=1e-6)
    for e2, e1 in zip(h2, h1, strict=True):
        assert set(e2) == set(e1)
        for key in e1:
            if not key.startswith("time/"):
                assert e2[key] == pytest.approx(e1[key], rel=1e-4, abs=1e-7), key
    w2 = load_file(two / "final" / "pytorch_lora_weights.safetensors")
    w1 = load_file(one / "final" / "pytorch_lora_weights.safetensors")
    assert w2.keys() == w1.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5)
