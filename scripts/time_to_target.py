"""Time to target: CPU-minutes and samples each method needs to reach held-out accuracy levels.

    python scripts/time_to_target.py --runs "docs/study/test/*.json" --objectives docs/objectives.json \\
        --labels docs/time_to_target_labels.json --plot docs/img/time_to_target.png --json docs/time_to_target.json

Inputs: ``scripts/recipe_study.py`` results (one JSON per method × seed; its ``name`` is the row,
``cpu_minutes`` the training CPU time, one thread) and, optionally, the single-seed
``scripts/benchmark_objectives.py`` file (``docs/objectives.json``: its minutes are wall-clock of a
one-thread run with a core to itself, which is its CPU time; its rows are marked "1 seed"). Only
``--split test`` study runs are read (the held-out test prompts, as the benchmark).

``--labels`` names the rows: a JSON object {run name: label}, whose order is the table's (rows it
does not name follow, under their run names); docs/time_to_target_labels.json is the docs' own.

A level counts as reached at a run's first evaluation after training began at or above it (a first
crossing of a noisy curve: one standard error of one evaluation is ≈ 0.026). A row gives the mean
over the seeds that reached the level and says how many did; the plot shows each method's mean
accuracy against CPU-minutes with a band of ± one standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

HACKING = ("latent_diversity", "jpeg_compressibility")  # evaluated, never optimised (docs/objectives.md)


def curves_from_study(patterns: list[str]) -> dict[str, list[list[dict]]]:
    """{name: [points of each seed]}: points have cpu_minutes, samples, accuracy."""
    out: dict[str, list[list[dict]]] = {}
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            run = json.loads(Path(path).read_text())
            if run.get("split") != "test":
                continue
            out.setdefault(run["name"], []).append(
                [{"cpu_minutes": p["cpu_minutes"], **_kept(p)} for p in run["points"]])
    return out


def curves_from_objectives(path: str) -> dict[str, list[list[dict]]]:
    data = json.loads(Path(path).read_text())["results"]
    return {f"{name} (1 seed, {r.get('model', 'shapes-sd3')})": [
        [{"cpu_minutes": p["minutes"], **_kept(p)} for p in r["points"]]] for name, r in data.items()}


def _kept(point: dict) -> dict:
    """What the table reads of an evaluation: samples, accuracy and the two unoptimised columns of
    the reward-hacking check (within-prompt latent diversity, JPEG size as −kB) where recorded."""
    return {k: point[k] for k in ("samples", "accuracy", *HACKING) if k in point}


def relabel(curves: dict[str, list[list[dict]]], labels: dict[str, str]) -> dict[str, list[list[dict]]]:
    """The curves under their labels, in the labels' order; runs without a label follow, as named."""
    named = [(labels[name], curves[name]) for name in labels if name in curves]
    return dict(named + [(name, seeds) for name, seeds in curves.items() if name not in labels])


def reach(points: list[dict], level: float) -> dict | None:
    return next((p for p in points[1:] if p["accuracy"] >= level), None)


def table(curves: dict[str, list[list[dict]]], levels: list[float]) -> list[dict]:
    rows = []
    for name, seeds in curves.items():
        finals = [s[-1]["accuracy"] for s in seeds]
        row = {"method": name, "seeds": len(seeds), "before": statistics.mean(s[0]["accuracy"] for s in seeds),
               "final_mean": statistics.mean(finals),
               "final_sd": statistics.stdev(finals) if len(finals) > 1 else None,
               "cpu_minutes": statistics.mean(s[-1]["cpu_minutes"] for s in seeds), "levels": {}}
        for key in HACKING:  # before → after, mean over the seeds that recorded it
            recorded = [s for s in seeds if key in s[0] and key in s[-1]]
            row[key] = ({"seeds": len(recorded), "before": statistics.mean(s[0][key] for s in recorded),
                         "after": statistics.mean(s[-1][key] for s in recorded)} if recorded else None)
        for level in levels:
            hits = [h for h in (reach(s, level) for s in seeds) if h is not None]
            row["levels"][f"{level:.2f}"] = {
                "reached": len(hits),
                "cpu_minutes": statistics.mean(h["cpu_minutes"] for h in hits) if hits else None,
                "samples": statistics.mean(h["samples"] for h in hits) if hits else None}
        rows.append(row)
    return rows


