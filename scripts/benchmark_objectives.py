"""Head to head on the shapes world: every objective, the same model, the same wall-clock budget.

    python scripts/benchmark_objectives.py --minutes 8 --out runs/objectives

Each method trains its recipe (configs/shapes_*.yaml) with ``train.max_minutes`` = the budget and
is evaluated every ``--eval-every`` epochs on the held-out prompts (ODE, the demo's evaluation).
Training time excludes evaluation; GDRO's budget includes generating its offline groups, which
are counted as its samples. Beside accuracy, every evaluation records two quantities no method
optimises: the within-prompt latent diversity and JPEG compressibility (an image-quality proxy),
the reward-hacking check. Writes ``<out>/objectives.json``, ``<out>/objectives.png`` and prints
a Markdown table, then how many samples and minutes each method needed to reach Flow-GRPO's final
accuracy (the papers' efficiency ratios). Runs one method after another; on a 2-core machine two
1-thread runs side by side, each with its own ``--out``, and a ``--report`` that merges them use
the machine fully and keep the runs comparable (both halves share the cores the same way):

    python scripts/benchmark_objectives.py --minutes 10 --threads 1 --methods flow_grpo,dance_grpo,ddpo --out runs/obj-a &
    python scripts/benchmark_objectives.py --minutes 10 --threads 1 --methods diffusion_nft,flow_grpo_fast,gdro --out runs/obj-b
    python scripts/benchmark_objectives.py --minutes 10 --report runs/obj-a runs/obj-b --out runs/objectives

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
from flowalign.group_generation import generate_groups
from flowalign.trainer import Trainer

METHODS = {  # name → (recipe, overrides)
    "flow_grpo": ("configs/shapes_flow_grpo.yaml", []),
    "flow_grpo_fast": ("configs/shapes_flow_grpo.yaml", ["sampling.step_mode=window", "sampling.window_size=2",
                                                         "train.clip_range=1e-5"]),
    "dance_grpo": ("configs/shapes_dance_grpo.yaml", []),
    "gdro": ("configs/shapes_gdro.yaml", []),
    "diffusion_nft": ("configs/shapes_nft.yaml", []),
    "awm": ("configs/shapes_awm.yaml", []),  # the authors' SD3.5 setting: ghuber·σ, both KL terms
    # AWM without its KL terms (plain MSE): the recipe before 2026-12-06, which collapses after ~75 epochs
    "awm_no_kl": ("configs/shapes_awm.yaml", ["train.awm_loss=mse", "train.awm_time_weighting=uniform",
                                              "train.kl_beta=0", "train.awm_ema_beta=0"]),
    "dgpo": ("configs/shapes_dgpo.yaml", []),
    "online_dpo": ("configs/shapes_online_dpo.yaml", []),
    "grpo_guard": ("configs/shapes_grpo_guard.yaml", []),
    "gardo": ("configs/shapes_gardo.yaml", []),
    "branch_grpo": ("configs/shapes_branch_grpo.yaml", []),  # tree rollouts: 4 trees × 16 leaves per epoch
    "flow_dppo": ("configs/shapes_flow_dppo.yaml", []),
    "pref_grpo": ("configs/shapes_pref_grpo.yaml", []),  # flow_grpo's recipe on the verifier score's group win rate
    "crd": ("configs/shapes_crd.yaml", []),  # the authors' SD3.5 OCR settings (their CFG-4.5 teacher in the KL)
    "ddpo": ("configs/shapes_ddpo.yaml", []),  # on shapes-sd15 (UNet, ε-prediction): a different base model
}
DEMO_MODEL = "shapes-sd3"  # the model of every recipe but DDPO's


def run_method(name: str, minutes: float, eval_every: int, out: Path, gdro_groups: int) -> dict:
    recipe, overrides = METHODS[name]
    import torch

    common = [f"output_dir={out / name}", "tracker=none", "checkpoint_every=0", "train.epochs=100000",
              f"threads={torch.get_num_threads()}",  # --threads, kept by the run
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

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    for name, r in results.items():
        pts = r["points"]
        model = r.get("model", DEMO_MODEL)
        style = {"marker": "o", "label": name if model == DEMO_MODEL else f"{name} ({model}: own baseline)",
                 "linestyle": "-" if model == DEMO_MODEL else "--"}
        minutes = [p["minutes"] for p in pts]
        axes[0].plot(minutes, [p["accuracy"] for p in pts], **style)
        axes[1].plot([p["samples"] for p in pts], [p["accuracy"] for p in pts], **style)
        axes[2].plot(minutes, [p["latent_diversity"] for p in pts], **style)
        axes[3].plot(minutes, [p["jpeg_compressibility"] for p in pts], **style)
    labels = (("training minutes", "held-out accuracy (ODE)"), ("generated samples", "held-out accuracy (ODE)"),
              ("training minutes", "within-prompt latent diversity (not optimised)"),
              ("training minutes", "JPEG compressibility, −kB (not optimised)"))
    for ax, (xlabel, ylabel) in zip(axes, labels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(results), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)


def reach(points: list[dict], level: float) -> dict | None:
    """The first evaluation after training began at or above ``level`` (None if none is)."""
    return next((p for p in points[1:] if p["accuracy"] >= level), None)


def report(results: dict, minutes: float, out: Path) -> None:
    """Curves, the Markdown table and the papers' efficiency ratios against Flow-GRPO.

    The ratio's level is Flow-GRPO's last held-out accuracy: for every other method on the same
    model, the samples and minutes of its first evaluation at or above that level, divided into
    Flow-GRPO's. A first crossing of a noisy curve: read it together with the curves."""
    (out / "objectives.json").write_text(json.dumps({"minutes": minutes, "results": results}, indent=2))
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
    if "flow_grpo" not in results:
        return
    base = results["flow_grpo"]["points"]
    level = base[-1]["accuracy"]
    if level <= base[0]["accuracy"]:
        print(f"\nFlow-GRPO ended at {level:.3f}, not above its baseline {base[0]['accuracy']:.3f}: no ratio")
        return
    ref = reach(base, level)
    print(f"\nTo reach Flow-GRPO's final accuracy {level:.3f} (from {base[0]['accuracy']:.3f}); "
          f"Flow-GRPO: {ref['samples']} samples, {ref['minutes']:.1f} min\n")
    print("| method | samples | minutes | fewer samples than Flow-GRPO | fewer minutes than Flow-GRPO |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if name == "flow_grpo" or r.get("model", DEMO_MODEL) != DEMO_MODEL:
            continue
        hit = reach(r["points"], level)
        if hit is None:
            print(f"| {name} | not reached | | | |")
            continue
        samples = f"{ref['samples'] / hit['samples']:.1f}×" if hit["samples"] else "–"
        print(f"| {name} | {hit['samples']} | {hit['minutes']:.1f} | {samples}"
              f" | {ref['minutes'] / max(hit['minutes'], 1e-9):.1f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget per method")
    parser.add_argument("--eval-every", type=int, default=20, help="epochs between evaluations")
    parser.add_argument("--gdro-eval-every", type=int, default=60,
                        help="GDRO's epochs between evaluations (its epochs generate nothing, so they are short)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    parser.add_argument("--gdro-groups", type=int, default=256, help="offline groups GDRO generates (in budget)")
    parser.add_argument("--out", default="runs/objectives")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other methods' results already in <out>/objectives.json (same --minutes)")
    parser.add_argument("--report", nargs="+", metavar="DIR",
                        help="train nothing: merge these runs' objectives.json (same --minutes) into <out>, "
                             "then plot and print the tables")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for previous_dir in args.report or ([out] if args.merge else []):
        path = Path(previous_dir) / "objectives.json"
        if not path.is_file():
            if args.report:
                raise SystemExit(f"--report: {path} does not exist")
            continue
        previous = json.loads(path.read_text())
        if previous["minutes"] != args.minutes:
            raise SystemExit(f"{path} has a {previous['minutes']}-minute budget, not {args.minutes}")
        results.update(previous["results"])
    if not args.report:
        import torch

        torch.set_num_threads(args.threads)
        for name in args.methods.split(","):
            eval_every = args.gdro_eval_every if name == "gdro" else args.eval_every
            results[name] = run_method(name, args.minutes, eval_every, out, args.gdro_groups)
            (out / "objectives.json").write_text(json.dumps({"minutes": args.minutes, "results": results}, indent=2))
    report(results, args.minutes, out)


if __name__ == "__main__":
    main()
