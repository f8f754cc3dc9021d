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