def markdown(rows: list[dict], levels: list[float]) -> str:
    head = "| method | seeds | before → after (mean ± sd) | " + " | ".join(
        f"to {level:.2f}: CPU-min / samples" for level in levels) + " | latent diversity (not optimised) | JPEG, −kB (not optimised) |"
    lines = [head, "|" + "---|" * (5 + len(levels))]
    for r in rows:
        sd = f" ± {r['final_sd']:.3f}" if r["final_sd"] is not None else ""
        cells = []
        for level in levels:
            c = r["levels"][f"{level:.2f}"]
            if not c["reached"]:
                cells.append("not reached")
                continue
            part = "" if c["reached"] == r["seeds"] else f" ({c['reached']}/{r['seeds']} seeds)"
            cells.append(f"{c['cpu_minutes']:.1f} / {c['samples']:,.0f}{part}")
        for key in HACKING:
            h = r[key]
            part = "" if h is None or h["seeds"] == r["seeds"] else f" ({h['seeds']}/{r['seeds']} seeds)"
            cells.append("–" if h is None else f"{h['before']:.3f} → {h['after']:.3f}{part}")
        lines.append(f"| {r['method']} | {r['seeds']} | {r['before']:.3f} → {r['final_mean']:.3f}{sd} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(curves: dict[str, list[list[dict]]], path: str) -> None:
    """Two panels: methods run with several seeds (mean, band of ± one sd) and single-seed ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"several seeds: mean ± one sd": {k: v for k, v in curves.items() if len(v) > 1},
              "one seed": {k: v for k, v in curves.items() if len(v) == 1}}
    groups = {title: group for title, group in groups.items() if group}
    fig, axes = plt.subplots(1, len(groups), figsize=(8 * len(groups), 6), sharey=True, squeeze=False)
    colours = plt.get_cmap("tab20").colors
    for ax, (title, group) in zip(axes[0], groups.items()):
        for m, (name, seeds) in enumerate(group.items()):
            n = min(len(s) for s in seeds)  # runs of one method share their evaluation epochs up to the shortest
            x = [statistics.mean(s[i]["cpu_minutes"] for s in seeds) for i in range(n)]
            y = [statistics.mean(s[i]["accuracy"] for s in seeds) for i in range(n)]
            colour = colours[2 * (m % 10) + m // 10 % 2]  # the 10 strong colours first, then their light twins
            ax.plot(x, y, marker="o", markersize=3, color=colour, label=f"{name} ({len(seeds)})")
            if len(seeds) > 1:
                sd = [statistics.stdev(s[i]["accuracy"] for s in seeds) for i in range(n)]
                ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)],
                                color=colour, alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("training CPU-minutes (one thread)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    axes[0][0].set_ylabel("held-out accuracy (44 test prompts × 8 seeds, ODE)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=[], help="glob(s) of recipe_study.py JSON files")
    parser.add_argument("--objectives", help="a benchmark_objectives.py objectives.json (single seed)")
    parser.add_argument("--labels", help="a JSON object {run name: row label}, in the table's order")
    parser.add_argument("--levels", default="0.45,0.5,0.55,0.6")
    parser.add_argument("--plot", help="write the accuracy-vs-CPU-minutes plot here")
    parser.add_argument("--json", help="write the table's numbers here")
    args = parser.parse_args()
    levels = [float(x) for x in args.levels.split(",")]
    curves = curves_from_study(args.runs)
    if args.objectives:
        curves.update(curves_from_objectives(args.objectives))
    if args.labels:
        curves = relabel(curves, json.loads(Path(args.labels).read_text()))
    if not curves:
        raise SystemExit("no runs: --runs matched no --split test study file and no --objectives was given")
    rows = table(curves, levels)
    print(markdown(rows, levels))
    if args.json:
        Path(args.json).write_text(json.dumps({"levels": levels, "rows": rows}, indent=1))
    if args.plot:
        plot(curves, args.plot)


if __name__ == "__main__":
    main()
