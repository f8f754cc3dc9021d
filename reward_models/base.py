"""The reward protocol and registry.

A reward is a callable ``reward(samples, prompts, metadata) -> dict[str, Tensor[B]]`` returning
one or more named components; configs weight the components and every component is logged.
Register one by name with ``@register_reward("name")``; a separately installed package can add
rewards through the ``flowalign.rewards`` entry-point group (``name = "module:Class"``).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

import torch

_REGISTRY: dict[str, Callable[..., "Reward"]] = {}
ENTRY_POINT_GROUP = "flowalign.rewards"


class Reward:
    """Base class of rewards. Subclasses set ``components`` and implement ``__call__``.

    ``__call__(samples, prompts, metadata)``: samples are decoded outputs, in the layout of the
    model family that made them:

    * images: float [B, 3, H, W] in [0, 1] (sd3, sd, sdxl, flux);
    * videos: float [B, F, 3, H, W] in [0, 1], F frames in time order (wan; the layout of
      diffusers' ``output_type="pt"`` video frames);
    * boards: a list of B FEN strings (chess).

    prompts a list of B strings; metadata a list of B dicts. Returns ``{component: float
    Tensor [B]}``. A NaN marks a sample the reward could not score; the trainer drops such
    samples and counts them.

    ``modality``: the samples the reward scores, "image" or "video" (None: not declared, not
    checked). The trainer refuses an "image" reward for a video family before the model loads;
    ``per_frame`` (``reward_models/video.py``) applies an image reward to every frame instead.
    """

    components: tuple[str, ...] = ()
    modality: str | None = None

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def register_reward(name: str):
    """Class or factory decorator: ``@register_reward("jpeg_compressibility")``."""

    def wrap(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name]!r}")
        _REGISTRY[name] = factory
        return factory

    return wrap


def _load_builtins_and_plugins() -> None:
    import reward_models.aesthetic  # noqa: F401  (registers on import; heavy imports wait for a constructor)
    import reward_models.audio_video  # noqa: F401
    import reward_models.chess.reward  # noqa: F401  (Stockfish starts at the first call)
    import reward_models.clip_score  # noqa: F401
    import reward_models.edit_fidelity  # noqa: F401
    import reward_models.hps  # noqa: F401
    import reward_models.jpeg  # noqa: F401
    import reward_models.ocr  # noqa: F401
    import reward_models.pickscore  # noqa: F401
    import reward_models.pref_grpo  # noqa: F401
    import reward_models.remote  # noqa: F401
    import reward_models.shapes  # noqa: F401
    import reward_models.video  # noqa: F401

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def available_rewards() -> list[str]:
    _load_builtins_and_plugins()
    return sorted(_REGISTRY)


def build_reward(name: str, **kwargs) -> Reward:
    """Instantiate a registered reward by name (built-in, plug-in, or registered in a script)."""
    _load_builtins_and_plugins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)
