"""The training loop: the only place that knows the order of rollout → rewards → advantages →
updates, and Accelerate, checkpoints and logging (``../shared/DESIGN.md``).

Randomness: one seed per run. The global batch is drawn as ``train.rng_shards`` shards (default:
one per process); each shard owns generators for prompt choice, initial noise / SDE noise and
minibatch shuffling, seeded by (seed, shard), and a process rolls out its shards one after
another. The step plan uses a generator shared by all processes, so every process trains the same
steps. One process with S shards thus samples what S processes sample (tests/test_distributed.py).
All generator states go into checkpoints, so a resumed run continues the same streams and
reproduces the uninterrupted run.

Masked discrete diffusion (adapters with ``prediction == "logits"``: the chess family) takes a
small branch of the same loop: a rollout is ``flowalign.samplers.unmasking.rollout`` (its
``MaskedTrajectory`` keeps the conditioning; the unmasking plan and the categorical draws come
from the shard's noise stream), the decoded samples are FEN strings, every step that unmasks
positions is trained with ``objectives.masked_ddpo.masked_ddpo_loss`` (clipped ratio, KL to the
LoRA-disabled reference, entropy bonus) and the method is ``ddpo``. Evaluation samples with a
fixed generator, reports board diversity and draws the boards.

Faults (docs/distributed.md, docs/faults.md): SIGTERM / SIGINT stop the run after the epoch in
progress, with a checkpoint; a checkpoint is written to ``epoch-N.tmp/``, renamed when complete,
lists its files' sizes and SHA-256, and is read and checked whole before any of it is applied; an
optimizer step whose loss or gradient is not finite is skipped on every process and counted; a
full disk is named as such; the reward's failures are handled by ``flowalign.faults``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from flowalign.advantages import PerPromptStatTracker, combine_rewards, extremes_mask, group_advantages
from flowalign.config import ConfigError, RunConfig, to_dict
from flowalign.evaluation import paired_change
from flowalign.faults import NanEpochStreak, RewardGuard, finite_json
from flowalign.grids import as_image_cells, load_grids, save_grid, side_by_side, to_pil_grid, with_inputs
from flowalign.integrity import folder_sha256, sha256_mismatch
from flowalign.objectives.av_routing import (RewardRouter, branch_advantages, branch_contrasts, interaction_gram,
                                             layer_gradient_scales, routed_nft_loss, token_weights)
from flowalign.objectives.diffusion_nft import diffusion_nft_loss, old_policy_decay, optimality_probability
from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.objectives.gdro import gdro_loss
from flowalign.objectives.masked_ddpo import leave_one_out_advantages, masked_ddpo_loss
from flowalign.prompts import load_prompts
from flowalign.rollout import Trajectory, group_noise, rollout, transition
from flowalign.samplers.unmasking import MaskedTrajectory
from flowalign.samplers.steps import StepPlan, plan_steps, sliding_window_start
from flowalign.preflight import check_method_family, validate
from pipelines import adapter_class, load_adapter
from pipelines.base import PromptEmbeddingCache, encode_records
from pipelines.joint import BRANCHES
from reward_models.base import build_reward

EVAL_SEED = 20_241_202  # the held-out evaluation always uses the same noise: before/after are paired
CHECKPOINT_NAME = re.compile(r"epoch-(\d+)")  # complete checkpoints only: not *.tmp (being written), *.old (going)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the file."""


class DiskFullError(CheckpointError):
    """The disk (or the quota) filled up while a checkpoint was written; the previous one is untouched."""


