"""Rewards → advantages: weighted combination, group normalisation, per-prompt tracking.

Shapes: B samples; ``group_ids`` [B] long (samples of one prompt's group share an id; the
trainer gathers every rank's samples before calling these, so groups may span ranks).
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch


def combine_rewards(components: dict[str, torch.Tensor], weights: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum of named reward components.

    components: {name: float [B]}; weights: {name: w} (a name missing from ``components`` is an
    error; a component without a weight is logged but not optimised). Returns (total [B],
    valid [B] bool), where a sample is invalid if any *weighted* component is NaN or ±Inf; its
    total is then NaN too.
    """
    missing = sorted(set(weights) - set(components))
    if missing:
        raise KeyError(f"reward weights name {missing}, but the rewards returned {sorted(components)}")
    first = next(iter(components.values()))
    total = torch.zeros_like(first, dtype=torch.float32)
    valid = torch.ones_like(first, dtype=torch.bool)
    for name, weight in weights.items():
        value = components[name].float()
        valid &= torch.isfinite(value)
        total = total + weight * torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(valid, total, torch.full_like(total, float("nan"))), valid


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_i = (r_i − mean of i's group) / (std + eps), clipped to ±clip.

    rewards: [B] (NaN = dropped sample: its advantage is 0 and it is left out of every
    statistic); group_ids: [B]. ``global_std``: divide by the std over the whole batch instead of
    the group's (Flow-GRPO's ``global_std``). Std is the population std (ddof 0). Returns
    (advantages [B], stats) with the fraction of groups whose rewards do not vary and the mean
    within-group std.
    """
    valid = torch.isfinite(rewards)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    batch_std = rewards[valid].float().std(unbiased=False) if valid.any() else torch.tensor(0.0)
    zero_spread, n_groups, std_sum = 0, 0, 0.0
    for gid in torch.unique(group_ids[valid]):
        members = valid & (group_ids == gid)
        r = rewards[members].float()
        std = r.std(unbiased=False)
        n_groups += 1
        zero_spread += int(std.item() < 1e-8)
        std_sum += std.item()
        scale = (batch_std if global_std else std) + eps
        adv[members] = (r - r.mean()) / scale if scale > 0 else 0.0  # a constant group teaches nothing
    adv = adv.clamp(-clip, clip)
    return adv, {"zero_spread_groups": zero_spread / max(n_groups, 1), "group_std": std_sum / max(n_groups, 1),
                 "groups": float(n_groups)}


def leave_one_out_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-4,
    clip: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_i = r_i − mean of the *other* samples of i's group, optionally divided by the group's
    (population, ddof 0) std + eps, clipped to ±clip.

    rewards: [B] (NaN = dropped: advantage 0, left out of every statistic); group_ids: [B].
    A group with fewer than two valid samples gets 0 (and counts as a zero-spread group). Note r_i − mean_{j≠i} r_j =
    G/(G − 1)·(r_i − mean_group): the GRPO advantage scaled by G/(G − 1), unbiased because the
    baseline does not contain r_i. Returns (advantages [B], stats: groups, zero_spread_groups).
    """
    valid = torch.isfinite(rewards)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    n_groups, zero_spread = 0, 0
    for gid in torch.unique(group_ids[valid]):
        members = valid & (group_ids == gid)
        r = rewards[members].float()
        std = r.std(unbiased=False)
        n_groups += 1
        zero_spread += int(std.item() < 1e-8)  # a lone sample counts too: it teaches nothing
        if len(r) < 2:
            continue
        baseline = (r.sum() - r) / (len(r) - 1)
        if not scale_by_std:
            adv[members] = r - baseline
        elif std + eps > 0:  # a constant group (r_i = baseline) stays 0 even with eps = 0
            adv[members] = (r - baseline) / (std + eps)
    return adv.clamp(-clip, clip), {"groups": float(n_groups), "zero_spread_groups": zero_spread / max(n_groups, 1)}


