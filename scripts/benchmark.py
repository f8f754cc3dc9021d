"""Rollout overhead and training throughput, measured side by side in one run.

1. Rollout with per-step log-probabilities (Flow-GRPO SDE on every step but the last) against
   the plain ``StableDiffusion3Pipeline.__call__`` at the same steps, batch and guidance, both
   ending in decoded images. The two are interleaved rep by rep and the median of each is
   reported with their ratio, so machine noise hits both alike.
2. Training throughput: whole epochs (rollout → rewards → advantages → update) of the demo
   recipe, in samples per second, with the time split by phase.

    python scripts/benchmark.py --out docs/benchmark.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flowalign.config import load_config
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from reward_models.worlds.shapes import prompt_split
from pipelines.sd3 import SD3Adapter


def bench_rollout(model: str, batch: int, steps: int, guidance: float, reps: int) -> dict:
    adapter = SD3Adapter.from_pretrained(model)
    pipe = adapter.pipe
    prompts = [s["prompt"] for s in prompt_split("test")][:batch]
    prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    common = dict(num_inference_steps=steps, guidance_scale=guidance)

    def run_pipeline(seed):
        pipe(prompts, generator=torch.Generator().manual_seed(seed), output_type="pt",
             max_sequence_length=adapter.max_sequence_length, height=adapter.height, width=adapter.width, **common)

    def run_rollout(seed):
        g = torch.Generator().manual_seed(seed)
        traj = rollout(adapter, adapter.encode(prompts), adapter.initial_noise(batch, g), adapter.schedule(steps),
                       plan_steps(steps, batch, 1.0), guidance_scale=guidance, generator=g)
        adapter.decode(traj.samples)

    times = {"pipeline": [], "rollout_with_log_probs": []}
    with torch.no_grad():
        run_pipeline(0), run_rollout(0)  # warm-up
        for rep in range(reps):
            for name, fn in (("pipeline", run_pipeline), ("rollout_with_log_probs", run_rollout))[:: 1 if rep % 2 else -1]:
                t0 = time.perf_counter()
                fn(rep)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "steps": steps, "guidance": guidance, "reps": reps,
            "median_s": med, "overhead": med["rollout_with_log_probs"] / med["pipeline"] - 1}


def bench_training(config_path: str, epochs: int) -> dict:
    config = load_config(config_path, ["tracker=none", "output_dir=/tmp/flowalign-benchmark", "eval.seeds=1",
                                      f"threads={torch.get_num_threads()}"])  # --threads, kept by the run
    trainer = Trainer(config)
    phases = {"sample_and_reward": [], "advantages": [], "update": []}
    samples = config.train.groups_per_epoch * config.train.group_size
    for _ in range(epochs):
        t0 = time.perf_counter()
        batch = trainer.sample_epoch()
        t1 = time.perf_counter()
        adv, _ = trainer.compute_advantages(batch)
        t2 = time.perf_counter()
        trainer.update_policy(batch, adv)
        t3 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[k].append(v)
    med = {k: statistics.median(v) for k, v in phases.items()}
    total = sum(med.values())
    return {"config": config_path, "samples_per_epoch": samples, "epochs": epochs,
            "median_phase_s": med, "samples_per_s": samples / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shapes-sd3")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--config", default="configs/shapes_flow_grpo.yaml")
    parser.add_argument("--train-epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"rollout": [bench_rollout(args.model, args.batch, args.steps, g, args.reps) for g in (1.0, 4.5)],
               "training": bench_training(args.config, args.train_epochs),
               "torch": torch.__version__, "threads": args.threads}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
