"""Training throughput of N data-parallel CPU processes against one, at the same global batch.

    OMP_NUM_THREADS=1 python scripts/measure_distributed.py --processes 2 --epochs 5

N processes × G groups (``accelerate launch``, gloo) against 1 process × N·G groups with
``train.rng_shards=N``, so both draw the same samples (tests/test_distributed.py). Each process
runs one thread. Throughput is the median of ``time/samples_per_s`` (the whole global batch over
the epoch's wall time: rollout, rewards, advantages, update, all-reduces) over the epochs after
the first; start-up, model loading and evaluation are left out. The machine's load average is
printed with the result, since other jobs on the same cores distort it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command(config: str, out: Path, processes: int, overrides: list[str]) -> list[str]:
    # the same launch as tests/test_distributed.py::train_command
    args = ["-m", "flowalign.cli", "train", config, f"output_dir={out}", *overrides]
    if processes == 1:
        return [sys.executable, *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), *args]


def samples_per_s(config: str, out: Path, processes: int, overrides: list[str]) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    subprocess.run(command(config, out, processes, overrides), cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line)["time/samples_per_s"] for line in (out / "history.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/shapes_flow_grpo.yaml")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4, help="prompt groups per process and epoch")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    n = args.processes
    common = ["tracker=none", f"train.epochs={args.epochs}", "checkpoint_every=0", "eval.every=0", "eval.seeds=1",
              "train.group_size=8", "train.sample_batch_size=16", "train.train_batch_size=16"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        many = samples_per_s(args.config, Path(tmp) / "many", n, [*common, f"train.groups_per_epoch={args.groups}"])
        one = samples_per_s(args.config, Path(tmp) / "one", 1,
                            [*common, f"train.groups_per_epoch={n * args.groups}", f"train.rng_shards={n}",
                             f"train.train_batch_size={16 * n}"])
    result = {"processes": n, "global_batch": n * args.groups * 8, "epochs": args.epochs,
              "samples_per_s": {"1": statistics.median(one[1:]), str(n): statistics.median(many[1:])},
              "per_epoch": {"1": one, str(n): many}, "load_average_before_after": [load_before[0], os.getloadavg()[0]],
              "cpus": os.cpu_count()}
    result["ratio"] = result["samples_per_s"][str(n)] / result["samples_per_s"]["1"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
