"""Does a run's held-out metric swing late? Reads the in-run evaluations of one or more run folders
(``eval_samples/<label>.pt``: every evaluation's per-sample rewards on the same noise) and prints,
per run, the metric at every evaluation with its paired change against the previous evaluation
± a standard error, flagging drops beyond two standard errors after the first third of training;
then the mean ± standard deviation of the final values across runs::

    python scripts/eval_stability.py runs/shapes-nft-seed0 runs/shapes-nft-seed1 runs/shapes-nft-seed2 \
        --metric accuracy --out docs/demo_stability.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from flowalign.evaluation import paired_change


def _labels(run: Path) -> list[str]:
    """Evaluation labels in training order: before, epoch-N ascending, after."""
    names = [p.stem for p in (run / "eval_samples").glob("*.pt")]
    epochs = sorted((n for n in names if n.startswith("epoch-")), key=lambda n: int(n.split("-")[1]))
    return ["before", *epochs] + (["after"] if "after" in names else [])


def curve(run: Path, metric: str) -> list[dict]:
    finished = run / "metrics.json"  # written at the end; a run in progress is read against its planned epochs
    epochs = json.loads(finished.read_text())["epochs"] if finished.is_file() else \
        json.loads((run / "config.json").read_text())["train"]["epochs"]
    rows, previous = [], None
    for label in _labels(run):
        values = torch.load(run / "eval_samples" / f"{label}.pt")[metric].double()
        epoch = 0 if label == "before" else epochs if label == "after" else int(label.split("-")[1])
        n = len(values)
        row = {"label": label, "epoch": epoch, metric: float(values.mean()),
               "se": float(values.std() / math.sqrt(n))}
        if previous is not None:
            # one noise per sample across evaluations: each sample its own cluster
            change, se = paired_change([(a, b, i) for i, (a, b) in enumerate(zip(values.tolist(), previous.tolist()))])
            row.update(change=change, change_se=se,
                       late_drop=epoch > epochs / 3 and change < -2 * se,
                       late_drop_unpaired=epoch > epochs / 3 and change < -2 * row["se"])
        rows.append(row)
        previous = values
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--metric", default="accuracy")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    curves = {str(run): curve(run, args.metric) for run in args.runs}
    for run, rows in curves.items():
        print(f"\n{run}")
        for r in rows:
            change = f"  {r['change']:+.3f} ± {r['change_se']:.3f}" if "change" in r else ""
            flag = "  DROP > 2 SE" if r.get("late_drop") else ""
            print(f"  {r['label']:>10}  {r[args.metric]:.3f}{change}{flag}")
    finals = [rows[-1][args.metric] for rows in curves.values()]
    gains = [rows[-1][args.metric] - rows[0][args.metric] for rows in curves.values()]
    summary = {"metric": args.metric, "finals": finals, "gains": gains,
               "final_mean": statistics.mean(finals), "gain_mean": statistics.mean(gains),
               "final_sd": statistics.stdev(finals) if len(finals) > 1 else float("nan"),
               "late_drops": sum(r.get("late_drop", False) for rows in curves.values() for r in rows)}
    print(f"\nfinal {args.metric}: " + ", ".join(f"{f:.3f}" for f in finals)
          + f"; mean {summary['final_mean']:.3f} ± {summary['final_sd']:.3f} (sd), mean gain {summary['gain_mean']:+.3f}; "
          f"paired drops beyond 2 SE after the first third: {summary['late_drops']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "curves": curves}, indent=1) + "\n")


if __name__ == "__main__":
    main()
