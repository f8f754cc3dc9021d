"""How much a run slows down when another CPU-bound job shares the machine, by thread count.

Each arm is the README demo recipe shortened to a few epochs, started as a user starts it
(``flowalign train configs/shapes_nft.yaml ...``); "busy" arms run it beside one CPU-bound process
(a Python busy loop: what a second training run or a compile job does to the cores). Arms are
interleaved (free, busy, free, busy, ...) so that a drift of the machine's speed hits both alike.
The figure is the median seconds per training epoch (``time/epoch_s`` of history.jsonl: sampling,
scoring and the update; model loading and evaluation are not in it)::

    python scripts/benchmark_busy_machine.py --threads 1,2 --epochs 6 --reps 2 --out docs/busy_machine.json

Run it on an otherwise idle machine: the "free" arms must be free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def epoch_seconds(threads: int, epochs: int, busy: bool, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "flowalign.cli", "train", "configs/shapes_nft.yaml", f"threads={threads}",
           f"train.epochs={epochs}", "eval.every=0", "eval.seeds=1", "checkpoint_every=0", "tracker=none",
           f"output_dir={out}"]
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [h["time/epoch_s"] for h in history[1:]]  # the first epoch also warms caches up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2, help="free/busy pairs per thread count")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            arms: dict[str, list[float]] = {"free": [], "busy": []}
            for rep in range(args.reps):
                for arm in ("free", "busy"):
                    seconds = epoch_seconds(threads, args.epochs, arm == "busy", Path(tmp) / f"{threads}-{arm}-{rep}")
                    arms[arm] += seconds
                    print(f"threads {threads}, {arm}, rep {rep}: " + " ".join(f"{s:.2f}" for s in seconds), flush=True)
            free, busy = statistics.median(arms["free"]), statistics.median(arms["busy"])
            results[str(threads)] = {"free_epoch_s": free, "busy_epoch_s": busy, "slowdown": busy / free,
                                     "epochs": arms}
            print(f"threads {threads}: {free:.2f} s per epoch free, {busy:.2f} s beside a CPU-bound job: "
                  f"{busy / free:.2f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "results": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