def extremes_mask(rewards: torch.Tensor, group_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """DanceGRPO's best-of-N: True for the ``keep`` highest and ``keep`` lowest rewards of each
    group (ties broken by position). rewards: [B] (NaN = dropped, never kept); group_ids: [B].
    Returns bool [B]; a group with at most 2·keep valid samples keeps them all."""
    mask = torch.zeros_like(rewards, dtype=torch.bool)
    valid = torch.isfinite(rewards)
    for gid in torch.unique(group_ids):
        members = torch.nonzero(valid & (group_ids == gid)).flatten()
        order = members[rewards[members].argsort(stable=True)]
        mask[order[:keep]] = True
        mask[order[-keep:] if keep > 0 else order[:0]] = True
    return mask


class PerPromptStatTracker:
    """DDPO's per-prompt reward buffer: normalise each reward by its prompt's recent history.

    While a prompt has fewer than ``min_count`` rewards in its buffer, the batch's statistics are
    used instead. The state is plain JSON (prompt → list of floats) so it goes into checkpoints.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16, eps: float = 1e-4, clip: float = 5.0):
        self.buffer_size, self.min_count, self.eps, self.clip = buffer_size, min_count, eps, clip
        self.buffers: dict[str, deque] = defaultdict(lambda: deque(maxlen=buffer_size))

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """prompts: B strings; rewards: [B] (NaN = dropped). Returns advantages [B]."""
        valid = torch.isfinite(rewards)
        adv = torch.zeros_like(rewards, dtype=torch.float32)
        batch = rewards[valid].float()
        for prompt in dict.fromkeys(p for p, ok in zip(prompts, valid.tolist()) if ok):
            idx = torch.tensor([p == prompt and ok for p, ok in zip(prompts, valid.tolist())])
            self.buffers[prompt].extend(rewards[idx].tolist())
            history = torch.tensor(list(self.buffers[prompt]))
            ref = history if len(history) >= self.min_count else batch
            adv[idx] = (rewards[idx].float() - ref.mean()) / (ref.std(unbiased=False) + self.eps)
        return adv.clamp(-self.clip, self.clip)

    def state_dict(self) -> dict:
        return {p: list(b) for p, b in self.buffers.items()}

    def load_state_dict(self, state: dict) -> None:
        self.buffers.clear()
        for prompt, values in state.items():
            self.buffers[prompt].extend(values)


class Advantages:
    """Rewards → advantages over every process's samples (a group lives on one shard, its id is
    unique over all of them): group-normalised (GRPO), leave-one-out (masked DDPO) or per prompt
    (DDPO's tracker, ``train.per_prompt_stats``: one tracker per shard, checkpointed as
    ``tracker-shard{s}.json``), one column per weighted reward with ``train.per_reward_advantages``,
    only each group's extremes with ``train.keep_extremes``."""

    checkpoint_format = "json"

    def __init__(self, config, dist):
        self.train, self.weights, self.dist = config.train, config.reward.weights, dist
        # per shard, like the streams: a prompt's reward history is kept where its samples are drawn
        self.trackers = [PerPromptStatTracker(clip=self.train.advantage_clip) for _ in dist.shards] \
            if self.train.per_prompt_stats else None

    def __call__(self, batch) -> tuple[torch.Tensor, dict]:
        """This process's share: [B], or [B, C] with one column per weighted reward, NaN where a
        sample must not train: its reward was dropped, its advantage is not finite
        (``adv/nonfinite``), or it is not among its group's extremes. Also the reward statistics."""
        t, dist = self.train, self.dist
        rewards, group_ids = dist.gather(batch.rewards), dist.gather(batch.group_ids)
        stats, gathered = {}, {}
        for name, values in batch.components.items():
            gathered[name] = values = dist.gather(values)
            ok = torch.isfinite(values)
            stats[f"reward/{name}"] = values[ok].mean().item() if ok.any() else float("nan")
        valid = torch.isfinite(rewards)
        stats["reward/mean"] = rewards[valid].mean().item() if valid.any() else float("nan")
        stats["reward/std"] = rewards[valid].std(unbiased=False).item() if valid.any() else float("nan")
        stats["reward/dropped_nan"] = int((~valid).sum())
        n = len(batch.specs)
        mine = dist.mine(n)  # this process's part of the gathered batch
        if self.trackers is not None:
            size = n // len(self.trackers)
            local = torch.cat([tracker.update([spec["prompt"] for spec in batch.specs[k * size:(k + 1) * size]],
                                              batch.rewards[k * size:(k + 1) * size])
                               for k, tracker in enumerate(self.trackers)])
        else:
            # a sample dropped for one weighted component is dropped for all (combine_rewards' NaN)
            columns = [torch.where(valid, gathered[name], float("nan")) for name in self.weights] \
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
        every = dist.across_processes([float(nonfinite.sum()), torch.nan_to_num(local).abs().mean().item()])
        stats["adv/nonfinite"] = int(every[:, 0].sum())
        stats["adv/abs_mean"] = every[:, 1].mean().item()
        return local, stats

    # per-shard checkpoint state (flowalign.checkpoint)
    def shard_state(self, k: int) -> dict:
        return self.trackers[k].state_dict()

    def load_shard_state(self, k: int, state: dict) -> None:
        self.trackers[k].load_state_dict(state)
