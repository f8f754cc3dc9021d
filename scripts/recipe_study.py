"""One run of a recipe study: a recipe with overrides, trained for a CPU-time budget, evaluated
along the way; writes one JSON file (so runs can go two at a time and be committed as they finish).

    python scripts/recipe_study.py configs/shapes_flow_grpo.yaml --name lr1e-3 \\
        --set train.learning_rate=1e-3 --cpu-minutes 8 --seed 0 --split validation \\
        --out docs/study/flow_grpo/lr1e-3-s0.json

``--split validation`` (choosing a recipe): trains on two thirds of ``shapes:train`` and evaluates
on the other third (every third prompt of each GenEval category, in file order), so the held-out
test prompts never choose a recipe. ``--split test`` (reporting a chosen recipe): trains on all of
``shapes:train`` and evaluates on ``shapes:test``, the demo's held-out evaluation.

The budget is the training process's CPU time (``train.max_cpu_minutes``: evaluation excluded, the
reward's worker thread included), so a run measures the same thing whatever else the machine's
cores are doing; at one thread it is the single-core time a free machine would take. Every point
records its epoch, CPU and wall minutes of training and samples generated so far.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SPLITS = ("validation", "test")


def validation_split(train: list[dict]) -> tuple[list[dict], list[dict]]:
    """(fit, validation): every third prompt of each "tag" (category), in file order, is validation."""
    seen: dict[str, int] = {}
    fit, val = [], []
    for spec in train:
        k = seen.get(spec.get("tag"), 0)
        seen[spec.get("tag")] = k + 1
        (val if k % 3 == 2 else fit).append(spec)
    return fit, val


def run(recipe: str, overrides: list[str], cpu_minutes: float, seed: int, split: str, eval_every: int,
        threads: int) -> dict:
    import torch

    from flowalign.config import load_config
    from flowalign.prompts import load_prompts
    from flowalign.trainer import Trainer

    torch.set_num_threads(threads)
    common = ["tracker=none", "checkpoint_every=0", "train.epochs=100000", f"threads={threads}",
              f"eval.every={eval_every}", f"train.seed={seed}", f"train.max_cpu_minutes={cpu_minutes}",
              # the reward-hacking check's second column (docs/objectives.md): evaluated, never trained on
              "eval.extra_rewards=[jpeg_compressibility]"]
    config = load_config(recipe, [*overrides, *common, f"output_dir=runs/study/{time.time_ns()}"])
    train = load_prompts(config.data.train_prompts)
    if split == "validation":
        train, evaluate = validation_split(train)
    else:
        evaluate = load_prompts(config.data.eval_prompts)
    trainer = Trainer(config, train_prompts=train, eval_prompts=evaluate)
    summary = trainer.train()
    history = trainer.history
    per_epoch = config.train.groups_per_epoch * config.train.group_size
    points = []
    for label, result in summary["evals"].items():
        done = history[: result["epoch"]]
        points.append({"label": label, "epoch": result["epoch"],
                       "cpu_minutes": sum(h["time/epoch_cpu_s"] for h in done) / 60,
                       "wall_minutes": sum(h["time/epoch_s"] for h in done) / 60,
                       "samples": result["epoch"] * per_epoch,
                       **{k: result[k] for k in ("accuracy", "accuracy_category_mean", "score", "latent_diversity",
                                                    "jpeg_compressibility")
                          if k in result}})
    points.sort(key=lambda p: p["epoch"])
    return {"recipe": recipe, "overrides": overrides, "seed": seed, "split": split, "cpu_minutes": cpu_minutes,
            "threads": threads, "eval_prompts": len(evaluate), "train_prompts": len(train),
            "epochs": summary["epochs"], "points": points,
            "reward_mean": [h["reward/mean"] for h in history],
            # every epoch's logged statistics (group reward spread, zero-spread groups, KL, clip
            # fractions, EXPLORENET's scales…), 6 significant digits: what explains a curve
            "history": [{k: float(f"{v:.6g}") for k, v in h.items() if isinstance(v, (int, float))}
                        for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--name", required=True, help="the variant's name (recorded)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the recipe")
    parser.add_argument("--cpu-minutes", type=float, default=8.0, help="training CPU-time budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default="validation")
    parser.add_argument("--eval-every", type=int, default=20, help="epochs between evaluations")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args()
    result = {"name": args.name, **run(args.recipe, args.set, args.cpu_minutes, args.seed, args.split,
                                       args.eval_every, args.threads)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    first, last = result["points"][0], result["points"][-1]
    print(f"{args.name} seed {args.seed} ({args.split}): accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f} "
          f"after {last['epoch']} epochs, {last['cpu_minutes']:.1f} CPU-min, {last['samples']} samples")


if __name__ == "__main__":
    main()
