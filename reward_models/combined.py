"""Several registered rewards as one: ``reward.components: {name: weight, ...}`` in a config
(flowalign/reward_components.py expands it into ``reward.name: combined`` with these arguments and
``reward.weights: {name: weight}``), as Flow-GRPO's ``{"pickscore": w, "ocr": w}`` and DanceGRPO's
HPS + CLIP.

Each sub-reward is built with its own keyword arguments and scores every batch. Its trained
component (``component``, default: its only declared component, else ``score``, else its first)
is returned under the reward's name; its other components under ``name/component`` (logged,
weight 0). With ``train.per_reward_advantages`` each named reward gets its own advantage.
"""

from __future__ import annotations

import torch

from reward_models.base import Reward, build_reward, register_reward, reward_output


def trained_component(declared: tuple[str, ...], chosen: str | None) -> str:
    """The component a sub-reward trains with (module docstring)."""
    if chosen:
        return chosen
    if len(declared) == 1:
        return declared[0]
    return "score" if "score" in declared or not declared else declared[0]


@register_reward("combined")
class CombinedReward(Reward):
    """``rewards``: {name: {"kwargs": {...}, "component": str or None}} of registered rewards."""

    def __init__(self, rewards: dict):
        self.rewards = {name: build_reward(name, **(spec.get("kwargs") or {})) for name, spec in rewards.items()}
        self.trained = {name: trained_component(tuple(getattr(r, "components", ())), rewards[name].get("component"))
                        for name, r in self.rewards.items()}
        self.components = tuple(self.rewards) + tuple(
            f"{name}/{c}" for name, r in self.rewards.items() for c in getattr(r, "components", ())
            if c != self.trained[name])
        modalities = {getattr(r, "modality", None) for r in self.rewards.values()} - {None}
        self.modality = modalities.pop() if len(modalities) == 1 else None

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        out = {}
        for name, reward in self.rewards.items():
            values = reward_output(reward(samples, prompts, metadata), f"reward {name!r}")
            if self.trained[name] not in values:
                raise KeyError(f"reward {name!r} returned {sorted(values)}, not its component "
                               f"{self.trained[name]!r} (reward.components.{name}.component)")
            for component, value in values.items():
                out[name if component == self.trained[name] else f"{name}/{component}"] = value
        return out
