"""Pref-GRPO rewards: each sample's mean win rate against the other members of its group.

A pairwise preference model ``prefer(images_a, images_b, prompts) -> P(a beats b)`` [P] is
turned into per-sample rewards: within a group of n, sample i's win rate is
``mean_{j ≠ i} P(i beats j)`` in [0, 1], so a group's win rates sum to n / 2 when
P(j beats i) = 1 − P(i beats j). Why: group normalisation blows tiny score gaps up to
unit-size advantages ("illusory advantage"); a win rate is bounded and says how often a sample
is preferred within its group.

Groups (samples of one group contiguous): ``group_size`` when given (B must be a multiple),
else every sample's ``metadata["group_id"]`` when all have one (the trainer sets it), else
runs of identical consecutive prompts. A sample with no valid opponent scores NaN. The trainer
scores ``train.sample_batch_size`` samples per call: keep it a multiple of ``train.group_size``
so that no group is split across calls.

Against the authors' code (github CodeGoat24/Pref-GRPO: ``cal_win_rate`` and the ``use_group``
advantages in fastvideo/train_flux_pref_grpo.py at 6c87cfe, the paper's; the same at 3e787f6 in
fastvideo/rewards/unifiedreward_think.py and dispatcher.py), term by term:

    pairs        every unordered pair i < j of a group once (itertools.combinations): no self-play
    verdict      the named image wins 1; an answer naming neither image, or none, gives ½ each
    win rate     w_i = Σ_{j≠i} P(i ≻ j) / (G − 1)          theirs rounded to 3 decimals, ours not
    advantage    A_i = (w_i − mean w) / (std w + ε), clamped to ±5, within each prompt's group
                 theirs: torch's unbiased std, ε = 1e-8; ours (flowalign/advantages.py): the
                 population std, ε = 1e-4, so A_ours = sqrt(G / (G − 1))·A_theirs (1.07 at G = 8)
    with CLIP    theirs A = 0.7·A_win + 1.4·A_clip (0.4, 0.6 and a batch renormalisation at
                 3e787f6): ``train.per_reward_advantages`` (configs/flux_dev_pref_grpo_unifiedreward.yaml)

The constant factor scales every loss term alike, which AdamW's normalised step all but cancels;
the clamp cannot bind (|A| ≤ sqrt(G − 1) with the population std). An image without an opponent
scores 0 in theirs, NaN (dropped) here. tests/test_pref_grpo.py checks each line on hand-computed
groups. Hard verdicts make the win rates, and so the advantages, depend on the order of the
judge's underlying scores only: invariant to any increasing transform of them (not so at
temperature > 0 or for the pointwise group-normalised reward).

Rewards registered here:
``pref_grpo``: any preference model, named as ``"package.module:Class"`` with its kwargs.
``pref_win_rate``: the Bradley–Terry preference of a scalar reward,
P(a beats b) = sigmoid((r_a − r_b) / temperature) (temperature 0: hard wins, ties ½), computed
from one base-reward call per sample; the base reward's components are returned alongside.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from reward_models.base import Reward, build_reward, register_reward


class PreferenceModel(Protocol):
    def prefer(self, images_a: torch.Tensor, images_b: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images_a, images_b float [P, 3, H, W] in [0, 1]; P prompts → P(a beats b), float [P]."""
        ...


def group_ids(prompts: list[str], metadata: list[dict], group_size: int | None = None) -> torch.Tensor:
    """Group index of each sample, int64 [B] (rules in the module docstring).

    >>> group_ids(["a", "a", "b", "b", "b"], [{}] * 5).tolist()
    [0, 0, 1, 1, 1]
    >>> group_ids(["x"] * 4, [{}] * 4, group_size=2).tolist()
    [0, 0, 1, 1]
    """
    n = len(prompts)
    if group_size is not None:
        if group_size < 1 or n % group_size:
            raise ValueError(f"a batch of {n} samples does not split into groups of group_size={group_size}")
        return torch.arange(n) // group_size
    if metadata and all(isinstance(m, dict) and "group_id" in m for m in metadata):
        index: dict = {}
        return torch.tensor([index.setdefault(m["group_id"], len(index)) for m in metadata], dtype=torch.int64)
    starts = [i == 0 or prompts[i] != prompts[i - 1] for i in range(n)]
    return torch.tensor(starts, dtype=torch.int64).cumsum(0) - 1


