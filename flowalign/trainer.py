"""The training recipe: the only place that knows the order of the loop (``../shared/DESIGN.md``).

    set-up     config checks, Accelerate, shards and streams, prompts, rewards, the model, the
               objective of ``method`` (flowalign/objectives), hooks, checkpoints
    each epoch sample (the epoch sampler, with the objective's sampling weights) → score (in the
               sampler) → advantages → update (the objective's loss terms, accumulated) →
               end-epoch (the objective's), evaluation and checkpoints when due
    clean-up   the final evaluation, ``final/``, metrics.json and history.jsonl

It names no method: what differs between methods is the objective's (its protocol:
``flowalign/objectives/base.py``). The components it calls each do one job: ``distributed``
(shards, streams, gathers), ``epoch_sampler``, ``advantages``, ``evaluator``, ``checkpoint``,
``ema``, ``model_setup``, ``stopping``. Randomness flows from one seed per run through the shards'
generators, all checkpointed, so a resumed run reproduces the uninterrupted one.

Faults (docs/distributed.md, docs/faults.md): SIGTERM / SIGINT stop the run after the epoch in
progress, with a checkpoint; an optimizer step whose loss or gradient is not finite is skipped on
every process and counted; checkpoints are atomic, hashed and checked whole before use
(``flowalign.checkpoint``); the reward's failures are handled by ``flowalign.faults``.

Determinism: a run's numbers are a function of its config (seed and ``threads`` included), torch's
version and the CPU instruction set of torch's kernels (``run_environment``, printed at the start and
kept in metrics.json), never of the machine's load (tests/test_golden.py).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from flowalign import experimental
from flowalign.advantages import Advantages
from flowalign.checkpoint import Checkpointer, outputs_disk_full
from flowalign.config import ConfigError, RunConfig, to_dict
from flowalign.distributed import Distributed
from flowalign.ema import EMA, maybe_swapped_in, short_run_warning
from flowalign.epoch_sampler import EpochBatch, EpochSampler
from flowalign.evaluator import Evaluator, flat
from flowalign.faults import NanEpochStreak, RewardGuard, built_reward, finite_json
from flowalign.rollout import resolved_autocast
from flowalign.callbacks import HubPush, TrackerLogging, fire
from flowalign.hub import check_hub
from flowalign.logs import add_default_handler, get_logger
from flowalign.lr_schedule import lr_factor
from flowalign.model_setup import build_model
from flowalign.objectives.base import Context, Minibatch, objective_class
from flowalign.outputs import init_trackers, write_hub_files
from flowalign.preflight import check_modality, check_reward_components, family_prediction, validate
from flowalign.prompts import load_prompts
from flowalign.run_folder import RunLock, clear_outputs, settings
from flowalign.stopping import GracefulStop
from reward_models.base import as_reward

log = get_logger("trainer")


class Trainer:
    """``Trainer(config).train()`` runs a whole experiment; ``history`` holds one dict per epoch.
    ``reward`` (a Reward or a reward function), ``train_prompts`` / ``eval_prompts`` (lists) and a
    loaded ``adapter``, when given, replace what the config names (``flowalign.train``, flowalign/api.py)."""

    def __init__(self, config: RunConfig, *, reward=None, train_prompts=None, eval_prompts=None, adapter=None,
                 callbacks=()):
        given = {key for key, value in (("reward", reward), ("data.train_prompts", train_prompts),
                                        ("data.eval_prompts", eval_prompts), ("model", adapter)) if value is not None}
        add_default_handler()  # messages through logging, main process only (flowalign/logs.py)
        validate(config, given=given)  # every check that needs no weights (flowalign/preflight.py: also `train --dry-run`)
        check_hub(config)  # hub.repo: owner/name and a token, before training rather than after
        if config.threads:  # before any tensor work: a run's numbers depend on its thread count
            torch.set_num_threads(config.threads)
        self.config, t = config, config.train
        self.out = Path(config.output_dir)
        objective_cls = objective_class(config.method, config.model.family, family_prediction(config.model.family))
        # backward passes per optimizer step: the objective's loss terms per minibatch (Accelerate's
        # gradient accumulation, so DDP syncs and DeepSpeed steps once, on the last of them)
        accumulation = objective_cls.num_terms(config)
        self.accelerator = acc = Accelerator(
            mixed_precision=t.mixed_precision, project_dir=str(self.out), gradient_accumulation_steps=accumulation,
            log_with=None if config.tracker == "none" else config.tracker)
        # everything that can fail on bad input fails before the model loads
        if acc.gradient_accumulation_steps != accumulation:
            raise ConfigError(f"the launch config sets gradient_accumulation_steps={acc.gradient_accumulation_steps}; "
                              f"remove it: the trainer accumulates each minibatch over its {accumulation} loss terms")
        self.dist = Distributed(acc, t)
        self.dist.check_backend(accumulation, t)
        self.lock = RunLock(self.out)  # this run owns output_dir until it ends (flowalign/run_folder.py)
        try:
            self._set_up(config, objective_cls, reward, train_prompts, eval_prompts, adapter, callbacks)
        except BaseException:
            self.lock.release()
            raise

    def _set_up(self, config, objective_cls, reward, train_prompts, eval_prompts, adapter, callbacks) -> None:
        t, acc = config.train, self.accelerator
        failed = None
        if acc.is_main_process:
            try:
                self.lock.acquire()
                if config.overwrite and not config.resume:
                    clear_outputs(self.out)
            except ConfigError as error:
                failed = error
        if self.dist.any(failed is not None):
            raise failed or ConfigError(f"output_dir: {self.out} is in use by another run")
        self.train_specs = load_prompts(config.data.train_prompts if train_prompts is None else train_prompts)
        self.eval_specs = load_prompts(config.data.eval_prompts if eval_prompts is None else eval_prompts)
        r = config.reward  # each call with a deadline and an error policy (flowalign/faults.py)
        reward = built_reward(r.name, r.kwargs) if reward is None else as_reward(reward)
        self.reward = RewardGuard(reward, r.name, r.timeout_s, r.on_error, r.weights)
        log.info("%s", self.reward.describe())
        self.extra_rewards = [RewardGuard(built_reward(name, {}), name, None, "raise", inline=True)
                              for name in config.eval.extra_rewards]
        check_reward_components(config, self.reward)
        check_modality(config, self.reward, self.extra_rewards)

        built = build_model(config, acc, objective_cls, adapter)
        self.adapter, self.encode, self.params = built.adapter, built.encode, built.params
        self.model, self.optimizer = built.model, built.optimizer
        self.ema = EMA(self.params, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
        ctx = Context(config, self.adapter, self.model, self.params, self.dist)
        self.sampler = EpochSampler(config, self.adapter, self.encode, self.reward, self.dist, self.train_specs)
        self.objective, self.hooks = experimental.attach(config, ctx, objective_cls, self.encode, self.sampler)
        self.advantages = Advantages(config, self.dist)
        self.evaluator = Evaluator(config, self.adapter, self.encode, self.reward, self.extra_rewards, self.dist,
                                   self.model, self.eval_specs, self.out)
        self.evaluator.ema, self.evaluator.rollout = self.ema, self.objective.rollout
        self.checkpointer = self._checkpointer()
        self.checkpointer.settings = settings(config)
        self.epoch = 0
        self.resumed_seconds, self.session_start = 0.0, time.time()  # train time before this session; its start
        self.history: list[dict] = []
        self.evals: dict[str, dict] = {}
        self.callbacks = [TrackerLogging(), HubPush(), *callbacks]  # flowalign/callbacks.py: the built-ins, then yours

    def _checkpointer(self) -> Checkpointer:
        """Every stateful component under its name (flowalign/checkpoint.py)."""
        ckpt = Checkpointer(self.out, self.dist, self.adapter, self.model, self.config.checkpoints_kept)
        ckpt.register("optimizer", self.optimizer, per_process=self.dist.sharded)
        if self.ema is not None:
            ckpt.register("ema", self.ema)
        for owner in (self.objective, *self.hooks):
            for name, component in owner.components().items():
                ckpt.register(name, component)
        ckpt.register_shards("rng", self.dist)
        if self.advantages.trackers is not None:
            ckpt.register_shards("tracker", self.advantages, fmt="json")
        ckpt.weights_swap = functools.partial(maybe_swapped_in, self.ema)  # no cycle back to the trainer
        return ckpt

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        """The whole run. SIGTERM / SIGINT at any time during it stop the run after the epoch in
        progress with a checkpoint (during the last epoch: the run just finishes)."""
        try:
            return self._train()
        finally:
            self.lock.release()

    def _train(self) -> dict:
        cfg, acc = self.config, self.accelerator
        self.sampler.prepare(self.objective.rollout)  # e.g. pre-generated groups: read (and checked) first
        with GracefulStop() as stop:
            if cfg.resume:
                self.resume(cfg.resume)
            if acc.is_main_process:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            init_trackers(acc, cfg, flat(to_dict(cfg)))  # flowalign/outputs.py: TensorBoard, or W&B's wandb: section
            log.info("determinism: %s (the same seed and these give the same numbers)",
                     ", ".join(f"{k} {v}" for k, v in run_environment().items()))
            if cfg.sampling.autocast != "none":
                log.info("sampling.autocast %s: rollout steps without a trained log-prob run at %s", cfg.sampling.autocast,
                         resolved_autocast(cfg.sampling.autocast, self.adapter.device))
            if "before" not in self.evals:
                self.evals["before"] = self.evaluate("before")
            start = self.session_start = time.time()
            nan_streak = NanEpochStreak(cfg.train.max_nan_epochs, cfg.reward.name)
            bar = tqdm(range(self.epoch, cfg.train.epochs), desc="epochs", disable=not acc.is_main_process,
                       initial=self.epoch, total=cfg.train.epochs)
            for epoch in bar:
                stats = self.train_epoch()
                self.epoch = epoch + 1
                self.history.append(stats)
                fire(self.callbacks, "on_epoch_end", self, self.epoch, stats)  # the trackers, then yours
                nan_streak.observe(stats, self.epoch)  # a reward NaN for every sample, epoch after epoch: stop
                bar.set_postfix(reward=f"{stats['reward/mean']:.3f}",  # and what the objective names (e.g. clipfrac)
                                **{k: f"{stats.get('train/' + k, 0):.2f}" for k in self.objective.progress})
                if self.dist.any(self._budget_spent()):
                    bar.close()
                    break
                if cfg.eval.every and self.epoch % cfg.eval.every == 0 and self.epoch < cfg.train.epochs:
                    self.evals[f"epoch-{self.epoch}"] = self.evaluate(f"epoch-{self.epoch}")
                saved = None
                if cfg.checkpoint_every and self.epoch % cfg.checkpoint_every == 0:
                    saved = self.save_checkpoint()
                    fire(self.callbacks, "on_checkpoint", self, self.epoch, saved)  # hub.strategy checkpoint: a push
                # every process stops at the same epoch, whichever of them got the signal
                if self.epoch < cfg.train.epochs and self.dist.any(stop.requested is not None):
                    bar.close()
                    return self._stopped(stop.requested or "a signal to another process",
                                         saved or self.save_checkpoint())
            nan_streak.finish()  # every epoch's every reward NaN: nothing was trained, not a finished run
            self.evals["after"] = self.evaluate("after")
            if self.ema is not None and (warning := short_run_warning(self.ema)) and acc.is_main_process:
                log.warning("%s", warning)
            self.save_checkpoint()
            with outputs_disk_full(self.out):
                summary = self._write_outputs(self.resumed_seconds + time.time() - start)
            fire(self.callbacks, "on_train_end", self, summary)  # hub.repo: final/ as `flowalign push` uploads it
        acc.end_training()
        return summary

    def train_epoch(self) -> dict:
        """sample → score → advantages → (hooks) → update → end-epoch."""
        t0, cpu0 = time.time(), time.process_time()
        t = self.config.train  # the schedule is a pure function of the epoch (flowalign/lr_schedule.py)
        factor = lr_factor(t.lr_schedule, self.epoch, t.warmup_epochs, t.epochs)
        for group in self.optimizer.param_groups:
            group["lr"] = t.learning_rate * factor
        with self.dist.full_params(self.model), self.objective.sampling_weights():
            batch = self.sample_epoch()
        fire(self.callbacks, "on_rollouts", self, self.epoch, batch)  # e.g. the captioned samples to the tracker
        advantages, stats = self.compute_advantages(batch)
        for hook in self.hooks:  # before the generator moves: its rollouts are the hook's on-policy data
            stats.update(hook.before_update(batch))
        stats.update(self.update_policy(batch, advantages))
        stats.update(self.objective.end_epoch(batch, self.epoch))
        stats["time/epoch_s"] = time.time() - t0
        stats["time/epoch_cpu_s"] = time.process_time() - cpu0
        stats["time/samples_per_s"] = len(batch.specs) * self.accelerator.num_processes / stats["time/epoch_s"]
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        return stats

    def sample_epoch(self) -> EpochBatch:
        """This process's samples of the epoch, scored (flowalign/epoch_sampler.py)."""
        objective, config = self.objective, self.config
        return self.sampler.sample(self.epoch, objective.rollout, objective.tree_shape(config),
                                   keep_uncond=objective.keeps_uncond(config))

    def compute_advantages(self, batch: EpochBatch) -> tuple[torch.Tensor, dict]:
        """This process's advantages [B] or [B, C] (NaN: does not train) and the reward statistics."""
        return self.advantages(batch)

    def update_policy(self, batch: EpochBatch, advantages: torch.Tensor) -> dict:
        """Inner epochs over shuffled minibatches; one optimizer step per minibatch, gradients
        accumulated over the objective's loss terms (each weighted 1 / number of terms). Samples
        with a NaN advantage get no gradient. A step whose loss or gradient is not finite on any
        process is skipped on every process (weights, optimizer state and EMA untouched) and
        counted in ``train/skipped_nonfinite``; the other stats average the steps taken."""
        acc, t, objective = self.accelerator, self.config.train, self.objective
        device = acc.device
        valid = torch.isfinite(advantages).to(device)
        valid = valid.all(dim=1) if valid.ndim == 2 else valid
        advantages = torch.nan_to_num(advantages, nan=0.0).to(device)
        terms = objective.terms(batch)
        if len(terms) != acc.gradient_accumulation_steps:  # the accumulation must close on each minibatch's last term
            raise RuntimeError(f"{len(terms)} loss terms, Accelerate accumulates {acc.gradient_accumulation_steps}")
        if not self.dist.any(bool(valid.any())):  # every sample dropped: nothing to learn
            return {"train/skipped": 1.0, "train/skipped_nonfinite": 0.0}
        totals: dict[str, float] = {}
        count, skipped = 0, 0
        self.model.train()
        for _ in range(t.inner_epochs):
            objective.begin_update(batch)
            for idx in self.dist.minibatches(len(batch.specs), objective.unit):
                # the terms' losses and stats stay on the device until the step is closed: one host sync
                # per optimizer step instead of one per value (the sums below: the same, in the same order)
                losses, recorded = [], []
                mb = Minibatch.of(batch, idx, advantages, valid)
                for term in terms:
                    with acc.accumulate(self.model), acc.autocast():
                        loss, term_stats = objective.loss(mb, term)
                        acc.backward(loss)  # Accelerate divides by the number of terms accumulated
                    losses.append(loss.detach())
                    recorded += term_stats.items()
                grad_norm = acc.clip_grad_norm_(self.dist.clip_parameters(self.model, self.params), t.max_grad_norm)
                finite = bool(torch.isfinite(torch.stack(losses)).all())
                finite &= grad_norm is None or bool(torch.isfinite(torch.as_tensor(grad_norm)))  # None: DeepSpeed
                step_totals: dict[str, float] = {}
                if recorded:
                    values = torch.stack([torch.as_tensor(v).detach().to(device, torch.float64).reshape(())
                                          for _, v in recorded]).tolist()
                    for (key, _), value in zip(recorded, values):
                        step_totals[key] = step_totals.get(key, 0.0) + value
                if self.dist.any(not finite):
                    skipped += 1
                    if acc.scaler is not None:
                        self.optimizer.step()  # fp16: the GradScaler skips it itself and lowers its scale
                else:
                    self.optimizer.step()
                    objective.after_step()
                    if self.ema is not None:
                        self.ema.update()
                    if grad_norm is not None:
                        step_totals["grad_norm"] = float(grad_norm) * len(terms)
                    for key, value in step_totals.items():
                        totals[key] = totals.get(key, 0.0) + value
                    count += len(terms)
                self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        stats = {f"train/{k}": v / max(count, 1) for k, v in sorted(totals.items())}
        stats["train/skipped_nonfinite"] = float(skipped)
        means = self.dist.across_processes(list(stats.values())).mean(dim=0).tolist()  # same keys on every process
        return dict(zip(stats, means))

    def evaluate(self, label: str) -> dict:
        """The held-out evaluation (flowalign/evaluator.py) with the evaluated weights (EMA if on)."""
        result = self.evaluator.evaluate(label, self.epoch, self._train_seconds())
        fire(self.callbacks, "on_evaluate", self, label, self.epoch, result, self.evaluator.grids.get(label),
             self.evaluator.rewards.get(label, {}))
        return result

    def _train_seconds(self, clock: str = "time/epoch_s") -> float:
        return sum(h.get(clock, 0.0) for h in self.history)

    def _budget_spent(self) -> bool:
        """``train.max_minutes`` of wall-clock or ``train.max_cpu_minutes`` of this process's CPU time reached."""
        t = self.config.train
        return ((t.max_minutes is not None and self._train_seconds() / 60 >= t.max_minutes)
                or (t.max_cpu_minutes is not None and self._train_seconds("time/epoch_cpu_s") / 60 >= t.max_cpu_minutes))

    def _stopped(self, signal_name: str, checkpoint: Path) -> dict:
        """The summary of a run stopped by a signal: no final eval, no ``final/`` (the run is not done)."""
        acc = self.accelerator
        log.info("stopped by %s after epoch %d/%d; checkpoint %s; continue with resume=auto", signal_name,
                 self.epoch, self.config.train.epochs, checkpoint)
        acc.end_training()
        return {"interrupted": signal_name, "checkpoint": str(checkpoint), "epochs": self.epoch,
                "before": self.evals.get("before"), "after": None, "evals": self.evals}

    # -- checkpoints (flowalign/checkpoint.py) ----------------------------------------------
    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.epoch, {"epoch": self.epoch, "history": self.history, "evals": self.evals,
                                                   "elapsed_s": self.resumed_seconds + time.time() - self.session_start})

    def resume(self, resume: str) -> None:
        counters = self.checkpointer.resume(resume)
        if counters is not None:
            self._restore(counters)

    def _restore(self, counters: dict) -> None:
        self.epoch, self.history, self.evals = counters["epoch"], counters["history"], counters["evals"]
        self.resumed_seconds = counters.get("elapsed_s", self._train_seconds())  # older checkpoints: the epochs'

    # -- outputs -------------------------------------------------------------------------
    def _write_outputs(self, seconds: float) -> dict:
        acc = self.accelerator
        summary = {"before": self.evals.get("before"), "after": self.evals.get("after"),
                   "evals": self.evals, "train_minutes": seconds / 60, "epochs": self.epoch,
                   "environment": {**run_environment(), "processes": acc.num_processes,
                                   "sampling_precision": resolved_autocast(self.config.sampling.autocast,
                                                                           self.adapter.device)}}
        with self.dist.full_params(self.model):
            if acc.is_main_process:
                with maybe_swapped_in(self.ema):
                    self.adapter.save_trained(self.out / "final")
                for hook in self.hooks:
                    hook.write_outputs(self.out)
            acc.wait_for_everyone()
        if acc.is_main_process:
            before, after = summary["before"], summary["after"]
            if before and after:
                summary["delta"] = {k: after[k] - before[k] for k in after
                                    if isinstance(after[k], float) and isinstance(before.get(k), float)}
            self.evaluator.save_before_after()
            write_hub_files(self.out, self.config, summary)  # final/README.md, the model card (flowalign/outputs.py)
            (self.out / "metrics.json").write_text(json.dumps(finite_json(summary), indent=2))  # NaN → null
            with open(self.out / "history.jsonl", "w") as f:
                f.writelines(json.dumps(finite_json(h)) + "\n" for h in self.history)
        return summary


# CPU extensions that change which matrix kernels oneDNN/MKL pick inside one torch "capability"
# (AVX512 with or without AMX, BF16 or FP16 units): the same code differs in the last bits across them
NUMERIC_CPU_EXTENSIONS = ("amx_bf16", "amx_fp16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_fp16",
                          "avx512_vnni", "avx_vnni")


def cpu_extensions() -> str:
    """The :data:`NUMERIC_CPU_EXTENSIONS` this CPU has, comma-separated ("" where none, or where
    /proc/cpuinfo is not readable: off Linux the comparison rests on ``cpu_capability``)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    return ",".join(sorted(set(flags) & set(NUMERIC_CPU_EXTENSIONS)))


def run_environment() -> dict:
    """What a run's numbers depend on besides its config and seed: torch's CPU threads (the split
    of floating-point sums), torch's version, the instruction set its CPU kernels use and the
    CPU's numeric extensions (which kernels the math libraries pick within that instruction set)."""
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_extensions": cpu_extensions()}


def train(config: RunConfig) -> dict:
    """``Trainer(config).train()``; the Python API with objects for names: ``flowalign.train`` (flowalign/api.py)."""
    return Trainer(config).train()
