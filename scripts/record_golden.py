"""Record the golden numbers that ``tests/test_golden.py`` holds every change to.

One short run of each shipped world's recipe (the README demo, chess DDPO, audio-video NFT),
each as a user would start it (``flowalign train CONFIG overrides``), at a pinned thread count.
Every number of ``history.jsonl`` and every evaluation in ``metrics.json`` is kept, except the
timings. A change that moves any of them must rerun this script and commit the new files in the
same commit, saying why the numbers moved::

    python scripts/record_golden.py                # all worlds
    python scripts/record_golden.py --only shapes_nft

The numbers are a function of the config, the seed, the thread count, torch's version and the
CPU instruction set torch's kernels use (recorded beside them); never of the machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

# name → (recipe, overrides): each recipe as shipped, shortened to a few epochs and a small evaluation
RUNS: dict[str, tuple[str, list[str]]] = {
    "shapes_nft": ("configs/shapes_nft.yaml",
                   ["train.epochs=3", "eval.every=2", "eval.seeds=1", "checkpoint_every=0"]),
    "chess_ddpo": ("configs/chess_ddpo.yaml",
                   ["train.epochs=2", "train.groups_per_epoch=2", "train.train_batch_size=16",
                    "reward.kwargs={engines: 1, nodes: 2000}", "eval.seeds=2", "eval.grid_prompts=2",
                    "eval.grid_seeds=2", "checkpoint_every=0"]),
    "av_nft": ("configs/av_nft.yaml",
               ["train.epochs=2", "train.groups_per_epoch=4", "eval.every=0", "eval.seeds=1",
                "checkpoint_every=0"]),
}
THREADS = 1


def command(name: str, out: Path) -> list[str]:
    recipe, overrides = RUNS[name]
    return [sys.executable, "-m", "flowalign.cli", "train", recipe, *overrides, f"threads={THREADS}",
            "tracker=none", f"output_dir={out}"]


def numbers(out: Path) -> dict:
    """The run's numbers: every history value and every evaluation value, timings left out."""
    def untimed(d: dict) -> dict:
        return {k: untimed(v) if isinstance(v, dict) else v for k, v in d.items()
                if not (k.startswith("time/") or k in ("train_seconds", "train_minutes"))}

    history = [untimed(json.loads(line)) for line in (out / "history.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "metrics.json").read_text())
    return {"history": history, "evals": untimed(metrics["evals"]), "environment": metrics["environment"]}


def run(name: str, out: Path, env: dict | None = None) -> dict:
    result = subprocess.run(command(name, out), cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return numbers(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        with tempfile.TemporaryDirectory() as tmp:
            recorded = run(name, Path(tmp) / name)
        recipe, overrides = RUNS[name]
        recorded = {"command": " ".join(["flowalign train", recipe, *overrides, f"threads={THREADS}"]), **recorded}
        (GOLDEN / f"{name}.json").write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"{name}: {len(recorded['history'])} epochs, evaluations {sorted(recorded['evals'])}")


if __name__ == "__main__":
    main()
