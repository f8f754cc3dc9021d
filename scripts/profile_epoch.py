"""Where the time of a recipe's epochs and of one held-out evaluation goes, per phase, in process
CPU time (one thread: what one core spends, whatever else runs on the machine).

    OMP_NUM_THREADS=1 python scripts/profile_epoch.py configs/shapes_nft.yaml --epochs 3
    OMP_NUM_THREADS=1 python scripts/profile_epoch.py configs/shapes_flow_grpo.yaml --epochs 3 --eval

Phases of an epoch (flowalign/trainer.py's loop): rollout (the sampler's denoiser calls and steps),
decode (the VAE), reward (scoring; the recipe's worker thread, counted where it runs), advantages,
update (the objective's loss terms, backward and optimizer steps; split into its forward passes
without gradient: old / reference policies, and the rest), end-epoch. The first epoch is a warm-up
and is left out. ``--eval``: one held-out evaluation of the recipe's size, timed the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time

import torch

from flowalign.config import load_config
from flowalign.trainer import Trainer


class Clock:
    """Process CPU time per phase name; nested phases are charged to the innermost one only."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.stack: list[list] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.process_time()
        self.stack.append([name, 0.0])
        try:
            yield
        finally:
            _, inner = self.stack.pop()
            spent = time.process_time() - start
            self.totals[name] = self.totals.get(name, 0.0) + spent - inner
            if self.stack:
                self.stack[-1][1] += spent

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)


def instrument(trainer: Trainer, clock: Clock) -> None:
    import flowalign.epoch_sampler as epoch_sampler
    import flowalign.evaluator as evaluator

    adapter = trainer.adapter
    predict = adapter.predict

    def timed_predict(*args, **kwargs):
        name = "rollout" if not torch.is_grad_enabled() and not trainer.model.training else (
            "update: forward without gradient" if not torch.is_grad_enabled() else "update: rest")
        with clock.phase(name):
            return predict(*args, **kwargs)

    adapter.predict = timed_predict
    clock.wrap(adapter, "decode", "decode")
    clock.wrap(epoch_sampler, "reward_chunk", "reward")
    clock.wrap(evaluator, "reward_chunk", "reward")
    clock.wrap(trainer, "sample_epoch", "rollout")
    clock.wrap(trainer, "compute_advantages", "advantages")
    clock.wrap(trainer, "update_policy", "update: rest")
    clock.wrap(trainer.objective, "end_epoch", "end-epoch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed after one warm-up epoch")
    parser.add_argument("--eval", action="store_true", help="also time one held-out evaluation")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(args.config, [*args.overrides, f"output_dir={tmp}", "tracker=none", "threads=1"])
        trainer = Trainer(config)
        trainer.train_epoch()  # warm-up
        trainer.epoch += 1
        clock = Clock()
        instrument(trainer, clock)
        start = time.process_time()
        for _ in range(args.epochs):
            trainer.train_epoch()
            trainer.epoch += 1
        epoch_total = (time.process_time() - start) / args.epochs
        epoch = {k: v / args.epochs for k, v in clock.totals.items()}
        result = {"config": args.config, "overrides": args.overrides, "epochs": args.epochs,
                  "epoch_cpu_s": epoch_total, "epoch_phases_cpu_s": epoch}
        if args.eval:
            clock.totals = {}
            start = time.process_time()
            with clock.phase("evaluation: other"):
                trainer.evaluate("profile")
            result["eval_cpu_s"] = time.process_time() - start
            result["eval_phases_cpu_s"] = dict(clock.totals)
    print(f"one epoch: {epoch_total:.2f} s CPU")
    for name, value in sorted(epoch.items(), key=lambda kv: -kv[1]):
        print(f"  {name:34s} {value:7.2f} s  {100 * value / epoch_total:5.1f} %")
    if args.eval:
        print(f"one evaluation: {result['eval_cpu_s']:.2f} s CPU")
        for name, value in sorted(result["eval_phases_cpu_s"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:34s} {value:7.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