class GracefulStop:
    """While active, the first SIGTERM or SIGINT only sets ``requested`` (the signal's name): the
    loop finishes its epoch, checkpoints and returns. The old handlers come back at once, so a
    second signal acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM terminates). Handlers can
    only be installed from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        self._restore()
        print(f"flowalign: {self.requested} received: stopping after this epoch with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


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

    traj: Trajectory | MaskedTrajectory
    specs: list[dict]
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    group_ids: torch.Tensor


class Trainer:
    """``Trainer(config).train()`` runs a whole experiment; ``history`` holds one dict per epoch."""

    def __init__(self, config: RunConfig):
        validate(config)  # every check that needs no weights (flowalign/preflight.py: also `train --dry-run`)
        if config.threads:  # before any tensor work: a run's numbers depend on its thread count
            torch.set_num_threads(config.threads)
        self.config = config
        t, s = config.train, config.sampling
        self.out = Path(config.output_dir)
        self.nft, self.gdro = config.method == "diffusion_nft", config.method == "gdro"
        self.forward_process = self.nft or self.gdro  # trained on noised copies of final samples
        self.offline: dict | None = None  # GDRO's pre-generated groups, read when training starts
        # masked discrete diffusion (chess): known from the family's class, before any model loads
        self.discrete = _family_prediction(config.model.family) == "logits"
        if self.discrete:
            self.masked_steps = masked_trained_steps(s.num_steps, s.unmask_schedule)
        # backward passes per optimizer step: one per trained step of the rollout, or per noising
        # draw for DiffusionNFT and GDRO (Accelerate's gradient accumulation, so DDP syncs and DeepSpeed
        # steps once, on the last of them)
        if self.discrete:
            accumulation = len(self.masked_steps)
        else:
            accumulation = t.noise_draws if self.forward_process else int((plan_steps(
                s.num_steps, 1, s.eta, s.step_mode, fraction=s.fraction, window_size=s.window_size,
                window_start=s.window_start, generator=torch.Generator()).noise_levels > 0).sum())
        self.accelerator = Accelerator(
            mixed_precision=t.mixed_precision, project_dir=str(self.out), gradient_accumulation_steps=accumulation,
            log_with=None if config.tracker == "none" else config.tracker)
        acc = self.accelerator
        # everything that can fail on bad input fails before the model loads
        if acc.gradient_accumulation_steps != accumulation:
            raise ConfigError(f"the launch config sets gradient_accumulation_steps={acc.gradient_accumulation_steps}; "
                              f"remove it: the trainer accumulates each minibatch over its {accumulation} trained "
                              "steps")
        self.shards = local_shards(t.rng_shards or acc.num_processes, acc.num_processes, acc.process_index,
                                   t.groups_per_epoch, t.train_batch_size)
        self._check_backend(accumulation)
        self.train_specs = load_prompts(config.data.train_prompts)
        self.prompt_weights = prompt_weights(self.train_specs, config.data.balance_tags)
        self.eval_specs = load_prompts(config.data.eval_prompts)
        r = config.reward  # each call with a deadline and an error policy (flowalign/faults.py)
        self.reward = RewardGuard(build_reward(r.name, **r.kwargs), r.name, r.timeout_s, r.on_error, r.weights)
        self.extra_rewards = [build_reward(name) for name in config.eval.extra_rewards]
        declared = getattr(self.reward, "components", ())
        unknown = sorted(set(config.reward.weights) - set(declared)) if declared else []
        if unknown:
            raise ConfigError(f"config: reward.weights names {unknown}, but reward {config.reward.name!r} "
                              f"returns {list(declared)}")

        m = config.model
        self._check_modality()
        # attention is set here, before the LoRA and any frozen reference copy; num_frames only when set
        self.adapter = load_adapter(m.family, m.path, dtype=m.dtype, device=acc.device, height=m.height,
                                    width=m.width, num_frames=m.num_frames, attention=m.attention, options=m.kwargs)
        check_method_family(config.method, m.family, getattr(self.adapter, "prediction", "velocity"))
        if getattr(self.adapter, "ode_only", False) and (config.method != "diffusion_nft" or config.sampling.eta > 0):
            raise ConfigError(f"config: this {m.family} model samples video-first (its pipeline's sampling_order), "
                              f"which only DiffusionNFT with ODE rollouts trains (sampling.eta: 0); got method "
                              f"{config.method!r}, sampling.eta {config.sampling.eta}: use method: diffusion_nft "
                              f"with sampling.eta=0, or a model with sampling_order joint")
        self.encode = PromptEmbeddingCache(self.adapter, m.prompt_cache_size, offload=m.offload_text_encoders) \
            if m.prompt_cache_size else self.adapter.encode
        if m.lora_rank > 0:
            with torch.random.fork_rng(devices=[]):  # the LoRA's random init is part of the run's seed
                torch.manual_seed(t.seed)
                self.adapter.add_lora(m.lora_rank, m.lora_alpha, m.lora_targets)
        else:
            self.adapter.enable_full_finetune(keep_reference=t.kl_beta > 0)
        if m.gradient_checkpointing:
            self.adapter.enable_gradient_checkpointing()
        self.params = [p for p in self.adapter.trainable().parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, betas=tuple(t.adam_betas),
                                      weight_decay=t.weight_decay)
        self.model, self.optimizer = acc.prepare(self.adapter.trainable(), optimizer)
        self.ema = EMA(self.params, t.ema_decay) if t.ema_decay > 0 else None
        # DiffusionNFT's old policy: samples the rollouts and anchors v⁺ / v⁻; its decay ramps per epoch
        self.old = EMA(self.params, 0.0) if self.nft else None
        self.router = self._build_router()
        # per shard, like the streams: a prompt's reward history is kept where its samples are drawn
        self.trackers = [PerPromptStatTracker(clip=t.advantage_clip) for _ in self.shards] if t.per_prompt_stats \
            else None
        self.streams = [shard_generators(t.seed, shard) for shard in self.shards]
        self.plan_generator = torch.Generator().manual_seed(t.seed * 1_000_003 + 104_729)  # shared by processes
        self.epoch = 0
        self.resumed_seconds, self.session_start = 0.0, time.time()  # train_minutes before this session; its start
        self.history: list[dict] = []
        self.evals: dict[str, dict] = {}
        self.explorer, self.explorer_optimizer = self._build_explorer()

    def _build_explorer(self):
        """EXPLORENET and its optimizer when ``explore.mode`` is on (same initial weights on every
        process: seeded by the run's seed; its gradients are averaged over processes)."""
        e, s = self.config.explore, self.config.sampling
        if e.mode == "none":
            return None, None
        from flowalign.explorenet import ExploreNet

        if getattr(self.adapter, "prediction", "velocity") != "velocity":
            raise ConfigError("config: explore.mode needs a flow model (its SDE steps); DDIM has no exploration net")
        shape = self.adapter.initial_noise(1, torch.Generator().manual_seed(0)).shape
        if len(shape) != 4:
            raise ConfigError(f"config: explore.mode supports image latents [B, C, h, w], this model has {tuple(shape)}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.train.seed + 1)
            net = ExploreNet(shape[1], _prompt_vector(self.encode([""])).shape[-1], s.num_steps, e.mode,
                             e.hidden).to(self.accelerator.device)
        return net, torch.optim.Adam(net.parameters(), lr=e.learning_rate)

    def _check_modality(self) -> None:
        """The model's output (the adapter class's ``modality``: image, video, audio_video) against
        ``model.num_frames`` (video and audio_video families only) and against each reward's declared
        ``modality`` (undeclared: accepted), before the model loads. An image reward on a video family
        is pointed to the per-frame wrapper that scores it on every frame."""
        cfg = self.config
        made = getattr(adapter_class(cfg.model.family), "modality", "image")
        if cfg.model.num_frames is not None and made == "image":
            raise ConfigError(f"config: model.num_frames is for video and audio-video families (wan, ltx2, "
                              f"av_demo); {cfg.model.family!r} makes single images: remove it")
        rewards = [("reward.name", cfg.reward.name, self.reward),
                   *(("eval.extra_rewards", n, r) for n, r in zip(cfg.eval.extra_rewards, self.extra_rewards))]
        for key, name, reward in rewards:
            scores = getattr(reward, "modality", None)
            if scores is None or scores == made:
                continue
            hint = ""
            if scores == "image" and made == "video":
                hint = (f": score every frame with reward.name=per_frame and reward.kwargs={{reward: {name}}} "
                        "(reward_models/video.py)" if key == "reward.name" else
                        " (an extra reward takes no options, so it cannot be wrapped in per_frame: name a video reward)")
            label = f"reward {name!r}" if key == "reward.name" else f"eval.extra_rewards: {name!r}"
            raise ConfigError(f"config: {label} scores {scores.replace('_', '-')}s, model family "
                              f"{cfg.model.family!r} makes {made.replace('_', '-')}s{hint}")

    def _check_backend(self, accumulation: int) -> None:
        """FSDP and DeepSpeed: settings the loop needs (untested here: no GPU, docs/distributed.md)."""
        acc, t = self.accelerator, self.config.train
        if acc.distributed_type == DistributedType.FSDP:
            if acc.is_fsdp2:
                raise ConfigError("FSDP2 (fsdp_version: 2) is not supported by the trainer yet; use fsdp_version: 1 "
                                  "(configs/accelerate/fsdp.yaml)")
            if not acc.state.fsdp_plugin.use_orig_params:
                raise ConfigError("FSDP needs fsdp_use_orig_params: true (only a subset of the weights trains)")
            if t.ema_decay > 0:
                raise ConfigError("train.ema_decay > 0 is not supported under FSDP (the average would be of "
                                  "sharded weights); set it to 0")
        if acc.distributed_type == DistributedType.DEEPSPEED:
            ds = acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = t.train_batch_size  # no dataloader to read it from
            ds["gradient_accumulation_steps"] = accumulation
            if ds.get("gradient_clipping", "auto") == "auto":
                ds["gradient_clipping"] = t.max_grad_norm

    @property
    def _sharded(self) -> bool:
        """Each process holds only a part of the weights or of the optimizer state."""
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def _full_params(self, writeback: bool = False):
        """Under FSDP, the full weights on every process for the block (sampling, evaluation and
        state dicts use the unwrapped model); a no-op otherwise. Every process must enter it."""
        if self.accelerator.distributed_type != DistributedType.FSDP:
            return contextlib.nullcontext()
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(self.model, writeback=writeback)

    def _across_processes(self, values: list[float]) -> torch.Tensor:
        """float64 [P, K]: every process's ``values`` (one gather; float64 keeps logged floats exact)."""
        acc = self.accelerator
        local = torch.tensor([values], dtype=torch.float64, device=acc.device)
        return (acc.gather(local) if acc.num_processes > 1 else local).cpu()

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        """The whole run. SIGTERM / SIGINT at any time during it stop the run after the epoch in
        progress with a checkpoint (during the last epoch: the run just finishes)."""
        cfg, acc = self.config, self.accelerator
        if self.gdro:
            from flowalign.offline import load_groups

            self.offline = load_groups(cfg.data.offline_groups, cfg.train.group_size)
        with GracefulStop() as stop:
            if cfg.resume:
                self.resume(cfg.resume)
            if acc.is_main_process:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            if cfg.tracker != "none":
                acc.init_trackers(self.out.name or "flowalign", config=_flat(to_dict(cfg)))
            if acc.is_main_process:
                tqdm.write("determinism: " + ", ".join(f"{k} {v}" for k, v in run_environment().items())
                           + " (the same seed and these give the same numbers)")
            if "before" not in self.evals:
                self.evals["before"] = self.evaluate("before")
            start = self.session_start = time.time()
            nan_streak = NanEpochStreak(cfg.train.max_nan_epochs)
            bar = tqdm(range(self.epoch, cfg.train.epochs), desc="epochs", disable=not acc.is_main_process,
                       initial=self.epoch, total=cfg.train.epochs)
            for epoch in bar:
                stats = self.train_epoch()
                self.epoch = epoch + 1
                self.history.append(stats)
                acc.log(stats, step=self.epoch)
                nan_streak.observe(stats, self.epoch)  # a reward NaN for every sample, epoch after epoch: stop
                bar.set_postfix(reward=f"{stats['reward/mean']:.3f}", clipfrac=f"{stats.get('train/clipfrac', 0):.2f}")
                out_of_time = cfg.train.max_minutes is not None and bool(self._across_processes(
                    [self._train_seconds() / 60 >= cfg.train.max_minutes]).any())
                if out_of_time:
                    bar.close()
                    break
                if cfg.eval.every and self.epoch % cfg.eval.every == 0 and self.epoch < cfg.train.epochs:
                    self.evals[f"epoch-{self.epoch}"] = self.evaluate(f"epoch-{self.epoch}")
                saved = None
                if cfg.checkpoint_every and self.epoch % cfg.checkpoint_every == 0:
                    saved = self.save_checkpoint()
                # every process stops at the same epoch, whichever of them got the signal
                if self.epoch < cfg.train.epochs and self._across_processes([stop.requested is not None]).any():
                    bar.close()
                    return self._stopped(stop.requested or "a signal to another process",
                                         saved or self.save_checkpoint())
            self.evals["after"] = self.evaluate("after")
            self.save_checkpoint()
            with outputs_disk_full(self.out):
                summary = self._write_outputs(self.resumed_seconds + time.time() - start)
        acc.end_training()
        return summary

    def _train_seconds(self) -> float:
        return sum(h.get("time/epoch_s", 0.0) for h in self.history)

    def _stopped(self, signal_name: str, checkpoint: Path) -> dict:
        """The summary of a run stopped by a signal: no final eval, no ``final/`` (the run is not done)."""
        acc = self.accelerator
        if acc.is_main_process:
            tqdm.write(f"stopped by {signal_name} after epoch {self.epoch}/{self.config.train.epochs}; checkpoint "
                       f"{checkpoint}; continue with resume=auto")
        acc.end_training()
        return {"interrupted": signal_name, "checkpoint": str(checkpoint), "epochs": self.epoch,
                "before": self.evals.get("before"), "after": None, "evals": self.evals}

    def train_epoch(self) -> dict:
        t0 = time.time()
        warmup = self.config.train.warmup_epochs
        for group in self.optimizer.param_groups:  # linear warm-up, a pure function of the epoch
            group["lr"] = self.config.train.learning_rate * min(1.0, (self.epoch + 1) / (warmup + 1))
        with self._full_params(), self._old_policy():
            batch = self.sample_epoch()
        advantages, stats = self.compute_advantages(batch)
        if self.explorer is not None:  # before the generator moves: its rollouts are the explorer's on-policy data
            stats.update(self.update_explorer(batch))
        stats.update(self.update_policy(batch, advantages))
        if self.router is not None:
            stats.update(self._end_routing_epoch(batch))
        if self.old is not None:
            t = self.config.train
            self.old.decay = old_policy_decay(self.epoch, t.nft_old_decay_rate, t.nft_old_decay_max)
            self.old.update()
            stats["train/old_decay"] = self.old.decay
        stats["time/epoch_s"] = time.time() - t0
        stats["time/samples_per_s"] = len(batch.specs) * self.accelerator.num_processes / stats["time/epoch_s"]
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        return stats

    def _old_policy(self):
        """DiffusionNFT samples with its old policy; the other methods with the current weights."""
        return self.old.swapped_in() if self.old is not None else contextlib.nullcontext()

    def sample_epoch(self) -> EpochBatch:
        """Draw this process's prompt groups shard by shard, each from its own streams; roll them
        out with the SDE, decode and reward them."""
        cfg, t, s = self.config, self.config.train, self.config.sampling
        groups = t.groups_per_epoch // len(self.shards)
        if self.discrete:
            return self._masked_epoch(groups)
        schedule = self.adapter.schedule(s.num_steps)
        if self.offline is not None:
            return self._offline_epoch(groups, schedule)
        # one plan for a shard's samples from the generator all processes share: every shard trains the same steps
        window_start = s.window_start
        if s.step_mode == "window" and s.window_shift_every:
            window_start = sliding_window_start(self.epoch, s.num_steps, s.window_size, s.window_shift_every,
                                                s.window_stride, s.window_start or 0)
        plan = plan_steps(s.num_steps, groups * t.group_size, s.eta, s.step_mode, fraction=s.fraction,
                          window_size=s.window_size, window_start=window_start, generator=self.plan_generator)
        self.adapter.model.eval()
        parts, specs, scored = [], [], []
        # One worker thread scores chunk k (a remote call, a CPU verifier) while chunk k + 1 samples.
        with ThreadPoolExecutor(max_workers=1) as pool:
            for shard, streams in zip(self.shards, self.streams):
                shard_specs, cond, noise = self._draw_groups(shard, streams, groups)
                for lo in range(0, len(shard_specs), t.sample_batch_size):
                    sl = slice(lo, lo + t.sample_batch_size)
                    part = rollout(self.adapter, cond[sl], noise[sl], schedule,
                                   StepPlan(plan.noise_levels, plan.trained[sl]), guidance_scale=s.guidance_scale,
                                   generator=streams["noise"], sde=s.sde, reduction=s.log_prob_reduction,
                                   noise_scale=self._noise_scale(cond[sl]))
                    parts.append(part)
                    images = self.adapter.decode(part.samples)
                    scored.append(pool.submit(self._reward_chunk, images, shard_specs[sl]) if t.async_reward
                                  else _done(self._reward_chunk(images, shard_specs[sl])))
                specs += shard_specs
            components = _cat_components([f.result() for f in scored])
        traj = Trajectory.cat(parts)
        rewards, _ = combine_rewards(components, cfg.reward.weights)
        group_ids = torch.tensor([spec["group_id"] for spec in specs])
        return EpochBatch(traj, specs, rewards, components, group_ids)

    def _masked_rollout(self, cond, generator: torch.Generator | None) -> MaskedTrajectory:
        """Unmask the states of ``cond`` (its fixed tokens kept) with the current weights; the
        plan and the categorical draws come from ``generator``."""
        from flowalign.samplers.unmasking import rollout as unmasking_rollout

        s = self.config.sampling
        return unmasking_rollout(lambda x: self.adapter.predict(x, None, cond, s.guidance_scale),
                                 self.adapter.initial_state(cond), s.num_steps, schedule=s.unmask_schedule,
                                 temperature=s.temperature, generator=generator, cond=cond)

    def _masked_epoch(self, groups: int) -> EpochBatch:
        """``sample_epoch`` for masked diffusion: the same prompt groups, streams and threaded
        scoring; each chunk is unmasked with the shard's noise stream and scored on its decoded
        boards."""
        cfg, t = self.config, self.config.train
        self.adapter.model.eval()
        parts, specs, scored = [], [], []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for shard, streams in zip(self.shards, self.streams):
                shard_specs, cond, _ = self._draw_groups(shard, streams, groups)
                for lo in range(0, len(shard_specs), t.sample_batch_size):
                    sl = slice(lo, lo + t.sample_batch_size)
                    part = self._masked_rollout(cond[sl], streams["noise"])
                    parts.append(part)
                    boards = self.adapter.decode(part.samples)
                    scored.append(pool.submit(self._reward_chunk, boards, shard_specs[sl]) if t.async_reward
                                  else _done(self._reward_chunk(boards, shard_specs[sl])))
                specs += shard_specs
            components = _cat_components([f.result() for f in scored])
        rewards, _ = combine_rewards(components, cfg.reward.weights)
        return EpochBatch(MaskedTrajectory.cat(parts), specs, rewards, components,
                          torch.tensor([spec["group_id"] for spec in specs]))

    def _noise_scale(self, cond):
        """The rollout's per-element std multiplier from EXPLORENET (None: isotropic)."""
        if self.explorer is None:
            return None
        prompts = _prompt_vector(cond)
        return lambda x, step: self.explorer(x, step, prompts)

    def update_explorer(self, batch: EpochBatch) -> dict:
        """One step of EXPLORENET on this epoch's rollouts (estimator: flowalign/explorenet.py):
        ascend Σ_groups (U_g − mean U of the other groups)·Σ_i Σ_k log q_φ(x'_ik | x_ik)."""
        from flowalign.explorenet import exploration_log_density, group_spread_advantages

        acc, traj = self.accelerator, batch.traj
        weights, stats = group_spread_advantages(acc.gather(batch.rewards.to(acc.device)).cpu(),
                                                 acc.gather(batch.group_ids.to(acc.device)).cpu())
        n = len(batch.specs)
        weights = weights[acc.process_index * n:(acc.process_index + 1) * n].to(acc.device)
        prompts = _prompt_vector(traj.cond)
        self.explorer.train()
        self.explorer_optimizer.zero_grad(set_to_none=True)
        steps = [j for j in range(len(traj.noise_levels)) if traj.noise_levels[j] > 0]
        spreads = []
        for j in steps:
            w = traj.std_scales[:, j] * traj.step_noise[:, j]  # (x' − μ) / isotropic std
            m = self.explorer(traj.latents[:, j], j, prompts)
            loss = -(weights * exploration_log_density(w, m)).sum() / max(n, 1) / len(steps)
            loss.backward()
            spreads.append(m.detach().flatten(1).std(1).mean().item())
        for p in self.explorer.parameters():
            if p.grad is not None and acc.num_processes > 1:
                p.grad = acc.reduce(p.grad, "mean")
        self.explorer_optimizer.step()
        self.explorer.eval()
        stats["explore/m_std"] = sum(spreads) / max(len(spreads), 1)  # 0 = isotropic
        return stats

    def _explorer_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.explorer.state_dict().items()}

    def _offline_epoch(self, groups: int, schedule) -> EpochBatch:
        """GDRO: each shard draws ``groups`` of the pre-generated groups (uniformly, with replacement,
        from its prompt stream); nothing is sampled."""
        data, k = self.offline, self.config.train.group_size
        picks, specs = [], []
        for shard, streams in zip(self.shards, self.streams):
            chosen = torch.randint(len(data["specs"]), (groups,), generator=streams["prompts"]).tolist()
            picks += chosen
            specs += [{**data["specs"][g], "group_id": shard * groups + i} for i, g in enumerate(chosen) for _ in range(k)]
        device = self.accelerator.device
        index = torch.tensor(picks)
        samples = data["samples"][index].flatten(0, 1).to(device)  # [groups·k, ...]
        components = {name: values[index].flatten() for name, values in data["components"].items()}
        cond = encode_records(self.encode, [data["specs"][g] for g in picks]).repeat_interleave(k)
        traj = Trajectory(samples[:, None], torch.zeros(len(samples), 0, device=device),
                          torch.zeros(len(samples), 0, dtype=torch.bool, device=device), torch.zeros(0),
                          schedule.sigmas, schedule.timesteps, cond)
        rewards, _ = combine_rewards(components, self.config.reward.weights)
        return EpochBatch(traj, specs, rewards, components, torch.tensor([spec["group_id"] for spec in specs]))

    def _draw_groups(self, shard: int, streams: dict[str, torch.Generator], groups: int):
        """A shard's prompt groups: (specs, conditioning, initial noise), groups × group_size of each."""
        t, s = self.config.train, self.config.sampling
        picks = torch.multinomial(self.prompt_weights, groups, replacement=True, generator=streams["prompts"]).tolist()
        # group_id (unique over all shards) tells group-level rewards (Pref-GRPO win rates) which samples compete
        specs = [{**self.train_specs[i], "group_id": shard * groups + k} for k, i in enumerate(picks)
                 for _ in range(t.group_size)]
        cond = encode_records(self.encode, [self.train_specs[i] for i in picks]).repeat_interleave(t.group_size)
        noise = group_noise(self.adapter, groups, t.group_size, streams["noise"], s.shared_group_noise)
        return specs, cond, noise

    @torch.no_grad()
    def _score(self, latents: torch.Tensor, specs: list[dict], reward=None, chunk: int = 64) -> dict[str, torch.Tensor]:
        return _cat_components([self._reward_chunk(self.adapter.decode(latents[lo:lo + chunk]), specs[lo:lo + chunk],
                                                   reward) for lo in range(0, len(specs), chunk)])

    def _reward_chunk(self, images: torch.Tensor, specs: list[dict], reward=None) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v, dtype=torch.float32).cpu()
                for k, v in (reward or self.reward)(images, [p["prompt"] for p in specs], specs).items()}

    def compute_advantages(self, batch: EpochBatch) -> tuple[torch.Tensor, dict]:
        """Group-normalised advantages over every process's samples (a group lives on one shard, its
        id is unique over all of them); returns this process's share: [B], or [B, C] with one
        column per weighted reward (``train.per_reward_advantages``), NaN where a sample must not
        train: its reward was dropped, its advantage is not finite (``adv/nonfinite``), or it is
        not among its group's extremes (``train.keep_extremes``)."""
        acc, t = self.accelerator, self.config.train
        device = acc.device
        rewards = acc.gather(batch.rewards.to(device)).cpu()
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        stats, gathered = {}, {}
        for name, values in batch.components.items():
            gathered[name] = values = acc.gather(values.to(device)).cpu()
            ok = torch.isfinite(values)
            stats[f"reward/{name}"] = values[ok].mean().item() if ok.any() else float("nan")
        valid = torch.isfinite(rewards)
        stats["reward/mean"] = rewards[valid].mean().item() if valid.any() else float("nan")
        stats["reward/std"] = rewards[valid].std(unbiased=False).item() if valid.any() else float("nan")
        stats["reward/dropped_nan"] = int((~valid).sum())
        n = len(batch.specs)
        mine = slice(acc.process_index * n, (acc.process_index + 1) * n)  # this process's part of the gathered batch
        if self.trackers is not None:
            size = n // len(self.trackers)
            local = torch.cat([tracker.update([spec["prompt"] for spec in batch.specs[k * size:(k + 1) * size]],
                                              batch.rewards[k * size:(k + 1) * size])
                               for k, tracker in enumerate(self.trackers)])
        else:
            # a sample dropped for one weighted component is dropped for all (combine_rewards' NaN)
            columns = [torch.where(valid, gathered[name], float("nan")) for name in self.config.reward.weights] \
                if t.per_reward_advantages else [rewards]
            advs = []
            for column in columns:
                if t.advantage_baseline == "leave_one_out":
                    adv, adv_stats = leave_one_out_advantages(column, group_ids, clip=t.advantage_clip)
                else:
                    adv, adv_stats = group_advantages(column, group_ids, global_std=t.global_std,
                                                      clip=t.advantage_clip)
                advs.append(adv)
            local = (torch.stack(advs, dim=1) if t.per_reward_advantages else advs[0])[mine]
            stats.update({f"adv/{k}": v for k, v in adv_stats.items()})
        drop = ~torch.isfinite(batch.rewards)
        if t.keep_extremes:
            drop |= ~extremes_mask(rewards, group_ids, t.keep_extremes)[mine]
        nonfinite = ~torch.isfinite(local)  # e.g. rewards so large that their mean overflows
        nonfinite = nonfinite.any(dim=1) if local.ndim == 2 else nonfinite
        local = torch.where((nonfinite | drop).view(-1, *([1] * (local.ndim - 1))), float("nan"), local)
        every = self._across_processes([float(nonfinite.sum()), torch.nan_to_num(local).abs().mean().item()])
        stats["adv/nonfinite"] = int(every[:, 0].sum())
        stats["adv/abs_mean"] = every[:, 1].mean().item()
        return local, stats

    def update_policy(self, batch: EpochBatch, advantages: torch.Tensor) -> dict:
        """Inner epochs over shuffled minibatches; one optimizer step per minibatch, gradients
        accumulated over its trained steps (each step's loss weighted 1 / number of steps). Samples
        with a NaN advantage get no gradient. A step whose loss or gradient is not finite on any
        process is skipped on every process (weights, optimizer state and EMA untouched) and
        counted in ``train/skipped_nonfinite``; the other stats average the steps taken."""
        acc, t = self.accelerator, self.config.train
        traj, device = batch.traj, acc.device
        valid = torch.isfinite(advantages).to(device)
        valid = valid.all(dim=1) if valid.ndim == 2 else valid
        advantages = torch.nan_to_num(advantages, nan=0.0).to(device)
        # loss terms per minibatch: trained stochastic steps, or the noising draws of NFT and GDRO
        if self.discrete:
            steps = self.masked_steps
        else:
            steps = list(range(t.noise_draws)) if self.forward_process else \
                [j for j in range(len(traj.noise_levels)) if traj.noise_levels[j] > 0]
        if len(steps) != acc.gradient_accumulation_steps:  # the accumulation must close on each minibatch's last step
            raise RuntimeError(f"{len(steps)} trained steps, Accelerate accumulates {acc.gradient_accumulation_steps}")
        if not self._across_processes([float(valid.any())]).any():  # every sample dropped: nothing to learn
            return {"train/skipped": 1.0, "train/skipped_nonfinite": 0.0}
        totals: dict[str, float] = {}
        count, skipped = 0, 0
        self.model.train()
        for _ in range(t.inner_epochs):
            unit = t.group_size if self.gdro or (self.nft and t.nft_shared_noising) else 1  # samples sharing draws
            draws = self._forward_draws(traj, unit) if self.forward_process else None
            for idx in self._minibatches(len(batch.specs), unit):
                sub, adv = traj[idx], advantages[idx]
                step_totals, finite = {}, True
                for j in steps:
                    with acc.accumulate(self.model), acc.autocast():
                        if self.nft:
                            loss, step_stats = self._nft_loss(sub, draws[0][idx, j], draws[1][idx, j], adv,
                                                              valid[idx])
                        elif self.gdro:
                            loss, step_stats = self._gdro_loss(sub, draws[0][idx, j], draws[1][idx, j],
                                                               batch.rewards.to(device)[idx])
                        else:
                            loss, step_stats = self._step_loss(sub, j, adv, sub.trained[:, j] & valid[idx])
                        acc.backward(loss)  # Accelerate divides by the number of steps accumulated
                    finite &= bool(torch.isfinite(loss.detach()))
                    for key, value in step_stats.items():
                        step_totals[key] = step_totals.get(key, 0.0) + float(value)
                grad_norm = acc.clip_grad_norm_(self._clip_parameters(), t.max_grad_norm)  # None under DeepSpeed
                finite &= grad_norm is None or bool(torch.isfinite(torch.as_tensor(grad_norm)))
                if self._across_processes([float(not finite)]).any():
                    skipped += 1
                    if acc.scaler is not None:
                        self.optimizer.step()  # fp16: the GradScaler skips it itself and lowers its scale
                else:
                    self.optimizer.step()
                    if self.ema is not None:
                        self.ema.update()
                    if grad_norm is not None:
                        step_totals["grad_norm"] = float(grad_norm) * len(steps)
                    for key, value in step_totals.items():
                        totals[key] = totals.get(key, 0.0) + value
                    count += len(steps)
                self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        stats = {f"train/{k}": v / max(count, 1) for k, v in sorted(totals.items())}
        stats["train/skipped_nonfinite"] = float(skipped)
        means = self._across_processes(list(stats.values())).mean(dim=0).tolist()  # same keys on every process
        return dict(zip(stats, means))

    def _minibatches(self, n: int, unit: int = 1) -> list[torch.Tensor]:
        """Index sets [train_batch_size] of one inner epoch: each shard shuffles its own samples
        (in blocks of ``unit``: whole groups for GDRO) with its own stream and minibatch k takes the
        k-th slice of every shard, so one process with S shards trains on the minibatches S
        processes together train on."""
        shards, size = len(self.streams), self.config.train.train_batch_size // len(self.streams)
        per_shard = n // shards
        order = torch.stack([(torch.randperm(per_shard // unit, generator=streams["shuffle"])[:, None] * unit
                              + torch.arange(unit)).flatten() + k * per_shard
                             for k, streams in enumerate(self.streams)])
        return [order[:, lo:lo + size].flatten().to(self.accelerator.device) for lo in range(0, per_shard, size)]

    def _clip_parameters(self) -> list[torch.nn.Parameter]:
        # FSDP clips on its wrapper (a collective over the shards) only when given all its parameters
        if self.accelerator.distributed_type == DistributedType.FSDP:
            return list(self.model.parameters())
        return self.params

    def _step_loss(self, sub: Trajectory, j: int, adv: torch.Tensor, weight: torch.Tensor):
        if self.discrete:
            return self._masked_step_loss(sub, j, adv, weight)
        t, s = self.config.train, self.config.sampling
        x, x_next = sub.latents[:, j], sub.latents[:, j + 1]
        eta = float(sub.noise_levels[j])
        args = (self.adapter, x, j, sub.schedule, eta, sub.cond, s.guidance_scale)
        scale = None if sub.std_scales is None else sub.std_scales[:, j]  # the std each sample was drawn with
        out = transition(*args, sde=s.sde, prev_sample=x_next, reduction=s.log_prob_reduction, model=self.model,
                         std_scale=scale)
        ref_mean = None
        if t.kl_beta > 0:
            # under FSDP a LoRA's reference (adapters off) must run through the wrapper that holds the shards
            fsdp_lora = self.accelerator.distributed_type == DistributedType.FSDP and self.config.model.lora_rank > 0
            with torch.no_grad(), self.adapter.reference():
                ref_mean = transition(*args, sde=s.sde, prev_sample=x_next, reduction=s.log_prob_reduction,
                                      model=self.model if fsdp_lora else None, std_scale=scale).mean
        return flow_grpo_loss(out.log_prob, sub.log_probs[:, j], adv, clip_range=t.clip_range, beta=t.kl_beta,
                              mean=out.mean, ref_mean=ref_mean, std=out.std, weight=weight,
                              reduction=s.log_prob_reduction,
                              advantage_weights=self._reward_weights() if adv.ndim == 2 else None)

    def _masked_step_loss(self, sub: MaskedTrajectory, j: int, adv: torch.Tensor, weight: torch.Tensor):
        """Masked DDPO on unmasking step j: the policy's logits at the recorded state x_j rescore
        the tokens step j drew (at the rollout's temperature); the reference (LoRA off, or the
        frozen copy) gives the KL's other side."""
        t, s = self.config.train, self.config.sampling
        x = sub.states[:, j]
        logits = self.adapter.predict(x, None, sub.cond, s.guidance_scale, model=self.model)
        ref_logits = None
        if t.kl_beta > 0:
            fsdp_lora = self.accelerator.distributed_type == DistributedType.FSDP and self.config.model.lora_rank > 0
            with torch.no_grad(), self.adapter.reference():
                ref_logits = self.adapter.predict(x, None, sub.cond, s.guidance_scale,
                                                  model=self.model if fsdp_lora else None)
        return masked_ddpo_loss(logits, sub.states[:, j + 1], sub.unmask[:, j], sub.log_probs[:, j], adv,
                                clip_range=t.clip_range, ref_logits=ref_logits, beta=t.kl_beta,
                                entropy_coef=t.entropy_coef, temperature=s.temperature, weight=weight)

    # -- audio-video routing (flowalign/objectives/av_routing.py) ---------------------------
    def _build_router(self) -> RewardRouter | None:
        r = self.config.routing
        if not (r.reweight or r.influence):
            return None
        if getattr(self.adapter, "modality", "image") != "audio_video":
            raise ConfigError(f"config: routing is for audio-video families (their branch masks); "
                              f"{self.config.model.family!r} is not one")
        names = list(self.config.reward.weights)
        concerns = torch.zeros(len(BRANCHES), len(names), dtype=torch.bool)
        for k, name in enumerate(names):
            for branch in r.concerns.get(name, BRANCHES):
                concerns[BRANCHES.index(branch), k] = True
        router = RewardRouter(self._reward_weights(), concerns, warmup=r.warmup, strength=r.strength,
                              threshold=r.threshold, max_residual=r.max_residual, gram_decay=r.gram_decay,
                              floor_strength=r.floor_strength if r.reweight else 0.0, floor_max=r.floor_max,
                              floor_gates_residual=r.floor_gates_residual, floor_gate=r.floor_gate)
        self._layer_scales: dict[str, float] = {}
        self._layer_sums: dict[str, list[float]] = {}
        self._probe_due = True  # the reward-gradient Gram is measured on each epoch's first minibatch
        if r.influence:  # each cross-modal module's gradients scaled by its influence (constant within an epoch)
            if not hasattr(self.adapter, "record_cross_modal"):
                raise ConfigError(f"config: routing.influence reads the cross-modal attention during the forward "
                                  f"pass; the {self.config.model.family!r} adapter cannot record it")
            self._writes = {name: branch for name, (branch, _) in self.adapter.cross_modal_attention().items()}
            for name, (_, module) in self.adapter.cross_modal_attention().items():
                for p in module.parameters():
                    if p.requires_grad:
                        p.register_hook(lambda g, name=name: g * self._layer_scales.get(name, 1.0))
        return router

    def _routed_nft_loss(self, sub, x0, x_t, sigma, timestep, v_old, v_ref, adv, weight):
        """DiffusionNFT over the joint latent's branches: per-branch r (reweight) and/or
        influence token weights, reading the cross-modal attention of v_θ's own forward pass."""
        r, t = self.config.routing, self.config.train
        layout = self.adapter.joint_layout
        recording = self.adapter.record_cross_modal(maps=False, model=self.model) if r.influence \
            else contextlib.nullcontext()
        with recording as recorder:
            v_theta = self.adapter.predict(x_t, timestep, sub.cond, 1.0, model=self.model)
        elem_weight = None
        if r.influence:
            video, audio = [], []
            for name, calls in recorder.records.items():
                u = calls[-1].response_ratio  # [b, tokens of the branch this module writes into]
                (video if self._writes[name] == "video" else audio).append(u)
                self._layer_sums.setdefault(name, [0.0, 0.0])
                self._layer_sums[name][0] += float(u.mean())
                self._layer_sums[name][1] += 1
            elem_weight = layout.expand_tokens(token_weights(torch.stack(video).mean(0), r.token_alpha),
                                               token_weights(torch.stack(audio).mean(0), r.token_alpha))
        per_reward = adv if adv.ndim == 2 else adv[:, None]
        if r.reweight:
            masks = self.adapter.branch_masks().to(x0.device)
            prob = optimality_probability(branch_advantages(per_reward, self.router.weights.to(adv)), t.advantage_clip)
        else:
            masks = torch.ones(1, layout.numel, dtype=torch.bool, device=x0.device)
            combined = per_reward @ self._reward_weights().to(adv) if adv.ndim == 2 else adv
            prob = optimality_probability(combined, t.advantage_clip)[:, None]
        loss, stats = routed_nft_loss(v_theta, v_old, x_t, x0, sigma, prob, masks, beta=t.nft_beta,
                                      elem_weight=elem_weight, v_ref=v_ref, kl_beta=t.kl_beta, weight=weight)
        if r.reweight and self._probe_due and self.router.needs_gram:
            self._probe_due = False
            self.router.observe(self._interaction_gram(v_theta, v_old, x_t, x0, sigma, masks, elem_weight,
                                                       optimality_probability(per_reward, t.advantage_clip) - 0.5,
                                                       weight.bool()))
        return loss, stats

    def _interaction_gram(self, v_theta, v_old, x_t, x0, sigma, masks, elem_weight, centred, keep) -> torch.Tensor:
        """The reward-gradient Gram [M, K, K] of one minibatch (``interaction_gram``): one batched backward
        pass (a vector-Jacobian product per branch, routed reward and half of the kept samples) through
        the graph the loss then reuses."""
        contrast = branch_contrasts(v_theta, v_old, x_t, x0, sigma, masks, beta=self.config.train.nft_beta,
                                    elem_weight=elem_weight)  # [b, M]
        kept = keep.nonzero().flatten()
        halves = (kept[0::2], kept[1::2])
        n_branch, n_reward = self.router.priors.shape
        gram = torch.zeros(n_branch, n_reward, n_reward)
        if len(halves[1]) == 0:
            return gram
        pairs = [(b, k) for b in range(n_branch) for k in range(n_reward) if self.router.priors[b, k] > 0]
        # one vector-Jacobian product per (half, branch, reward): mean over the half of a_ik·C_i^b
        seeds = torch.zeros(2 * len(pairs), *contrast.shape, device=contrast.device)
        for h, half in enumerate(halves):
            for j, (b, k) in enumerate(pairs):
                seeds[h * len(pairs) + j, half, b] = centred[half, k].to(seeds) / len(half)
        grads = torch.autograd.grad(contrast, self.params, grad_outputs=seeds, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        flat = torch.cat([(g if g is not None else torch.zeros(len(seeds), *p.shape, device=p.device)).flatten(1)
                          for g, p in zip(grads, self.params)], 1).float().view(2, len(pairs), -1)
        for b in range(n_branch):
            rows = [j for j, (bb, _) in enumerate(pairs) if bb == b]
            idx = torch.tensor([pairs[j][1] for j in rows])
            gram[b, idx[:, None], idx[None, :]] = interaction_gram(flat[0, rows], flat[1, rows]).cpu()
        return gram

    def _end_routing_epoch(self, batch: EpochBatch) -> dict:
        """Fold this epoch's interactions, rewards and influences (over all processes) into the router."""
        router, stats = self.router, {}
        pending = router.pending_gram
        router.pending_gram = self._across_processes(pending.flatten().tolist()).sum(0).float().view_as(pending)
        names = list(self.config.reward.weights)
        values = torch.stack([batch.components[name].float() for name in names], 1)  # [B, K], NaN = failed
        valid = torch.isfinite(values)
        v = torch.where(valid, values, torch.zeros_like(values)).double()
        sums = self._across_processes([*valid.sum(0).tolist(), *v.sum(0).tolist(), *(v**2).sum(0).tolist()])
        n, total, squares = sums.sum(0).view(3, len(names)).float()
        mean = torch.where(n > 0, total / n.clamp(min=1), torch.full_like(n, float("nan")))
        router.observe_rewards(mean, (squares / n.clamp(min=1) - mean**2).clamp(min=0).sqrt(), n)
        router.end_epoch(self.epoch + 1)
        self._probe_due = True
        if self.config.routing.reweight:
            for b, branch in enumerate(BRANCHES):
                for k, name in enumerate(names):
                    if router.priors[b, k] > 0:
                        stats[f"routing/weight_{branch}_{name}"] = float(router.weights[b, k])
                        stats[f"routing/cos_{branch}_{name}"] = float(router.cos[b, k])
            for k, name in enumerate(names):
                stats[f"routing/floor_multiplier_{name}"] = float(router.floor_multiplier[k])
        if self.config.routing.influence and self._layer_sums:
            layers = sorted(self._layer_sums)
            means = self._across_processes([self._layer_sums[n][0] / max(self._layer_sums[n][1], 1)
                                            for n in layers]).mean(0)
            router.observe_layers(dict(zip(layers, means.tolist())))
            self._set_layer_scales()
            self._layer_sums = {}
            stats.update({f"routing/grad_scale_{n}": v for n, v in self._layer_scales.items()})
        return stats

    def _set_layer_scales(self) -> None:
        """Gradient scale of each cross-modal module from the router's influence EMA (1 before any)."""
        r, names = self.config.routing, sorted(self.router.layer_influence)
        scales = layer_gradient_scales(torch.tensor([self.router.layer_influence[n] for n in names]),
                                       r.layer_scale_min, r.layer_scale_max) if names else torch.zeros(0)
        self._layer_scales = dict(zip(names, scales.tolist()))

    def _reward_weights(self) -> torch.Tensor:
        """[C] the configured reward weights, in the order of the per-reward advantage columns."""
        return torch.tensor(list(self.config.reward.weights.values()), dtype=torch.float32)

    def _forward_draws(self, traj: Trajectory, share: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Noising draws (DiffusionNFT, GDRO) for one inner epoch, from each shard's noise stream:
        schedule indices long [B, K] (K distinct steps per sample) and noise [B, K, ...]; ``share``
        consecutive samples (a GDRO group, an NFT group under train.nft_shared_noising) get the same draws."""
        k, n_steps = self.config.train.noise_draws, len(traj.timesteps)
        per_shard = len(traj.latents) // len(self.streams) // share
        indices, noise = [], []
        for streams in self.streams:
            g = streams["noise"]
            indices.append(torch.rand(per_shard, n_steps, generator=g).argsort(dim=1)[:, :k])
            noise.append(torch.randn(per_shard, k, *traj.samples.shape[1:], generator=g))
        device = self.accelerator.device
        return (torch.cat(indices).repeat_interleave(share, dim=0).to(device),
                torch.cat(noise).repeat_interleave(share, dim=0).to(device))

    def _noised(self, sub: Trajectory, step: torch.Tensor, eps: torch.Tensor):
        """x_t = (1 − σ)·x0 + σ·ε of each sample's final latent: (x0, x_t, σ [b], timestep [b]).
        An adapter with ``forward_noised`` (per-stream levels: av_demo's video-first order) gives
        (x0 as the loss compares it, x_t, σ) itself."""
        device = sub.samples.device
        sigma, timestep = sub.sigmas.to(device)[step], sub.timesteps.to(device)[step]
        x0 = sub.samples
        if hasattr(self.adapter, "forward_noised"):
            return (*self.adapter.forward_noised(x0, eps, sigma), timestep)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        return x0, (1 - s) * x0 + s * eps, sigma, timestep

    def _gdro_loss(self, sub: Trajectory, step: torch.Tensor, eps: torch.Tensor, rewards: torch.Tensor):
        """GDRO on one noising draw shared by each group: step long [b], eps [b, ...], rewards [b];
        the b samples are whole groups in order. A group with a dropped (NaN) reward is left out."""
        t = self.config.train
        x0, x_t, _, timestep = self._noised(sub, step, eps)
        target = (eps - x0).flatten(1)
        with torch.no_grad(), self.adapter.reference():
            mse_ref = ((self.adapter.predict(x_t, timestep, sub.cond, 1.0).float().flatten(1) - target) ** 2).mean(1)
        v_theta = self.adapter.predict(x_t, timestep, sub.cond, 1.0, model=self.model)
        mse_theta = ((v_theta.float().flatten(1) - target) ** 2).mean(1)
        k = t.group_size
        rewards = rewards.view(-1, k)
        keep = torch.isfinite(rewards).all(dim=1)
        if not keep.any():  # nothing to compare; a zero loss that still touches every weight
            return (v_theta * 0).sum(), {"policy_loss": torch.zeros(())}
        return gdro_loss(mse_theta.view(-1, k)[keep], mse_ref.view(-1, k)[keep], rewards[keep], beta=t.gdro_beta,
                         tau=t.gdro_tau, gamma=t.gdro_gamma)

    def _nft_loss(self, sub: Trajectory, step: torch.Tensor, eps: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor):
        """DiffusionNFT on one noising draw per sample: step long [b] (schedule index), eps [b, ...]."""
        t = self.config.train
        x0, x_t, sigma, timestep = self._noised(sub, step, eps)
        with torch.no_grad():  # before v_θ's forward: swapping the old weights in later would break its graph
            with self.old.swapped_in():
                v_old = self.adapter.predict(x_t, timestep, sub.cond, 1.0)
            v_ref = None
            if t.kl_beta > 0:
                with self.adapter.reference():
                    v_ref = self.adapter.predict(x_t, timestep, sub.cond, 1.0)
        if self.router is not None:
            return self._routed_nft_loss(sub, x0, x_t, sigma, timestep, v_old, v_ref, adv, weight)
        v_theta = self.adapter.predict(x_t, timestep, sub.cond, 1.0, model=self.model)
        if adv.ndim == 2:  # one column per reward: r follows their weighted sum
            adv = adv @ self._reward_weights().to(adv)
        return diffusion_nft_loss(v_theta, v_old, x_t, x0, sigma, optimality_probability(adv, t.advantage_clip),
                                  beta=t.nft_beta, v_ref=v_ref, kl_beta=t.kl_beta, weight=weight)

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, label: str) -> dict:
        """ODE sampling (η = 0) of every held-out prompt × ``eval.seeds`` with fixed noise; reward
        components overall and per category (the "tag" of GenEval-style records)."""
        acc = self.accelerator
        result: dict = {}
        with self._full_params():
            if acc.is_main_process:
                with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                    result = self._evaluate_main(label)
                tqdm.write(f"eval {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                                                         if isinstance(v, float)))
                acc.log({f"eval/{k}": v for k, v in _flat(result).items() if isinstance(v, (int, float))},
                        step=self.epoch)
            acc.wait_for_everyone()
        return result

    def _evaluate_main(self, label: str) -> dict:
        e, s = self.config.eval, self.config.sampling
        specs = [spec for spec in self.eval_specs for _ in range(e.seeds)]
        latents = self._eval_samples(specs)
        components = self._score(latents, specs)
        for reward in self.extra_rewards:
            components.update(self._score(latents, specs, reward))
        t = self.config.train
        result = {"epoch": self.epoch, "samples": len(specs), "train_seconds": self._train_seconds(),
                  "train_samples": self.epoch * t.groups_per_epoch * t.group_size * self.accelerator.num_processes}
        if e.seeds > 1 and self.discrete:
            from flowalign.chess.diversity import grouped_board_diversity

            result.update(grouped_board_diversity(latents, e.seeds))  # distinct, board_distance
        elif e.seeds > 1:
            result["latent_diversity"] = latent_diversity(latents, e.seeds)
        before = self._paired_eval_samples(label, components)
        for name, values in components.items():
            result[name] = _nanmean(values)
            if name in before and len(before[name]) == len(values):  # one noise per sample: each its own cluster
                result[f"{name}_change"], result[f"{name}_change_se"] = paired_change(
                    [(a, b, i) for i, (a, b) in enumerate(zip(values.tolist(), before[name].tolist()))])
            tags = sorted({spec.get("tag") for spec in specs if spec.get("tag")})
            if tags:
                per = {tag: _nanmean(values[[sp.get("tag") == tag for sp in specs]]) for tag in tags}
                result[f"{name}_by_category"] = per
                result[f"{name}_category_mean"] = sum(per.values()) / len(per)
        self._eval_grid(label, latents, specs)
        return result

    def _paired_eval_samples(self, label: str, components: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Writes this evaluation's per-sample rewards to ``eval_samples/<label>.pt`` and returns the
        "before" evaluation's ({} for "before" itself): the same noise, so each later evaluation
        reports its paired change against it (``<component>_change`` ± ``_change_se``), across resumes."""
        folder = self.out / "eval_samples"
        folder.mkdir(parents=True, exist_ok=True)
        _torch_save({k: v.float().cpu() for k, v in components.items()}, folder / f"{label}.pt")
        path = folder / "before.pt"
        if label == "before" or not path.is_file():
            return {}
        try:
            return _read_torch(path)
        except CheckpointError:  # a damaged file costs the standard errors, not the run
            return {}

    def _eval_samples(self, specs: list[dict]) -> torch.Tensor:
        """Final samples of the held-out ``specs``, paired across evaluations: ODE sampling
        (η = 0) from the noise of EVAL_SEED; for masked diffusion, the unmasking plan and the
        categorical draws of one generator seeded EVAL_SEED, run through the batches in order
        (the same draws before and after; the samples differ only through the weights)."""
        e, s = self.config.eval, self.config.sampling
        generator = torch.Generator().manual_seed(EVAL_SEED)
        self.adapter.model.eval()
        latents = []
        if self.discrete:
            for lo in range(0, len(specs), e.batch_size):
                sub = specs[lo:lo + e.batch_size]
                latents.append(self._masked_rollout(encode_records(self.encode, sub), generator).samples)
            return torch.cat(latents)
        noise = self.adapter.initial_noise(len(specs), generator)
        steps = e.num_steps or s.num_steps
        schedule = self.adapter.schedule(steps)
        for lo in range(0, len(specs), e.batch_size):
            sub = specs[lo:lo + e.batch_size]
            plan = plan_steps(steps, len(sub), 0.0)
            traj = rollout(self.adapter, encode_records(self.encode, sub), noise[lo:lo + len(sub)],
                           schedule, plan, guidance_scale=s.guidance_scale)
            latents.append(traj.samples)
        return torch.cat(latents)

    def _eval_grid(self, label: str, latents: torch.Tensor, specs: list[dict]) -> None:
        """Rows: ``grid_prompts`` held-out prompts spread over the set; columns: the first seeds."""
        e = self.config.eval
        n_prompts, n_seeds = min(e.grid_prompts, len(self.eval_specs)), min(e.grid_seeds, e.seeds)
        rows = [round(i * (len(self.eval_specs) - 1) / max(n_prompts - 1, 1)) for i in range(n_prompts)]
        idx = [r * e.seeds + c for r in rows for c in range(n_seeds)]
        images = as_image_cells(self.adapter.decode(latents[idx]))  # boards (FEN strings) are drawn
        if self.eval_specs[rows[0]].get("image"):  # an image-conditioned task: its input in the first column
            images = with_inputs(images, [self.eval_specs[r]["image"] for r in rows], n_seeds)
            n_seeds += 1
        grid = to_pil_grid(images, n_prompts, n_seeds)
        self._grids = getattr(self, "_grids", {})
        self._grids[label] = grid
        save_grid(grid, self.out / "grids" / f"{label}.png", [self.eval_specs[r]["prompt"] for r in rows])

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """``checkpoints/epoch-NNNNNN/``: trained weights (safetensors), optimizer, EMA, every
        shard's generator states (and prompt trackers), the counters, a manifest of every file's
        size and SHA-256, plus ``policy/`` (the evaluated weights, EMA if used, in the format of ``final/``).
        Written to ``epoch-NNNNNN.tmp/``, renamed when complete. Refuses non-finite weights; a full
        disk raises DiskFullError and leaves the previous checkpoints as they were."""
        acc = self.accelerator
        bad = any(not torch.isfinite(p).all() for p in self.params + (self.ema.shadow if self.ema else [])
                  + (self.old.shadow if self.old else []))
        if self._across_processes([bad]).any():
            raise CheckpointError(f"refusing to write checkpoint epoch-{self.epoch:06d}: the trained weights hold "
                                  "NaN/Inf (the non-finite guards should have skipped that step; please report it)")
        final = self.out / "checkpoints" / f"epoch-{self.epoch:06d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            self._write_process_state(tmp)
            acc.wait_for_everyone()  # every process's files are in place before the manifest lists them
            with self._full_params():
                if acc.is_main_process:
                    self._write_main_state(tmp)
                acc.wait_for_everyone()
        except Exception as error:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            if _is_disk_full(error):
                previous = checkpoint_folders(final.parent)
                raise DiskFullError(
                    f"disk full while writing checkpoint {tmp} (free: {_free_mb(final.parent)} MB; {error}). The "
                    f"partial folder was removed; the previous checkpoint ({previous[-1] if previous else 'none'}) "
                    "is untouched. Free some space (or lower checkpoints_kept) and continue with resume=auto"
                ) from error
            raise
        if acc.is_main_process:
            _replace_folder(tmp, final)
            _fsync([final.parent])  # the rename itself
            self._prune_checkpoints()
        acc.wait_for_everyone()
        return final

    def _write_process_state(self, folder: Path) -> None:
        """What each process owns: its shards' generators and trackers; its optimizer shard if sharded."""
        for k, (shard, streams) in enumerate(zip(self.shards, self.streams)):
            save_file({**{name: g.get_state() for name, g in streams.items()}, "plan": self.plan_generator.get_state()},
                      folder / f"rng-shard{shard}.safetensors")
            if self.trackers is not None:
                (folder / f"tracker-shard{shard}.json").write_text(json.dumps(self.trackers[k].state_dict()))
        if self._sharded:
            _torch_save(self.optimizer.state_dict(), folder / f"optimizer-rank{self.accelerator.process_index}.pt")

    def _write_main_state(self, folder: Path) -> None:
        acc = self.accelerator
        save_file({k: v.detach().cpu().contiguous() for k, v in self.adapter.trained_state_dict().items()},
                  folder / "trained.safetensors")
        if not self._sharded:
            _torch_save(self.optimizer.state_dict(), folder / "optimizer.pt")
        if self.ema is not None:
            save_file(self.ema.state_dict(), folder / "ema.safetensors")
        if self.old is not None:
            save_file(self.old.state_dict(), folder / "old.safetensors")
        if self.router is not None:
            _torch_save(self.router.state_dict(), folder / "routing.pt")
        if self.explorer is not None:  # apart from the generator: policy/ and final/ never need it
            save_file(self._explorer_state(), folder / "explorenet.safetensors")
            _torch_save(self.explorer_optimizer.state_dict(), folder / "explorenet_optimizer.pt")
        with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
            self.adapter.save_trained(folder / "policy")  # what grid/eval load, like final/
        state = {"epoch": self.epoch, "history": self.history, "evals": self.evals,
                 "num_processes": acc.num_processes, "rng_shards": len(self.shards) * acc.num_processes,
                 "files": {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                           if p.is_file()}, "sha256": folder_sha256(folder),
                 "elapsed_s": self.resumed_seconds + time.time() - self.session_start}
        (folder / "state.json").write_text(json.dumps(state))
        _fsync([*sorted(p for p in folder.rglob("*") if p.is_file()), folder])  # data on disk before the rename

    def _prune_checkpoints(self) -> None:
        """Keep the newest ``checkpoints_kept``; remove what killed runs left behind (*.tmp, *.old)."""
        folder, kept = self.out / "checkpoints", self.config.checkpoints_kept
        for old in checkpoint_folders(folder)[:-kept] if kept > 0 else []:
            _remove_folder(old)
        for stale in folder.glob("epoch-*"):
            if stale.suffix in (".tmp", ".old"):
                shutil.rmtree(stale, ignore_errors=True)

    def resume(self, resume: str) -> None:
        """Continue from ``resume``: a checkpoint folder, or "auto": the newest checkpoint in
        output_dir that every process reads completely. With "auto", a newer checkpoint that cannot
        be read is reported and skipped (never deleted); if checkpoints exist but none can be read,
        CheckpointError. With nothing saved yet, "auto" starts afresh."""
        if resume == "auto":
            candidates = checkpoint_folders(self.out / "checkpoints")[::-1]
            if not candidates:
                return
        else:
            path = Path(resume)
            if not (path / "state.json").is_file():
                raise FileNotFoundError(f"no checkpoint at {path.resolve()} (expected state.json inside)")
            candidates = [path]
        reasons = []
        for path in candidates:
            try:
                loaded, error = self.read_checkpoint(path), None
            except CheckpointError as e:
                loaded, error = None, e
            if not self._across_processes([error is not None]).any():  # all processes agree on one checkpoint
                self._apply_checkpoint(loaded)
                if self.accelerator.is_main_process:
                    tqdm.write(f"resuming from {path} (epoch {self.epoch})")
                return
            if error is not None:
                print(f"flowalign: resume: skipping {path}: {error}", file=sys.stderr, flush=True)
            if resume != "auto":
                raise error or CheckpointError(f"{path}: another process could not read its part (see its message)")
            reasons.append(f"{path.name}: {error or 'another process could not read its part'}")
        raise CheckpointError(f"no readable checkpoint in {self.out / 'checkpoints'} ({'; '.join(reasons)}). Nothing "
                              "was deleted: move the broken folders away to start afresh, or set resume= to one")

    def load_checkpoint(self, path: Path) -> None:
        """Read and apply one checkpoint (CheckpointError, naming the file, if any part is unreadable)."""
        self._apply_checkpoint(self.read_checkpoint(Path(path)))

    def read_checkpoint(self, path: Path) -> dict:
        """Everything this process needs from ``path``, read and checked before any of it is applied:
        the manifest's sizes and hashes, every safetensors header, the optimizer (``weights_only``: tensors
        and plain containers, no pickled code), finite weights. Raises CheckpointError naming the
        file; ValueError when the checkpoint is fine but was written by another process layout."""
        acc = self.accelerator
        state = _read_json(path / "state.json")
        if not isinstance(state, dict) or not {"epoch", "history", "evals", "num_processes"} <= set(state):
            raise CheckpointError(f"{path / 'state.json'}: not a flowalign checkpoint state (epoch, history, evals, "
                                  "num_processes)")
        shards = len(self.shards) * acc.num_processes
        if state["num_processes"] != acc.num_processes:
            raise ValueError(f"{path} was written by {state['num_processes']} processes; resume with the same "
                             f"number (got {acc.num_processes}) so every random stream continues")
        if state.get("rng_shards", state["num_processes"]) != shards:
            raise ValueError(f"{path} was written with train.rng_shards={state.get('rng_shards')}; resume with the "
                             f"same (got {shards}) so every random stream continues")
        for name, size in state.get("files", {}).items():  # checkpoints before the manifest have none
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)")
            if file.stat().st_size != size:
                raise CheckpointError(f"{file}: {file.stat().st_size} bytes, {size} when written (truncated or "
                                      "overwritten)")
        if (changed := sha256_mismatch(path, state.get("sha256", {}))) is not None:  # same size, other bytes
            raise CheckpointError(changed)
        # all on the CPU ("cpu:0", a multi-CPU run's device, is no map location): loading copies into place
        trained = _read_safetensors(path / "trained.safetensors")
        if not all(torch.isfinite(v).all() for v in trained.values()):
            raise CheckpointError(f"{path / 'trained.safetensors'}: holds NaN/Inf weights")
        expected = {} if self.accelerator.distributed_type == DistributedType.FSDP else \
            {k: tuple(v.shape) for k, v in self.adapter.trained_state_dict().items()}
        if expected and expected != {k: tuple(v.shape) for k, v in trained.items()}:
            raise CheckpointError(f"{path / 'trained.safetensors'}: its tensors do not fit this model (another "
                                  "model.lora_rank, lora_targets or model?)")
        optimizer = _read_torch(path / (f"optimizer-rank{acc.process_index}.pt" if self._sharded else "optimizer.pt"))
        rng = [_read_safetensors(_first_file(path / f"rng-shard{s}.safetensors", path / f"rng-rank{s}.safetensors"))
               for s in self.shards]
        trackers = None
        if self.trackers is not None:  # old checkpoints: one tracker (the main process's) in state.json
            trackers = [_read_json(path / f"tracker-shard{s}.json") if (path / f"tracker-shard{s}.json").is_file()
                        else state.get("stat_tracker") or {} for s in self.shards]
        return {"state": state, "trained": trained, "optimizer": optimizer, "rng": rng, "trackers": trackers,
                "ema": _read_safetensors(path / "ema.safetensors") if self.ema is not None else None,
                "old": _read_safetensors(path / "old.safetensors") if self.old is not None else None,
                "routing": _read_torch(path / "routing.pt") if self.router is not None else None,
                "explorer": (_read_safetensors(path / "explorenet.safetensors"),
                             _read_torch(path / "explorenet_optimizer.pt")) if self.explorer is not None else None}

    def _apply_checkpoint(self, loaded: dict) -> None:
        with self._full_params(writeback=True):
            self.adapter.load_trained_state_dict(loaded["trained"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        if self.ema is not None:
            self.ema.load_state_dict(loaded["ema"])
        if self.old is not None:
            self.old.load_state_dict(loaded["old"])
        if self.router is not None:
            self.router.load_state_dict(loaded["routing"])
            self._set_layer_scales()
        if self.explorer is not None:
            self.explorer.load_state_dict(loaded["explorer"][0])
            self.explorer_optimizer.load_state_dict(loaded["explorer"][1])
        for streams, states in zip(self.streams, loaded["rng"]):
            for name, g in streams.items():
                g.set_state(states[name])
        self.plan_generator.set_state(loaded["rng"][0]["plan"])
        for tracker, state in zip(self.trackers or [], loaded["trackers"] or []):
            tracker.load_state_dict(state)
        state = loaded["state"]
        self.epoch, self.history, self.evals = state["epoch"], state["history"], state["evals"]
        self.resumed_seconds = state.get("elapsed_s", self._train_seconds())  # older checkpoints: the epochs'

    # -- outputs -------------------------------------------------------------------------
    def _write_outputs(self, seconds: float) -> dict:
        acc = self.accelerator
        summary = {"before": self.evals.get("before"), "after": self.evals.get("after"),
                   "evals": self.evals, "train_minutes": seconds / 60, "epochs": self.epoch,
                   "environment": {**run_environment(), "processes": acc.num_processes}}
        with self._full_params():
            if acc.is_main_process:
                with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                    self.adapter.save_trained(self.out / "final")
                if self.explorer is not None:  # kept for inspection; sampling from final/ never needs it
                    (self.out / "explorenet").mkdir(exist_ok=True)
                    save_file(self._explorer_state(), self.out / "explorenet" / "explorenet.safetensors")
                    (self.out / "explorenet" / "config.json").write_text(json.dumps(to_dict(self.config.explore)))
            acc.wait_for_everyone()
        if acc.is_main_process:
            before, after = summary["before"], summary["after"]
            if before and after:
                summary["delta"] = {k: after[k] - before[k] for k in after
                                    if isinstance(after[k], float) and isinstance(before.get(k), float)}
            grids = {**load_grids(self.out / "grids", ("before",)), **getattr(self, "_grids", {})}  # resumed: on disk
            if "before" in grids and "after" in grids:
                side_by_side({"before": grids["before"], "after": grids["after"]}).save(
                    self.out / "grids" / "before_after.png")
            (self.out / "metrics.json").write_text(json.dumps(finite_json(summary), indent=2))  # NaN → null
            with open(self.out / "history.jsonl", "w") as f:
                f.writelines(json.dumps(finite_json(h)) + "\n" for h in self.history)
        return summary


def run_environment() -> dict:
    """What a run's numbers depend on besides its config and seed: torch's CPU threads (the split
    of floating-point sums), torch's version and the instruction set its CPU kernels use."""
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _family_prediction(family: str) -> str | None:
    """The ``prediction`` of a family's adapter class (None for an unknown family: the error comes
    when the adapter is looked up)."""
    try:
        return getattr(adapter_class(family), "prediction", "velocity")
    except KeyError:
        return None


def masked_trained_steps(num_steps: int, schedule: str) -> list[int]:
    """The unmasking steps that unmask at least one position of a fully masked sequence (the
    trainer's rollouts: prompts carry no partial board, so every sample follows these counts); a
    step that unmasks nothing (e.g. the first cosine step) has no log-prob to train."""
    from flowalign.chess.tokenizer import SEQ_LEN
    from flowalign.samplers.unmasking import unmask_counts

    counts = unmask_counts(torch.tensor([SEQ_LEN]), num_steps, schedule)[0]
    return [j for j in range(num_steps) if counts[j + 1] > counts[j]]


def local_shards(shards: int, processes: int, rank: int, groups_per_epoch: int, train_batch_size: int) -> list[int]:
    """The shards process ``rank`` rolls out: a contiguous run, so gathering in rank order keeps
    the shard order. Raises ConfigError when the numbers do not divide."""
    if shards % processes:
        raise ConfigError(f"config: train.rng_shards ({shards}) must be a multiple of the number of processes "
                          f"({processes})")
    per_process = shards // processes
    for key, value in (("train.groups_per_epoch", groups_per_epoch), ("train.train_batch_size", train_batch_size)):
        if value % per_process:
            raise ConfigError(f"config: {key} ({value}) must be a multiple of the shards per process ({per_process})")
    return list(range(rank * per_process, (rank + 1) * per_process))


def shard_generators(seed: int, shard: int) -> dict[str, torch.Generator]:
    """A shard's streams: prompt choice, initial and SDE noise, minibatch shuffling. Shard r is
    seeded as rank r was before shards existed, so one-shard-per-process runs are unchanged."""
    return {name: torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + offset)
            for offset, name in enumerate(("prompts", "noise", "shuffle"))}


def checkpoint_folders(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first (by epoch number, not by name)."""
    found = [(int(m.group(1)), p) for p in folder.glob("epoch-*") if (m := CHECKPOINT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _replace_folder(src: Path, dst: Path) -> None:
    """Rename ``src`` onto ``dst``. An existing ``dst`` is first renamed aside to ``*.old``, so a
    crash at any moment leaves each folder either complete under its name or ignored."""
    if dst.exists():
        _remove_folder(dst, then=lambda: os.replace(src, dst))
    else:
        os.replace(src, dst)


def _remove_folder(path: Path, then=None) -> None:
    """Rename aside (``*.old``, atomic), run ``then``, delete: never a half-deleted checkpoint under its name."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    if then is not None:
        then()
    shutil.rmtree(old, ignore_errors=True)


def _fsync(paths: list[Path]) -> None:
    """Flush files and folders to disk, so that after a power loss a renamed checkpoint holds its
    data rather than empty files (which the manifest would catch, falling back one checkpoint)."""
    for path in paths:
        # a file's error counts (fsync may be where a full disk shows); a folder's is ignored, since
        # some systems cannot open or sync folders
        with contextlib.suppress(OSError) if path.is_dir() else contextlib.nullcontext():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def _is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception chain, also where a writer reports it only in its
    message (safetensors' Rust writer: "... (os error 28)")."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) \
                or any(text in str(error) for text in DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def _free_mb(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f}"
    except OSError:
        return "?"


@contextlib.contextmanager
def outputs_disk_full(out: Path):
    """A full disk while the run's outputs (final/, metrics.json, grids) are written raises
    DiskFullError, which says that the last checkpoint holds the run and resume=auto writes them."""
    try:
        yield
    except Exception as error:
        if not _is_disk_full(error):
            raise
        previous = checkpoint_folders(out / "checkpoints")
        raise DiskFullError(
            f"disk full while writing the run's outputs in {out} (final/, metrics.json, grids; free: {_free_mb(out)} "
            f"MB; {error}). The last checkpoint ({previous[-1] if previous else 'none'}) is complete: free some space "
            "and continue with resume=auto to write them") from error


def _torch_save(obj, path: Path) -> None:
    # through a Python file: a full disk then surfaces as OSError(ENOSPC) in the exception chain,
    # where torch.save(obj, path) reports only "unexpected pos"
    with open(path, "wb") as f:
        torch.save(obj, f)


def _first_file(*paths: Path) -> Path:
    return next((p for p in paths if p.is_file()), paths[0])


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)") from None
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: unreadable, not JSON ({error}); the file is corrupt") from error


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable safetensors file ({error}); it is truncated or corrupt") from error


def _read_torch(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: unreadable ({first_line}); it is truncated or corrupt, or holds more than "
                              "tensors and plain containers") from error


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


def _prompt_vector(cond) -> torch.Tensor:
    """[B, P] one vector per prompt for EXPLORENET: the pooled embedding, else the mean token embedding."""
    tensors = cond.tensors
    return (tensors["pooled"] if "pooled" in tensors else tensors["embeds"].mean(dim=1)).float()


def latent_diversity(latents: torch.Tensor, seeds: int) -> float:
    """Mean over prompts of the mean pairwise RMS distance between the final latents of its
    ``seeds`` samples (latents [P·seeds, ...], grouped by prompt). Collapse to one image per
    prompt drives it to 0; it is a cheap, model-agnostic stand-in for perceptual diversity."""
    x = latents.float().flatten(1).view(-1, seeds, latents[0].numel())
    d = torch.cdist(x, x) / x.shape[-1] ** 0.5  # [P, seeds, seeds]
    return (d.sum(dim=(1, 2)) / (seeds * (seeds - 1))).mean().item()


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
