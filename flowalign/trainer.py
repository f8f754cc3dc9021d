"""The training loop: the only place that knows the order of rollout → rewards → advantages →
updates, and Accelerate, checkpoints and logging (``../shared/DESIGN.md``).

Randomness: one seed per run. Each process owns generators for prompt choice, initial noise / SDE
noise and minibatch shuffling, seeded by (seed, rank); the step plan uses a generator shared by
all processes, so every process trains the same steps. All generator states go into checkpoints,
so a resumed run continues the same streams and reproduces the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from flowalign.advantages import PerPromptStatTracker, combine_rewards, group_advantages
from flowalign.config import ConfigError, RunConfig, check_values, to_dict
from flowalign.grids import save_grid, side_by_side, to_pil_grid
from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.prompts import load_prompts
from flowalign.rollout import Trajectory, group_noise, rollout, sde_transition
from flowalign.samplers.steps import StepPlan, plan_steps
from pipelines import adapter_class
from reward_models.base import build_reward

EVAL_SEED = 20_241_202  # the held-out evaluation always uses the same noise: before/after are paired


class EMA:
    """Exponential moving average of parameters; ``swapped_in`` evaluates with the average."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for v, p in zip(saved, self.params):
                    p.copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"shadow.{i}": s for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])


@dataclass
class EpochBatch:
    """One epoch's rollouts on this process. traj: B samples; specs: B prompt records;
    rewards [B] (NaN = dropped); components: {name: [B]}; group_ids [B] (global over processes)."""

    traj: Trajectory
    specs: list[dict]
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    group_ids: torch.Tensor


