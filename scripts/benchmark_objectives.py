"""Head to head on the shapes world: every objective, the same model, the same wall-clock budget.

    python scripts/benchmark_objectives.py --minutes 8 --out runs/objectives

Each method trains its recipe (configs/shapes_*.yaml) with ``train.max_minutes`` = the budget and
is evaluated every ``--eval-every`` epochs on the held-out prompts (ODE, the demo's evaluation).
Training time excludes evaluation; GDRO's budget includes generating its offline groups, which
are counted as its samples. Beside accuracy, every evaluation records two quantities no method
optimises: the within-prompt latent diversity and JPEG compressibility (an image-quality proxy),
the reward-hacking check. Writes ``<out>/objectives.json``, ``<out>/objectives.png`` and prints
a Markdown table. Runs one method after another: do not run anything else on the machine.

DDPO needs an ε-prediction model, so it trains the UNet variant of the demo model (shapes-sd15,
``configs/shapes_ddpo.yaml``): a different base model with its own baseline (its first point). Its
curve is dashed and its row names its model: compare it with its own "before", not with the
others'. ``--merge`` keeps the other methods already in ``<out>/objectives.json`` (same budget),
e.g. to add DDPO to a finished benchmark:

    python scripts/benchmark_objectives.py --minutes 4 --threads 1 --methods ddpo --merge --out runs/objectives
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flowalign.config import load_config
from flowalign.offline import generate_groups
from flowalign.trainer import Trainer

METHODS = {  # name → (recipe, overrides)
    "flow_grpo": ("configs/shapes_flow_grpo.yaml", []),
    "flow_grpo_fast": ("configs/shapes_flow_grpo.yaml", ["sampling.step_mode=window", "sampling.window_size=2",
                                                         "train.clip_range=1e-5"]),
    "dance_grpo": ("configs/shapes_dance_grpo.yaml", []),
    "gdro": ("configs/shapes_gdro.yaml", []),
    "diffusion_nft": ("configs/shapes_nft.yaml", []),
    "ddpo": ("configs/shapes_ddpo.yaml", []),  # on shapes-sd15 (UNet, ε-prediction): a different base model
}
DEMO_MODEL = "shapes-sd3"  # the model of every recipe but DDPO's


def run_method(name: str, minutes: float, eval_every: int, out: Path, gdro_groups: int, threads: int) -> dict:
    recipe, overrides = METHODS[name]
    common = [f"output_dir={out / name}", "tracker=none", "checkpoint_every=0", "train.epochs=100000",
              f"eval.every={eval_every}", "eval.extra_rewards=[jpeg_compressibility]"]
    generation_s, generated = 0.0, 0
    if name == "gdro":
        groups_dir = out / "gdro-groups"
        config = load_config(recipe, [*overrides, *common, f"data.offline_groups={groups_dir}"])
        start = time.time()
        generate_groups(config, gdro_groups)
        generation_s = time.time() - start
        generated = json.loads((groups_dir / "index.json").read_text())["groups"] * config.train.group_size
        overrides = [*overrides, f"data.offline_groups={groups_dir}"]
    budget = max(minutes - generation_s / 60, 0.01)
    config = load_config(recipe, [*overrides, *common, f"train.max_minutes={budget}"])
    summary = Trainer(config).train()
    points = []
    for label, result in summary["evals"].items():
        offline = name == "gdro"
        points.append({"label": label, "minutes": (result["train_seconds"] + generation_s) / 60,
                       "samples": generated if offline else result["train_samples"],
                       "accuracy": result["accuracy"], "accuracy_category_mean": result["accuracy_category_mean"],
                       "latent_diversity": result["latent_diversity"],
                       "jpeg_compressibility": result["jpeg_compressibility"]})
    points.sort(key=lambda p: p["minutes"])
    return {"recipe": recipe, "overrides": overrides, "model": config.model.path,
            "generation_minutes": generation_s / 60, "points": points, "epochs": summary["epochs"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results.items():
        pts = r["points"]
        model = r.get("model", DEMO_MODEL)
        style = {"marker": "o", "label": name if model == DEMO_MODEL else f"{name} ({model}: own baseline)",
                 "linestyle": "-" if model == DEMO_MODEL else "--"}
        axes[0].plot([p["minutes"] for p in pts], [p["accuracy"] for p in pts], **style)
        axes[1].plot([p["samples"] for p in pts], [p["accuracy"] for p in pts], **style)
        axes[2].plot([p["minutes"] for p in pts], [p["latent_diversity"] for p in pts], **style)
    for ax, xlabel, ylabel in zip(axes, ("training minutes (2 CPU cores)", "generated samples", "training minutes"),
                                  ("held-out accuracy (ODE)", "held-out accuracy (ODE)", "within-prompt diversity")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget per method")
    parser.add_argument("--eval-every", type=int, default=20, help="epochs between evaluations")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    parser.add_argument("--gdro-groups", type=int, default=256, help="offline groups GDRO generates (in budget)")
    parser.add_argument("--out", default="runs/objectives")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other methods' results already in <out>/objectives.json (same --minutes)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.merge and (out / "objectives.json").is_file():
        previous = json.loads((out / "objectives.json").read_text())
        if previous["minutes"] != args.minutes:
            raise SystemExit(f"--merge: {out / 'objectives.json'} has a {previous['minutes']}-minute budget, "
                             f"not {args.minutes}")
        results = previous["results"]
    for name in args.methods.split(","):
        results[name] = run_method(name, args.minutes, args.eval_every, out, args.gdro_groups, args.threads)
        (out / "objectives.json").write_text(json.dumps({"minutes": args.minutes, "results": results}, indent=2))
    plot(results, out / "objectives.png")
    print("| method | model | minutes | samples | accuracy before → after | category mean | diversity "
          "| JPEG (not optimised) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        first, last = r["points"][0], r["points"][-1]
        print(f"| {name} | {r.get('model', DEMO_MODEL)} | {last['minutes']:.1f} | {last['samples']}"
              f" | {first['accuracy']:.3f} → {last['accuracy']:.3f}"
              f" | {first['accuracy_category_mean']:.3f} → {last['accuracy_category_mean']:.3f}"
              f" | {first['latent_diversity']:.3f} → {last['latent_diversity']:.3f}"
              f" | {first['jpeg_compressibility']:.3f} → {last['jpeg_compressibility']:.3f} |")


if __name__ == "__main__":
    main()
