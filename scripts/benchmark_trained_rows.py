"""What rescoring only the trained rows saves in a fraction-mode update (DanceGRPO's recipe).

    python scripts/benchmark_trained_rows.py configs/shapes_dance_grpo.yaml --rounds 3

Samples one epoch of the recipe, then times, in paired rounds (process CPU time, one thread),
every loss term's forward and backward over one minibatch two ways: ``FlowGRPO.loss`` as it is
(the denoiser runs on the rows that train step j) and the whole minibatch rescored with the
untrained rows weighted 0 (what every fraction-mode step cost before). Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="configs/shapes_dance_grpo.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flowalign.config import load_config
    from flowalign.objectives.base import Minibatch
    from flowalign.objectives.flow_grpo import flow_grpo_loss
    from flowalign.trainer import Trainer

    config = load_config(args.recipe, ["tracker=none", "eval.every=0", "checkpoint_every=0", "threads=1",
                                       "output_dir=runs/benchmark-trained-rows"])
    trainer = Trainer(config)
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    objective, t = trainer.objective, config.train
    idx = torch.arange(min(t.train_batch_size, len(batch.specs)))
    valid = advantages.isfinite()
    valid = valid.all(dim=1) if valid.ndim == 2 else valid  # as the trainer: a sample trains if every column is finite
    mb = Minibatch.of(batch, idx, torch.nan_to_num(advantages), valid)
    trainer.model.train()

    def trained_rows():
        for j in objective.terms(batch):
            objective.loss(mb, j)[0].backward()

    def whole_minibatch():
        for j in objective.terms(batch):
            out = objective.transition(mb, j)
            adv = mb.advantages
            loss, _ = flow_grpo_loss(out.log_prob, mb.traj.log_probs[:, j], adv, clip_range=t.clip_range,
                                     weight=objective.trained_weight(mb, j),
                                     advantage_weights=objective.ctx.reward_weights if adv.ndim == 2 else None)
            loss.backward()

    times = {"trained rows": [], "whole minibatch": []}
    for _ in range(args.rounds):
        for name, fn in (("trained rows", trained_rows), ("whole minibatch", whole_minibatch)):
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    trained = float(mb.traj.trained[:, objective.terms(batch)].float().mean())
    a, b = statistics.median(times["trained rows"]), statistics.median(times["whole minibatch"])
    print(f"{args.recipe}: {len(idx)} samples, {len(objective.terms(batch))} terms, {trained:.2f} of rows trained "
          f"per term; one minibatch's terms, median CPU s: trained rows {a:.2f}, whole minibatch {b:.2f}, "
          f"ratio {b / a:.2f}x")


if __name__ == "__main__":
    main()
