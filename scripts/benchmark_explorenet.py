"""Isotropic noise vs EXPLORENET on the shapes world, at equal noise magnitude and equal samples.

    python scripts/benchmark_explorenet.py --epochs 30 --out runs/explorenet

Runs the Flow-GRPO demo recipe once per ``explore.mode`` (none = isotropic, shape = EXPLORENET,
magnitude = only a learned per-step scale: the ablation, both), same seed, same epochs. Per epoch:
the fraction of zero-spread groups and the mean within-group reward std (``adv/`` stats of the
rollouts each mode drew); held-out accuracy every ``--eval-every`` epochs. Then draws the learned
noise maps (shape mode: mean |m| over channels) for a few prompts at three steps; the magnitude
modes' learned per-step scales exp(a_k) are recorded. Writes ``<out>/explorenet.json``,
``<out>/explorenet.png``, ``<out>/noise_maps.png`` and a Markdown table. ``--set KEY=VALUE``
overrides the recipe for every mode, e.g. the strict 0/1 accuracy as the reward, under which many
groups have no spread (the premise of the method):

    python scripts/benchmark_explorenet.py --epochs 40 --set 'reward.weights={accuracy: 1.0}' --out runs/explorenet

On 2 cores, one mode per 1-thread process (each with its own ``--out``) and a ``--report`` that
merges them: ``--modes none --out runs/ex-none &`` … then ``--report runs/ex-none runs/ex-shape …``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from flowalign.config import load_config
from flowalign.experimental.explore_hook import prompt_vector as _prompt_vector
from flowalign.trainer import Trainer

MODES = ("none", "shape", "magnitude", "both")
PROMPTS = ["a photo of a red circle and a blue square", "a photo of three triangles",
           "a photo of a square left of a circle"]


def noise_maps(trainer: Trainer, path: Path, steps=(0, 4, 8)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adapter, net = trainer.adapter, trainer.hooks[0].net
    cond = adapter.encode(PROMPTS)
    x = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    schedule = adapter.schedule(trainer.config.sampling.num_steps)
    fig, axes = plt.subplots(len(PROMPTS), len(steps), figsize=(3 * len(steps), 3 * len(PROMPTS)))
    with torch.no_grad():
        for j in range(max(steps) + 1):
            m = net(x, j, _prompt_vector(cond)).mean(1)  # [P, h, w]
            if j in steps:
                for i in range(len(PROMPTS)):
                    ax = axes[i, steps.index(j)]
                    im = ax.imshow(m[i].cpu(), cmap="magma")
                    ax.set_title(f"step {j}" + (f"\n{PROMPTS[i]}" if steps.index(j) == 0 else ""), fontsize=7)
                    ax.axis("off")
                    fig.colorbar(im, ax=ax, fraction=0.046)
            x = x + (schedule.sigmas[j + 1] - schedule.sigmas[j]) * adapter.predict(x, schedule.timesteps[j], cond)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/shapes_flow_grpo.yaml")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="runs/explorenet")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to every mode (repeatable)")
    parser.add_argument("--report", nargs="+", metavar="DIR",
                        help="train nothing: merge these runs' explorenet.json into <out>, plot and print the table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, overrides = {}, args.set
    for run in args.report or []:  # the runs must share the recipe: the same epochs and overrides
        previous = json.loads((Path(run) / "explorenet.json").read_text())
        if previous["epochs"] != args.epochs or previous.get("overrides", []) != args.set:
            raise SystemExit(f"{run} ran {previous['epochs']} epochs with overrides {previous.get('overrides', [])},"
                             f" not {args.epochs} with {args.set}")
        results.update(previous["results"])
    for mode in [] if args.report else args.modes.split(","):
        config = load_config(args.config, [f"output_dir={out / mode}", "tracker=none", "checkpoint_every=0",
                                           f"train.epochs={args.epochs}", f"eval.every={args.eval_every}",
                                           f"explore.mode={mode}", f"threads={torch.get_num_threads()}", *overrides])
        trainer = Trainer(config)
        summary = trainer.train()
        results[mode] = {
            "zero_spread_groups": [h["adv/zero_spread_groups"] for h in trainer.history],
            "group_std": [h["adv/group_std"] for h in trainer.history],
            "m_std": [h.get("explore/m_std", 0.0) for h in trainer.history],
            "step_scales": trainer.hooks[0].net.log_magnitude.exp().tolist() if mode in ("magnitude", "both") else None,
            "evals": {k: {"epoch": v["epoch"], "accuracy": v["accuracy"],
                          "accuracy_category_mean": v["accuracy_category_mean"]} for k, v in summary["evals"].items()},
        }
        (out / "explorenet.json").write_text(json.dumps({"epochs": args.epochs, "overrides": overrides,
                                                         "results": results}, indent=2))
        if mode == "shape":
            noise_maps(trainer, out / "noise_maps.png")
    for run in args.report or []:
        if (Path(run) / "noise_maps.png").is_file() and Path(run).resolve() != out.resolve():
            shutil.copy(Path(run) / "noise_maps.png", out / "noise_maps.png")
    (out / "explorenet.json").write_text(json.dumps({"epochs": args.epochs, "overrides": overrides,
                                                     "results": results}, indent=2))
    plot(results, out / "explorenet.png")
    print("| noise | zero-spread groups (mean over epochs) | within-group std | accuracy before → after |")
    print("|---|---|---|---|")
    for mode, r in results.items():
        n = len(r["group_std"])
        ev = sorted(r["evals"].values(), key=lambda e: e["epoch"])
        print(f"| {mode} | {sum(r['zero_spread_groups']) / n:.3f} | {sum(r['group_std']) / n:.4f} | "
              f"{ev[0]['accuracy']:.3f} → {ev[-1]['accuracy']:.3f} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, r in results.items():
        axes[0].plot(r["zero_spread_groups"], label=mode)
        axes[1].plot(r["group_std"], label=mode)
        ev = sorted(r["evals"].values(), key=lambda e: e["epoch"])
        axes[2].plot([e["epoch"] for e in ev], [e["accuracy"] for e in ev], marker="o", label=mode)
    for ax, title in zip(axes, ("zero-spread groups", "within-group reward std", "held-out accuracy (ODE)")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