class Trainer:
    """``Trainer(config).train()`` runs a whole experiment; ``history`` holds one dict per epoch."""

    def __init__(self, config: RunConfig):
        check_values(config)
        self.config = config
        t = config.train
        self.out = Path(config.output_dir)
        self.accelerator = Accelerator(
            mixed_precision=t.mixed_precision, project_dir=str(self.out),
            log_with=None if config.tracker == "none" else config.tracker)
        acc = self.accelerator
        # everything that can fail on bad input fails before the model loads
        self.train_specs = load_prompts(config.data.train_prompts)
        self.prompt_weights = prompt_weights(self.train_specs, config.data.balance_tags)
        self.eval_specs = load_prompts(config.data.eval_prompts)
        self.reward = build_reward(config.reward.name, **config.reward.kwargs)
        declared = getattr(self.reward, "components", ())
        unknown = sorted(set(config.reward.weights) - set(declared)) if declared else []
        if unknown:
            raise ConfigError(f"config: reward.weights names {unknown}, but reward {config.reward.name!r} "
                              f"returns {list(declared)}")

        m = config.model
        self.adapter = adapter_class(m.family).from_pretrained(
            m.path, dtype=m.dtype, device=acc.device, height=m.height, width=m.width)
        if m.lora_rank > 0:
            with torch.random.fork_rng(devices=[]):  # the LoRA's random init is part of the run's seed
                torch.manual_seed(t.seed)
                self.adapter.add_lora(m.lora_rank, m.lora_alpha, m.lora_targets)
        else:
            self.adapter.enable_full_finetune(keep_reference=t.kl_beta > 0)
        if m.gradient_checkpointing:
            self.adapter.enable_gradient_checkpointing()
        if m.attention == "xformers":
            self.adapter.enable_xformers()
        self.params = [p for p in self.adapter.trainable().parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, betas=tuple(t.adam_betas),
                                      weight_decay=t.weight_decay)
        self.model, self.optimizer = acc.prepare(self.adapter.trainable(), optimizer)
        self.ema = EMA(self.params, t.ema_decay) if t.ema_decay > 0 else None
        self.tracker = PerPromptStatTracker(clip=t.advantage_clip) if t.per_prompt_stats else None

        seed, rank = t.seed, acc.process_index
        self.generators = {
            name: torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + offset)
            for offset, name in enumerate(("prompts", "noise", "shuffle"))
        }
        self.generators["plan"] = torch.Generator().manual_seed(seed * 1_000_003 + 104_729)  # shared by ranks
        self.epoch = 0
        self.history: list[dict] = []
        self.evals: dict[str, dict] = {}

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, acc = self.config, self.accelerator
        if cfg.resume:
            self.load_checkpoint(self._resolve_resume(cfg.resume))
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        if cfg.tracker != "none":
            acc.init_trackers(self.out.name or "flowalign", config=_flat(to_dict(cfg)))
        if "before" not in self.evals:
            self.evals["before"] = self.evaluate("before")
        start = time.time()
        bar = tqdm(range(self.epoch, cfg.train.epochs), desc="epochs", disable=not acc.is_main_process,
                   initial=self.epoch, total=cfg.train.epochs)
        for epoch in bar:
            stats = self.train_epoch()
            self.epoch = epoch + 1
            self.history.append(stats)
            acc.log(stats, step=self.epoch)
            bar.set_postfix(reward=f"{stats['reward/mean']:.3f}", clipfrac=f"{stats.get('train/clipfrac', 0):.2f}")
            if cfg.eval.every and self.epoch % cfg.eval.every == 0 and self.epoch < cfg.train.epochs:
                self.evals[f"epoch-{self.epoch}"] = self.evaluate(f"epoch-{self.epoch}")
            if cfg.checkpoint_every and self.epoch % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        self.evals["after"] = self.evaluate("after")
        self.save_checkpoint()
        summary = self._write_outputs(time.time() - start)
        acc.end_training()
        return summary

    def train_epoch(self) -> dict:
        t0 = time.time()
        warmup = self.config.train.warmup_epochs
        for group in self.optimizer.param_groups:  # linear warm-up, a pure function of the epoch
            group["lr"] = self.config.train.learning_rate * min(1.0, (self.epoch + 1) / (warmup + 1))
        batch = self.sample_epoch()
        advantages, stats = self.compute_advantages(batch)
        stats.update(self.update_policy(batch, advantages))
        stats["time/epoch_s"] = time.time() - t0
        stats["time/samples_per_s"] = len(batch.specs) * self.accelerator.num_processes / stats["time/epoch_s"]
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        return stats

    def sample_epoch(self) -> EpochBatch:
        """Draw this process's prompt groups, roll them out with the SDE, decode and reward them."""
        cfg, t, s = self.config, self.config.train, self.config.sampling
        g = self.generators
        picks = torch.multinomial(self.prompt_weights, t.groups_per_epoch, replacement=True,
                                  generator=g["prompts"]).tolist()
        first_group = self.accelerator.process_index * t.groups_per_epoch
        # group_id tells group-level rewards (Pref-GRPO win rates) which samples compete
        specs = [{**self.train_specs[i], "group_id": first_group + k} for k, i in enumerate(picks)
                 for _ in range(t.group_size)]
        n = len(specs)
        schedule = self.adapter.schedule(s.num_steps)
        plan = plan_steps(s.num_steps, n, s.eta, s.step_mode, fraction=s.fraction, window_size=s.window_size,
                          window_start=s.window_start, generator=g["plan"])
        unique = self.adapter.encode([self.train_specs[i]["prompt"] for i in picks])
        cond = unique.repeat_interleave(t.group_size)
        noise = group_noise(self.adapter, t.groups_per_epoch, t.group_size, g["noise"], s.shared_group_noise)
        self.adapter.model.eval()
        parts, scored = [], []
        # One worker thread scores chunk k (a remote call, a CPU verifier) while chunk k + 1 samples.
        with ThreadPoolExecutor(max_workers=1) as pool:
            for lo in range(0, n, t.sample_batch_size):
                sl = slice(lo, lo + t.sample_batch_size)
                part = rollout(self.adapter, cond[sl], noise[sl], schedule,
                               StepPlan(plan.noise_levels, plan.trained[sl]), guidance_scale=s.guidance_scale,
                               generator=g["noise"], reduction=s.log_prob_reduction)
                parts.append(part)
                images = self.adapter.decode(part.samples)
                scored.append(pool.submit(self._reward_chunk, images, specs[sl]) if t.async_reward
                              else _done(self._reward_chunk(images, specs[sl])))
            components = _cat_components([f.result() for f in scored])
        traj = Trajectory.cat(parts)
        rewards, _ = combine_rewards(components, cfg.reward.weights)
        group_ids = torch.tensor([spec["group_id"] for spec in specs])
        return EpochBatch(traj, specs, rewards, components, group_ids)

    @torch.no_grad()
    def _score(self, latents: torch.Tensor, specs: list[dict], chunk: int = 64) -> dict[str, torch.Tensor]:
        return _cat_components([self._reward_chunk(self.adapter.decode(latents[lo:lo + chunk]), specs[lo:lo + chunk])
                                for lo in range(0, len(specs), chunk)])

    def _reward_chunk(self, images: torch.Tensor, specs: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v, dtype=torch.float32).cpu()
                for k, v in self.reward(images, [p["prompt"] for p in specs], specs).items()}

    def compute_advantages(self, batch: EpochBatch) -> tuple[torch.Tensor, dict]:
        """Group-normalised advantages over every process's samples; returns this process's share."""
        acc, t = self.accelerator, self.config.train
        device = acc.device
        rewards = acc.gather(batch.rewards.to(device)).cpu()
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        stats = {}
        for name, values in batch.components.items():
            values = acc.gather(values.to(device)).cpu()
            ok = torch.isfinite(values)
            stats[f"reward/{name}"] = values[ok].mean().item() if ok.any() else float("nan")
        valid = torch.isfinite(rewards)
        stats["reward/mean"] = rewards[valid].mean().item() if valid.any() else float("nan")
        stats["reward/std"] = rewards[valid].std(unbiased=False).item() if valid.any() else float("nan")
        stats["reward/dropped_nan"] = int((~valid).sum())
        if self.tracker is not None:
            # per process: each prompt's history is kept where its samples are drawn
            local = self.tracker.update([spec["prompt"] for spec in batch.specs], batch.rewards)
        else:
            adv, adv_stats = group_advantages(rewards, group_ids, global_std=t.global_std, clip=t.advantage_clip)
            n = len(batch.specs)
            local = adv[acc.process_index * n:(acc.process_index + 1) * n]
            stats.update({f"adv/{k}": v for k, v in adv_stats.items()})
        stats["adv/abs_mean"] = local.abs().mean().item()
        return local, stats

    def update_policy(self, batch: EpochBatch, advantages: torch.Tensor) -> dict:
        """Inner epochs over shuffled minibatches; one optimizer step per minibatch, gradients
        accumulated over its trained steps (each step's loss weighted 1 / number of steps)."""
        acc, t = self.accelerator, self.config.train
        traj, device = batch.traj, acc.device
        valid = torch.isfinite(batch.rewards).to(device)
        advantages = advantages.to(device)
        steps = [j for j in range(len(traj.noise_levels)) if traj.noise_levels[j] > 0]
        n = len(batch.specs)
        totals: dict[str, float] = {}
        count = 0
        if not valid.any():  # every sample was dropped: nothing to learn from this epoch
            return {"train/skipped": 1.0}
        self.model.train()
        for _ in range(t.inner_epochs):
            order = torch.randperm(n, generator=self.generators["shuffle"]).to(device)
            for lo in range(0, n, t.train_batch_size):
                idx = order[lo:lo + t.train_batch_size]
                sub, adv = traj[idx], advantages[idx]
                for k, j in enumerate(steps):
                    sync = k == len(steps) - 1
                    with (contextlib.nullcontext() if sync else acc.no_sync(self.model)), acc.autocast():
                        loss, step_stats = self._step_loss(sub, j, adv, sub.trained[:, j] & valid[idx])
                        acc.backward(loss / len(steps))
                    for key, value in step_stats.items():
                        totals[key] = totals.get(key, 0.0) + float(value)
                    count += 1
                grad_norm = acc.clip_grad_norm_(self.params, t.max_grad_norm)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm) * len(steps)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.ema is not None:
                    self.ema.update()
        self.model.eval()
        return {f"train/{k}": v / max(count, 1) for k, v in totals.items()}

    def _step_loss(self, sub: Trajectory, j: int, adv: torch.Tensor, weight: torch.Tensor):
        t, s = self.config.train, self.config.sampling
        x, x_next = sub.latents[:, j], sub.latents[:, j + 1]
        eta = float(sub.noise_levels[j])
        args = (self.adapter, x, j, sub.sigmas, sub.timesteps, eta, sub.cond, s.guidance_scale)
        out = sde_transition(*args, prev_sample=x_next, reduction=s.log_prob_reduction, model=self.model)
        ref_mean = None
        if t.kl_beta > 0:
            with torch.no_grad(), self.adapter.reference():
                ref_mean = sde_transition(*args, prev_sample=x_next, reduction=s.log_prob_reduction).mean
        return flow_grpo_loss(out.log_prob, sub.log_probs[:, j], adv, clip_range=t.clip_range, beta=t.kl_beta,
                              mean=out.mean, ref_mean=ref_mean, std=out.std, weight=weight,
                              reduction=s.log_prob_reduction)

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, label: str) -> dict:
        """ODE sampling (η = 0) of every held-out prompt × ``eval.seeds`` with fixed noise; reward
        components overall and per category (the "tag" of GenEval-style records)."""
        acc = self.accelerator
        result: dict = {}
        if acc.is_main_process:
            with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                result = self._evaluate_main(label)
            tqdm.write(f"eval {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items() if isinstance(v, float)))
            acc.log({f"eval/{k}": v for k, v in _flat(result).items() if isinstance(v, (int, float))},
                    step=self.epoch)
        acc.wait_for_everyone()
        return result

    def _evaluate_main(self, label: str) -> dict:
        e, s = self.config.eval, self.config.sampling
        specs = [spec for spec in self.eval_specs for _ in range(e.seeds)]
        generator = torch.Generator().manual_seed(EVAL_SEED)
        noise = self.adapter.initial_noise(len(specs), generator)
        schedule = self.adapter.schedule(s.num_steps)
        self.adapter.model.eval()
        latents = []
        for lo in range(0, len(specs), e.batch_size):
            sub = specs[lo:lo + e.batch_size]
            plan = plan_steps(s.num_steps, len(sub), 0.0)
            traj = rollout(self.adapter, self.adapter.encode([p["prompt"] for p in sub]), noise[lo:lo + len(sub)],
                           schedule, plan, guidance_scale=s.guidance_scale)
            latents.append(traj.samples)
        latents = torch.cat(latents)
        components = self._score(latents, specs)
        result = {"epoch": self.epoch, "samples": len(specs)}
        for name, values in components.items():
            result[name] = _nanmean(values)
            tags = sorted({spec.get("tag") for spec in specs if spec.get("tag")})
            if tags:
                per = {tag: _nanmean(values[[sp.get("tag") == tag for sp in specs]]) for tag in tags}
                result[f"{name}_by_category"] = per
                result[f"{name}_category_mean"] = sum(per.values()) / len(per)
        self._eval_grid(label, latents, specs)
        return result

    def _eval_grid(self, label: str, latents: torch.Tensor, specs: list[dict]) -> None:
        """Rows: ``grid_prompts`` held-out prompts spread over the set; columns: the first seeds."""
        e = self.config.eval
        n_prompts, n_seeds = min(e.grid_prompts, len(self.eval_specs)), min(e.grid_seeds, e.seeds)
        rows = [round(i * (len(self.eval_specs) - 1) / max(n_prompts - 1, 1)) for i in range(n_prompts)]
        idx = [r * e.seeds + c for r in rows for c in range(n_seeds)]
        images = self.adapter.decode(latents[idx])
        grid = to_pil_grid(images, n_prompts, n_seeds)
        self._grids = getattr(self, "_grids", {})
        self._grids[label] = grid
        save_grid(grid, self.out / "grids" / f"{label}.png", [self.eval_specs[r]["prompt"] for r in rows])

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """``checkpoints/epoch-NNNNNN/``: trained weights (safetensors), optimizer, EMA, every
        generator state and the counters, plus ``policy/`` (the evaluated weights, EMA if used, in
        the format of ``final/``); written to a temporary folder, then renamed."""
        acc = self.accelerator
        final = self.out / "checkpoints" / f"epoch-{self.epoch:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        save_file({f"{k}": v.get_state() for k, v in self.generators.items()},
                  tmp / f"rng-rank{acc.process_index}.safetensors")
        if acc.is_main_process:
            save_file({k: v.detach().cpu().contiguous() for k, v in self.adapter.trained_state_dict().items()},
                      tmp / "trained.safetensors")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            if self.ema is not None:
                save_file(self.ema.state_dict(), tmp / "ema.safetensors")
            with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                self.adapter.save_trained(tmp / "policy")  # what grid/eval load, like final/
            state = {"epoch": self.epoch, "history": self.history, "evals": self.evals,
                     "num_processes": acc.num_processes,
                     "stat_tracker": self.tracker.state_dict() if self.tracker else None}
            (tmp / "state.json").write_text(json.dumps(state))
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune_checkpoints()
        acc.wait_for_everyone()
        return final

    def _prune_checkpoints(self) -> None:
        kept = self.config.checkpoints_kept
        done = sorted(p for p in (self.out / "checkpoints").glob("epoch-*") if not p.name.endswith(".tmp"))
        for old in done[:-kept] if kept > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def _resolve_resume(self, resume: str) -> Path:
        if resume != "auto":
            path = Path(resume)
            if not (path / "state.json").is_file():
                raise FileNotFoundError(f"no checkpoint at {path.resolve()} (expected state.json inside)")
            return path
        done = sorted(p for p in (self.out / "checkpoints").glob("epoch-*") if not p.name.endswith(".tmp"))
        return done[-1] if done else None

    def load_checkpoint(self, path: Path | None) -> None:
        if path is None:  # resume=auto with nothing saved yet: a fresh start
            return
        acc = self.accelerator
        state = json.loads((path / "state.json").read_text())
        if state["num_processes"] != acc.num_processes:
            raise ValueError(f"{path} was written by {state['num_processes']} processes; resume with the same "
                             f"number (got {acc.num_processes}) so every random stream continues")
        self.adapter.load_trained_state_dict(load_file(path / "trained.safetensors", device=str(acc.device)))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=acc.device))
        if self.ema is not None:
            self.ema.load_state_dict(load_file(path / "ema.safetensors", device=str(acc.device)))
        for k, v in load_file(path / f"rng-rank{acc.process_index}.safetensors").items():
            self.generators[k].set_state(v)
        if self.tracker is not None and state["stat_tracker"] is not None:
            self.tracker.load_state_dict(state["stat_tracker"])
        self.epoch, self.history, self.evals = state["epoch"], state["history"], state["evals"]

    # -- outputs -------------------------------------------------------------------------
    def _write_outputs(self, seconds: float) -> dict:
        acc = self.accelerator
        summary = {"before": self.evals.get("before"), "after": self.evals.get("after"),
                   "evals": self.evals, "train_minutes": seconds / 60, "epochs": self.epoch}
        if acc.is_main_process:
            with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                self.adapter.save_trained(self.out / "final")
            before, after = summary["before"], summary["after"]
            if before and after:
                summary["delta"] = {k: after[k] - before[k] for k in after
                                    if isinstance(after[k], float) and isinstance(before.get(k), float)}
            grids = getattr(self, "_grids", {})
            if "before" in grids and "after" in grids:
                side_by_side({"before": grids["before"], "after": grids["after"]}).save(
                    self.out / "grids" / "before_after.png")
            (self.out / "metrics.json").write_text(json.dumps(summary, indent=2))
            with open(self.out / "history.jsonl", "w") as f:
                f.writelines(json.dumps(h) + "\n" for h in self.history)
        return summary


def _cat_components(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def prompt_weights(specs: list[dict], balance_tags: bool) -> torch.Tensor:
    """Sampling weights [N] of the training prompts: uniform, or (``balance_tags``) uniform over
    the records' "tag" (GenEval category) first, then over the prompts within it."""
    if not balance_tags:
        return torch.ones(len(specs))
    tags = [spec.get("tag") for spec in specs]
    counts = {tag: tags.count(tag) for tag in set(tags)}
    return torch.tensor([1.0 / counts[tag] for tag in tags])


def _nanmean(values: torch.Tensor) -> float:
    ok = torch.isfinite(values)
    return values[ok].mean().item() if ok.any() else float("nan")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


def train(config: RunConfig) -> dict:
    return Trainer(config).train()
