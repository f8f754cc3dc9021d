"""Adaptive reward routing on the audio-video world: fixed weights vs each mechanism alone vs both.

    python scripts/benchmark_av_routing.py --minutes 6 --threads 1 --out runs/av-routing

Every arm trains ``configs/av_nft.yaml`` (DiffusionNFT, the built-in av-demo model) for the same
wall-clock budget (``train.max_minutes``), evaluated every ``--eval-every`` epochs on the held-out
prompts (ODE):

* ``fixed``: one advantage Σ_k p_k·A_k for every element (plain DiffusionNFT);
* ``influence``: (i) cross-modal influence token weights and layer gradient scales;
* ``reweight``: (ii) per-branch routing with residual reweighting after the warm-up;
* ``both``: (i) and (ii).

Writes ``<out>/av_routing.json`` and ``<out>/av_routing.png`` (each component against minutes)
and prints a Markdown table: every component before → after per arm, sync's paired change, the
sync gain over the fixed arm's (of the same training seed), and which components ended below their
baseline: paired against the "before" evaluation (the same noise), a change below −2 standard
errors (a point comparison for results recorded without the paired change). Runs one arm after
another: do not run anything else on the machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowalign.config import load_config
from flowalign.trainer import Trainer
from reward_models.audio_video import COMPONENTS

RECIPE = "configs/av_nft.yaml"
ARMS = {
    "fixed": [],
    "influence": ["routing.influence=true"],
    "reweight": ["routing.reweight=true"],
    "both": ["routing.influence=true", "routing.reweight=true"],
}


def run_arm(name: str, minutes: float, eval_every: int, out: Path, extra: list[str]) -> dict:
    import torch

    config = load_config(RECIPE, [*ARMS[name], *extra, f"output_dir={out / name}", "tracker=none",
                                  "checkpoint_every=0", "train.epochs=100000", f"eval.every={eval_every}",
                                  f"train.max_minutes={minutes}", f"threads={torch.get_num_threads()}"])
    summary = Trainer(config).train()
    points = sorted(({"label": label, "minutes": result.get("train_seconds", 0.0) / 60,
                      **{k: result[k] for c in COMPONENTS for k in (c, f"{c}_change", f"{c}_change_se")
                         if k in result}} for label, result in summary["evals"].items()),
                    key=lambda p: p["minutes"])
    return {"overrides": ARMS[name] + extra, "epochs": summary["epochs"], "points": points}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COMPONENTS), figsize=(4 * len(COMPONENTS), 3.6))
    colours, repeats = {}, {}  # one colour per configuration, one line style per training seed of it
    for name, r in results.items():
        config = " ".join(w for w in name.split() if not w.startswith("train.seed="))
        colour = colours.setdefault(config, f"C{len(colours) % 10}")
        styles = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
        style = styles[repeats.get(config, 0) % len(styles)]
        repeats[config] = repeats.get(config, 0) + 1
        for ax, component in zip(axes, COMPONENTS):
            ax.plot([p["minutes"] for p in r["points"]], [p[component] for p in r["points"]], marker="o",
                    markersize=3, color=colour, linestyle=style, label=name)
    for ax, component in zip(axes, COMPONENTS):
        ax.set_title(component)
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_inches = 0.22 * -(-len(labels) // 2) + 0.2  # two columns under the panels
    fig.set_size_inches(4 * len(COMPONENTS), 3.6 + legend_inches)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_inches / (3.6 + legend_inches), 1, 1))
    fig.savefig(path, dpi=110)


def ended_below(last: dict, first: dict) -> list[str]:
    """The components whose paired change is below −2 standard errors (``last[c + "_change"]``; a point
    comparison last < first where the change was not recorded)."""
    return [c for c in COMPONENTS if (last[f"{c}_change"] < -2 * last[f"{c}_change_se"] if f"{c}_change" in last
                                      else last[c] < first[c])]


def fixed_arm(name: str, results: dict) -> dict | None:
    """The fixed-weights arm to compare arm ``name`` with: "fixed", or in a merged table the fixed arm
    of the same training seed with no other override ("fixed train.seed=3")."""
    seed = [w for w in name.split() if w.startswith("train.seed=")]
    return next((r for other, r in results.items() if other.split() == ["fixed", *seed]), None)


def table(results: dict) -> str:
    rows = ["| arm | epochs | " + " | ".join(COMPONENTS) + " | sync paired change | sync gain − fixed's | below baseline |",
            "|---|---|" + "---|" * len(COMPONENTS) + "---|---|---|"]
    for name, r in results.items():
        first, last = r["points"][0], r["points"][-1]
        below = ended_below(last, first)
        fixed = fixed_arm(name, results)
        gain = "" if fixed is None else f"{last['sync'] - fixed['points'][-1]['sync']:+.3f}"
        paired = f"{last['sync_change']:+.3f} ± {last['sync_change_se']:.3f}" if "sync_change" in last else ""
        rows.append(f"| {name} | {r['epochs']} | " + " | ".join(f"{first[c]:.3f} → {last[c]:.3f}" for c in COMPONENTS)
                    + f" | {paired} | {gain} | {', '.join(below) or 'none'} |")
    return "\n".join(rows)


def merge(paths: list[str], out: Path) -> None:
    runs = []
    for spec in paths:  # PATH or PATH:arm,arm (only those arms of that file)
        path, _, only = spec.partition(":")
        runs += [(name, r) for name, r in json.loads(Path(path).read_text())["results"].items()
                 if not only or name in only.split(",")]
    extras = [[o for o in r["overrides"] if o not in ARMS[name]] for name, r in runs]
    shared = set.intersection(*(set(e) for e in extras))
    results = {" ".join([name, *(o for o in e if o not in shared)]): r for (name, r), e in zip(runs, extras)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "av_routing.json").write_text(json.dumps({"merged": paths, "results": results}, indent=2))
    plot(results, out / "av_routing.png")
    print(table(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget per arm")
    parser.add_argument("--eval-every", type=int, default=10, help="epochs between evaluations")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {list(ARMS)}")
    parser.add_argument("--out", default="runs/av-routing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="train nothing: combine the av_routing.json of earlier runs (e.g. arms run as two "
                             "concurrent processes; PATH:arm,arm takes only those arms of a file) into one table "
                             "and plot in --out; an arm is labelled by its "
                             "name and the overrides that not every merged arm shares")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every arm")
    args = parser.parse_args()
    if args.merge:
        return merge(args.merge, Path(args.out))
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.arms.split(","):
        results[name] = run_arm(name, args.minutes, args.eval_every, out, args.overrides)
        (out / "av_routing.json").write_text(json.dumps({"minutes": args.minutes, "results": results}, indent=2))
    plot(results, out / "av_routing.png")
    print(table(results))


if __name__ == "__main__":
    main()