def group_win_rates(prob: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """prob float [B, B] with prob[i, j] = P(i beats j) (read only where i, j share a group,
    i ≠ j; NaN = unknown); groups int [B] → mean win rate over valid opponents, float [B].

    >>> p = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.5], [0.0, 0.5, 0.0]])
    >>> group_win_rates(p, torch.zeros(3, dtype=torch.long)).tolist()
    [1.0, 0.25, 0.25]
    """
    opponents = (groups[:, None] == groups[None, :]) & ~torch.eye(len(groups), dtype=torch.bool)
    valid = opponents & torch.isfinite(prob)
    wins = torch.where(valid, prob, torch.zeros_like(prob)).sum(1)
    count = valid.sum(1)
    return torch.where(count > 0, wins / count.clamp(min=1), torch.full_like(wins, float("nan")))


def pairwise_probabilities(model: PreferenceModel, samples: torch.Tensor, prompts: list[str], groups: torch.Tensor,
                           pair_batch_size: int = 64) -> torch.Tensor:
    """Ask ``model`` about every unordered pair i < j within a group, in batches of
    ``pair_batch_size`` pairs. Returns prob float [B, B]: prob[i, j] = p, prob[j, i] = 1 − p,
    NaN elsewhere. samples float [B, 3, H, W]."""
    i, j = torch.triu_indices(len(groups), len(groups), offset=1)
    same = groups[i] == groups[j]
    i, j = i[same], j[same]
    prob = torch.full((len(groups), len(groups)), float("nan"))
    for lo in range(0, len(i), pair_batch_size):
        a, b = i[lo:lo + pair_batch_size], j[lo:lo + pair_batch_size]
        p = torch.as_tensor(model.prefer(samples[a], samples[b], [prompts[k] for k in a.tolist()]),
                            dtype=torch.float32).cpu()
        prob[a, b], prob[b, a] = p, 1 - p
    return prob


def bradley_terry(r_a: torch.Tensor, r_b: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """P(a beats b) = sigmoid((r_a − r_b) / temperature), elementwise with broadcasting
    (scores [B, 1] and [1, B] → the [B, B] matrix); temperature 0 gives hard wins (1, ½ on a
    tie, 0). A NaN score gives NaN.

    >>> bradley_terry(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), temperature=0).tolist()
    [0.5, 1.0]
    """
    diff = r_a.float() - r_b.float()
    if temperature == 0:
        return torch.where(torch.isnan(diff), diff, (torch.sign(diff) + 1) / 2)  # sign(NaN) is 0, not NaN
    return torch.sigmoid(diff / temperature)


class BradleyTerryPreference:
    """A ``PreferenceModel`` from a scalar reward's component (see ``bradley_terry``)."""

    def __init__(self, reward: Reward, component: str, temperature: float = 1.0):
        self.reward, self.component, self.temperature = reward, component, temperature

    def prefer(self, images_a, images_b, prompts):
        meta = [{} for _ in prompts]
        return bradley_terry(self.reward(images_a, prompts, meta)[self.component],
                             self.reward(images_b, prompts, meta)[self.component], self.temperature)


def _import(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"preference must be 'package.module:Class', got {spec!r}")
    return getattr(importlib.import_module(module), name)


@register_reward("pref_grpo")
class PrefGRPO(Reward):
    """Win rates from a pairwise preference model: ``preference`` is an object with ``prefer`` or
    an import string ``"package.module:Class"`` built with ``preference_kwargs``."""

    components = ("win_rate",)

    def __init__(self, preference, preference_kwargs: dict | None = None, group_size: int | None = None,
                 pair_batch_size: int = 64):
        if isinstance(preference, str):
            preference = _import(preference)(**(preference_kwargs or {}))
        self.preference = preference
        self.group_size, self.pair_batch_size = group_size, pair_batch_size

    def __call__(self, samples, prompts, metadata):
        groups = group_ids(prompts, metadata, self.group_size)
        prob = pairwise_probabilities(self.preference, samples, prompts, groups, self.pair_batch_size)
        return {"win_rate": group_win_rates(prob, groups)}


@register_reward("pref_win_rate")
class PrefWinRate(Reward):
    """Bradley–Terry win rates of a registered reward ``base`` (built with ``base_kwargs``), on its
    ``component`` (default: its only one). Returns ``win_rate`` and the base's components.

    >>> reward = PrefWinRate("jpeg_incompressibility", temperature=0)
    >>> flat = torch.full((1, 3, 32, 32), 0.5)
    >>> noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    >>> reward(torch.cat([flat, noisy]), ["p", "p"], [{}, {}])["win_rate"].tolist()
    [0.0, 1.0]
    """

    def __init__(self, base: str, base_kwargs: dict | None = None, component: str | None = None,
                 temperature: float = 1.0, group_size: int | None = None):
        self.base = build_reward(base, **(base_kwargs or {}))
        names = tuple(getattr(self.base, "components", ()))
        if component is None and len(names) != 1:
            raise ValueError(f"reward {base!r} returns {list(names)}: name the one to compare with component=...")
        self.component = component or names[0]
        if names and self.component not in names:
            raise ValueError(f"reward {base!r} returns {list(names)}, not {self.component!r}")
        if "win_rate" in names:
            raise ValueError(f"reward {base!r} already returns a 'win_rate' component")
        self.components = ("win_rate", *names)
        self.temperature, self.group_size = temperature, group_size

    def __call__(self, samples, prompts, metadata):
        scored = {k: torch.as_tensor(v, dtype=torch.float32).cpu()
                  for k, v in self.base(samples, prompts, metadata).items()}
        groups = group_ids(prompts, metadata, self.group_size)
        scores = scored[self.component]
        win = group_win_rates(bradley_terry(scores[:, None], scores[None, :], self.temperature), groups)
        return {"win_rate": win, **scored}
