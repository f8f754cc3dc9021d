"""The epoch sampler: one loop that draws this process's prompt groups shard by shard and turns
them into scored samples, whatever the objective trains on.

Rollout kinds (an objective's ``rollout``): ``"sde"`` and ``"ode"`` run the flow / DDIM sampler
of ``flowalign.rollout`` with the step plan of ``sampling`` (stochastic steps with log-probs where
η > 0; η = 0 is the ODE); ``"unmasking"`` runs masked discrete diffusion
(``pipelines.unmasking``: the plan and the categorical draws from the shard's noise
stream); ``"offline"`` draws pre-generated groups (``flowalign.offline``) and samples nothing.
An objective that asks for a tree (its ``tree_shape``) gets each prompt group of an ``"sde"`` /
``"ode"`` epoch as one tree rollout sharing prefixes (``flowalign.samplers.tree``).
Scoring is written once: one worker thread scores chunk k (a remote call, a CPU verifier) while
chunk k + 1 samples. ``flowalign generate-groups`` uses this sampler too.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flowalign.advantages import combine_rewards
from flowalign.config import RunConfig
from flowalign.rollout import Trajectory, group_noise, rollout, tree_rollout
from flowalign.samplers.steps import StepPlan, plan_steps, sliding_window_start
from flowalign.samplers.tree import TreeShape
from pipelines.base import decode_samples, encode_records
from pipelines.unmasking import MaskedTrajectory
from reward_models.base import reward_output

@dataclass
class EpochBatch:
    """One epoch's rollouts on this process. traj: B samples; specs: B prompt records;
    rewards [B] (NaN = dropped); components: {name: [B]}; group_ids [B] (global over processes)."""

    traj: Trajectory | MaskedTrajectory
    specs: list[dict]
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    group_ids: torch.Tensor


def reward_chunk(reward, samples, specs: list[dict]) -> dict[str, torch.Tensor]:
    """Score decoded ``samples`` of ``specs``: {component: float32 [b] on the CPU}."""
    out = reward_output(reward(samples, [p["prompt"] for p in specs], specs), f"reward {getattr(reward, 'name', '')!r}")
    return {k: torch.as_tensor(v, dtype=torch.float32).cpu() for k, v in out.items()}


def cat_components(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def masked_rollout(adapter, cond, sampling, generator: torch.Generator | None) -> MaskedTrajectory:
    """Unmask the states of ``cond`` (its fixed tokens kept) with the current weights; the plan
    and the categorical draws come from ``generator``. The family's work before and after the steps
    (``pipelines.base.Unmasking``: chess's best-move schedule) is its own; the trajectory keeps the
    conditioning the steps were sampled with, so rescoring sees what sampling saw."""
    from pipelines.unmasking import rollout as unmasking_rollout

    cond = adapter.begin_unmasking(cond, sampling)
    traj = unmasking_rollout(lambda x: adapter.predict(x, None, cond, sampling.guidance_scale),
                             adapter.initial_state(cond), sampling.num_steps, schedule=sampling.unmask_schedule,
                             temperature=sampling.temperature, generator=generator, cond=cond)
    traj.states[:, -1] = adapter.finish_unmasking(traj.states[:, -1], cond, sampling)
    return traj


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


class EpochSampler:
    """Draws and scores one epoch of this process's samples (``sample``)."""

    def __init__(self, config: RunConfig, adapter, encode, reward, dist, train_specs: list[dict]):
        self.config, self.adapter, self.encode, self.reward, self.dist = config, adapter, encode, reward, dist
        self.train_specs = train_specs
        self.prompt_weights = prompt_weights(train_specs, config.data.balance_tags)
        self.offline: dict | None = None  # pre-generated groups, for the "offline" rollout
        # a per-element SDE std multiplier from a training hook (experimental EXPLORENET): cond → fn(x, step)
        self.noise_scale = None

    def prepare(self, kind: str) -> None:
        """What a rollout kind reads once, before the run (the offline groups: errors come early)."""
        if kind == "offline" and self.offline is None:
            from flowalign.offline import load_groups

            self.offline = load_groups(self.config.data.offline_groups, self.config.train.group_size)

    def sample(self, epoch: int, kind: str, tree: TreeShape | None = None, keep_uncond: bool = False) -> EpochBatch:
        """One epoch of ``kind`` rollouts; ``tree`` (an objective's ``tree_shape``): each prompt group
        is one tree of that shape sampled from the group's shared initial noise (its leaves are the
        group; ``flowalign.rollout.tree_rollout``). ``keep_uncond``: "sde" / "ode" rollouts keep CFG's
        unconditional prediction per step (``Trajectory.uncond``)."""
        groups = self.config.train.groups_per_epoch // len(self.dist.shards)
        if kind == "unmasking":
            return self._epoch(groups, lambda cond, noise, sl, streams: masked_rollout(
                self.adapter, cond[sl], self.config.sampling, streams["noise"]))
        if kind == "offline":
            return self._offline_epoch(groups)
        s, t = self.config.sampling, self.config.train
        schedule = self.adapter.schedule(s.num_steps)
        # one plan for a shard's samples from the generator all processes share: every shard trains the same steps
        window_start = s.window_start
        if s.step_mode == "window" and s.window_shift_every:
            window_start = sliding_window_start(epoch, s.num_steps, s.window_size, s.window_shift_every,
                                                s.window_stride, s.window_start or 0)
        plan = plan_steps(s.num_steps, groups * t.group_size, s.eta, s.step_mode, fraction=s.fraction,
                          window_size=s.window_size, window_start=window_start, generator=self.dist.plan_generator,
                          window_range=None if s.window_range is None else tuple(s.window_range))

        if keep_uncond and tree is not None:
            raise ValueError("a tree rollout does not keep the unconditional predictions (keep_uncond)")

        def flow(cond, noise, sl, streams):
            if tree is not None:  # a rollout batch holds whole groups, whose rows share one initial noise
                if self.noise_scale is not None:
                    raise ValueError("a tree rollout has no per-element exploration std (EXPLORENET)")
                return tree_rollout(self.adapter, cond[sl], noise[sl][::t.group_size], schedule,
                                    StepPlan(plan.noise_levels, plan.trained[sl]), tree, guidance_scale=s.guidance_scale,
                                    generator=streams["noise"], sde=s.sde, reduction=s.log_prob_reduction)
            scale = self.noise_scale(cond[sl]) if self.noise_scale is not None else None
            return rollout(self.adapter, cond[sl], noise[sl], schedule, StepPlan(plan.noise_levels, plan.trained[sl]),
                           guidance_scale=s.guidance_scale, generator=streams["noise"], sde=s.sde,
                           reduction=s.log_prob_reduction, noise_scale=scale, keep_uncond=keep_uncond,
                           precision=s.autocast, low_precision_stochastic=kind == "ode", merge=not self.dist.sharded)

        return self._epoch(groups, flow)

    def _epoch(self, groups: int, roll) -> EpochBatch:
        """Each shard's groups from its own streams, rolled out ``sample_batch_size`` at a time by
        ``roll(cond, noise, slice, streams)``, decoded and scored in a worker thread."""
        t = self.config.train
        self.adapter.model.eval()
        parts, specs, scored = [], [], []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for shard, streams in zip(self.dist.shards, self.dist.streams):
                shard_specs, cond, noise = self.draw_groups(shard, streams, groups)
                for lo in range(0, len(shard_specs), t.sample_batch_size):
                    sl = slice(lo, lo + t.sample_batch_size)
                    part = roll(cond, noise, sl, streams)
                    parts.append(part)
                    decoded = decode_samples(self.adapter, part.samples, part.cond)
                    scored.append(pool.submit(reward_chunk, self.reward, decoded, shard_specs[sl]) if t.async_reward
                                  else _done(reward_chunk(self.reward, decoded, shard_specs[sl])))
                specs += shard_specs
            components = cat_components([f.result() for f in scored])
        rewards, _ = combine_rewards(components, self.config.reward.weights)
        return EpochBatch(type(parts[0]).cat(parts), specs, rewards, components,
                          torch.tensor([spec["group_id"] for spec in specs]))

    def draw_groups(self, shard: int, streams: dict[str, torch.Generator], groups: int):
        """A shard's prompt groups: (specs, conditioning, initial noise), groups × group_size of each
        (the noise is drawn for every rollout kind, so the streams advance alike)."""
        t, s = self.config.train, self.config.sampling
        picks = torch.multinomial(self.prompt_weights, groups, replacement=True, generator=streams["prompts"]).tolist()
        # group_id (unique over all shards) tells group-level rewards (Pref-GRPO win rates) which samples compete
        specs = [{**self.train_specs[i], "group_id": shard * groups + k} for k, i in enumerate(picks)
                 for _ in range(t.group_size)]
        cond = encode_records(self.encode, [self.train_specs[i] for i in picks]).repeat_interleave(t.group_size)
        noise = group_noise(self.adapter, groups, t.group_size, streams["noise"], s.shared_group_noise)
        return specs, cond, noise

    def _offline_epoch(self, groups: int) -> EpochBatch:
        """Each shard draws ``groups`` of the pre-generated groups (uniformly, with replacement,
        from its prompt stream); nothing is sampled."""
        self.prepare("offline")
        data, k = self.offline, self.config.train.group_size
        schedule = self.adapter.schedule(self.config.sampling.num_steps)
        picks, specs = [], []
        for shard, streams in zip(self.dist.shards, self.dist.streams):
            chosen = torch.randint(len(data["specs"]), (groups,), generator=streams["prompts"]).tolist()
            picks += chosen
            specs += [{**data["specs"][g], "group_id": shard * groups + i} for i, g in enumerate(chosen) for _ in range(k)]
        device = self.dist.device
        index = torch.tensor(picks)
        samples = data["samples"][index].flatten(0, 1).to(device)  # [groups·k, ...]
        components = {name: values[index].flatten() for name, values in data["components"].items()}
        cond = encode_records(self.encode, [data["specs"][g] for g in picks]).repeat_interleave(k)
        traj = Trajectory(samples[:, None], torch.zeros(len(samples), 0, device=device),
                          torch.zeros(len(samples), 0, dtype=torch.bool, device=device), torch.zeros(0),
                          schedule.sigmas, schedule.timesteps, cond)
        rewards, _ = combine_rewards(components, self.config.reward.weights)
        return EpochBatch(traj, specs, rewards, components, torch.tensor([spec["group_id"] for spec in specs]))
