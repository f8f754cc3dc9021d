"""The reward protocol and registry.

A reward is a callable ``reward(samples, prompts, metadata) -> dict[str, Tensor[B]]`` returning
one or more named components; configs weight the components and every component is logged.
Register one by name with ``@register_reward("name")``; a separately installed package can add
rewards through the ``flowalign.rewards`` entry-point group (``name = "module:Class"``).
"""

from __future__ import annotations

import inspect
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


REWARD_ARGUMENTS = ("samples", "prompts", "metadata")


def is_reward_function(obj) -> bool:
    """A plain function (not a class) whose first three parameters are ``samples, prompts,
    metadata``: a reward itself, not a factory that builds one."""
    if isinstance(obj, type) or not callable(obj):
        return False
    try:
        names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[:3]) == REWARD_ARGUMENTS


class FunctionReward(Reward):
    """A plain function ``fn(samples, prompts, metadata, **kwargs) -> dict | Tensor`` as a Reward.
    A tensor [B] becomes the component ``score`` (the default ``reward.weights``); ``kwargs`` are the
    function's own keyword arguments (``reward.kwargs``).

    >>> def redness(samples, prompts, metadata):
    ...     return samples[:, 0].mean((1, 2))
    >>> FunctionReward(redness)(torch.ones(2, 3, 4, 4), ["a", "b"], [{}, {}])
    {'score': tensor([1., 1.])}
    """

    def __init__(self, fn: Callable, **kwargs):
        self.fn, self.kwargs = fn, kwargs
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.components = tuple(getattr(fn, "components", ()))
        self.modality = getattr(fn, "modality", None)

    def __call__(self, samples, prompts, metadata) -> dict[str, torch.Tensor]:
        out = self.fn(samples, prompts, metadata, **self.kwargs)
        if isinstance(out, dict):
            return out
        if isinstance(out, torch.Tensor) and out.ndim == 1:
            return {"score": out}
        raise TypeError(f"reward function {self.name} must return a dict of [B] tensors or a tensor [B], got "
                        f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}")


class _FunctionFactory:
    """What the registry keeps for a reward function: called with ``reward.kwargs``, it returns the
    FunctionReward; its signature is the function's own keyword arguments (checked before loading)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        parameters = list(inspect.signature(fn).parameters.values())[len(REWARD_ARGUMENTS):]
        self.__signature__ = inspect.Signature(parameters)
        self.components = tuple(getattr(fn, "components", ()))
        self.modality = getattr(fn, "modality", None)

    def __call__(self, **kwargs) -> FunctionReward:
        return FunctionReward(self.fn, **kwargs)

    def __repr__(self) -> str:
        return f"reward function {getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', self.fn)}"


def as_reward(reward) -> Reward:
    """A Reward from a Reward object, or from a plain reward function (``is_reward_function``)."""
    return FunctionReward(reward) if is_reward_function(reward) else reward


def register_reward(name: str):
    """Class, factory or reward-function decorator: ``@register_reward("jpeg_compressibility")``.

    A plain function ``fn(samples, prompts, metadata, **options) -> dict | Tensor [B]`` is
    registered as-is (and returned unchanged); ``build_reward(name, **options)`` wraps it in a
    ``FunctionReward``. Anything else is a factory: ``build_reward(name, **kwargs)`` calls it."""

    def wrap(factory):
        known = _REGISTRY.get(name)
        if known is not None and getattr(known, "fn", known) is not factory:
            raise ValueError(f"reward {name!r} is already registered by {known!r}")
        if known is None:
            _REGISTRY[name] = _FunctionFactory(factory) if is_reward_function(factory) else factory
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
    import reward_models.shapes_edit  # noqa: F401
    import reward_models.video  # noqa: F401

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            loaded = ep.load()
            _REGISTRY[ep.name] = _FunctionFactory(loaded) if is_reward_function(loaded) else loaded


def available_rewards() -> list[str]:
    _load_builtins_and_plugins()
    return sorted(_REGISTRY)


def build_reward(name: str, **kwargs) -> Reward:
    """Instantiate a registered reward by name (built-in, plug-in, or registered in a script)."""
    _load_builtins_and_plugins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)
