"""The reward protocol and registry.

A reward is a callable ``reward(samples, prompts, metadata) -> dict[str, Tensor[B]]`` returning
one or more named components; configs weight the components and every component is logged.
Register one by name with ``@register_reward("name")``; a separately installed package can add
rewards through the ``flowalign.rewards`` entry-point group (``name = "module:Class"``).
Built-in rewards (``BUILTIN_REWARDS``) and plug-ins are looked up by name and imported only when
asked for (``reward_factory``), so an optional package that is missing (chess, scipy, open_clip,
pytesseract) costs only the rewards that need it, which say what to install.
"""

from __future__ import annotations

import importlib
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
        return reward_output(self.fn(samples, prompts, metadata, **self.kwargs), f"reward function {self.name}")


def reward_output(out, who: str = "the reward") -> dict:
    """A reward call's result as {component: [B]}: a dict as it is; a tensor [B] or a list of
    numbers as the component ``score``; TRL's ``(rewards, metadata)`` pair as its rewards (the
    metadata dropped). Anything else: TypeError naming ``who`` and what it returned.

    >>> reward_output(([0.5, 1.0], {"note": "TRL's DDPO convention"}))
    {'score': tensor([0.5000, 1.0000])}
    """
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (dict, list, type(None))):
        out = out[0]  # TRL's reward functions return (rewards, reward_metadata)
    if isinstance(out, dict):
        return out
    if isinstance(out, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in out):
        out = torch.tensor(out, dtype=torch.float32)
    if isinstance(out, torch.Tensor) and out.ndim == 1:
        return {"score": out}
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ""
    raise TypeError(f"{who} must return a dict of [B] tensors, a tensor [B] or a list of B numbers (or TRL's "
                    f"(rewards, metadata) pair), got {type(out).__name__}{shape}")


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
        builtin = BUILTIN_REWARDS.get(name)
        if builtin is not None and getattr(factory, "__module__", None) != builtin:
            raise ValueError(f"reward {name!r} is a built-in ({builtin}); register yours under another name")
        known = _REGISTRY.get(name)
        if known is not None and getattr(known, "fn", known) is not factory:
            raise ValueError(f"reward {name!r} is already registered by {known!r}")
        if known is None:
            _REGISTRY[name] = _FunctionFactory(factory) if is_reward_function(factory) else factory
        return factory

    return wrap


# Built-in rewards by name → the module that registers them. A module is imported only when one of
# its rewards is asked for, so a missing optional package costs only its own rewards.
BUILTIN_REWARDS = {
    "aesthetic": "reward_models.aesthetic",
    "audio_video": "reward_models.audio_video",
    "chess_puzzle": "reward_models.chess.reward",
    "clip_score": "reward_models.clip_score",
    "combined": "reward_models.combined",
    "edit_fidelity": "reward_models.edit_fidelity",
    "hpsv2": "reward_models.hps",
    "jpeg_compressibility": "reward_models.jpeg",
    "jpeg_incompressibility": "reward_models.jpeg",
    "ocr": "reward_models.ocr",
    "per_frame": "reward_models.video",
    "pickscore": "reward_models.pickscore",
    "pref_grpo": "reward_models.pref_grpo",
    "pref_win_rate": "reward_models.pref_grpo",
    "remote": "reward_models.remote",
    "shapes": "reward_models.shapes",
    "shapes_edit": "reward_models.shapes_edit",
    "temporal_consistency": "reward_models.video",
}
# the optional packages a built-in reward needs (import name), checked before its module loads: some
# import them only when the reward is built (open_clip, pytesseract), and a dry run must see it
REWARD_PACKAGES = {"chess_puzzle": ("chess",), "clip_score": ("open_clip",), "hpsv2": ("open_clip",),
                   "ocr": ("pytesseract",), "shapes": ("scipy",), "shapes_edit": ("scipy",)}
INSTALL = {"chess": "pip install 'chess>=1.10'  (python-chess; the engine: apt-get install stockfish)",
           "open_clip": "pip install 'flowalign[clip]'  (open-clip-torch)",
           "pytesseract": "pip install 'flowalign[ocr]'  (the binary: apt-get install tesseract-ocr)",
           "scipy": "pip install 'scipy>=1.10'"}


class MissingRewardPackage(ImportError):
    """A reward's optional package is not installed; the message names it and the pip line."""


def _importable(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None  # None too for a sys.modules[name] = None block
    except (ImportError, ValueError):
        return False


def _missing(name: str, package: str) -> MissingRewardPackage:
    install = INSTALL.get(package, f"pip install {package}")
    return MissingRewardPackage(f"reward {name!r} needs the Python package {package!r}, which is not installed "
                                f"(the other rewards work without it): {install}")


def _plugins() -> dict:
    """The ``flowalign.rewards`` entry points by name (not loaded: a broken plug-in costs only itself)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_rewards() -> list[str]:
    """Every reward name: built-in, plug-in, registered in this process. Nothing is imported."""
    return sorted({*BUILTIN_REWARDS, *_REGISTRY, *_plugins()})


def reward_factory(name: str):
    """What ``build_reward(name, ...)`` calls: a Reward class, factory or ``_FunctionFactory``.
    Imports the module of a built-in reward (or loads the plug-in) on first use. Raises KeyError
    for an unknown name, MissingRewardPackage when its optional package is not installed."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in BUILTIN_REWARDS:
        for package in REWARD_PACKAGES.get(name, ()):
            if not _importable(package):
                raise _missing(name, package)
        try:
            importlib.import_module(BUILTIN_REWARDS[name])  # registers it
        except ModuleNotFoundError as error:  # a package the table does not list: still only this reward
            raise _missing(name, (error.name or "?").split(".")[0]) from error
        return _REGISTRY[name]
    plugin = _plugins().get(name)
    if plugin is None:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    loaded = plugin.load()
    if name not in _REGISTRY:  # the plug-in module may register it itself
        _REGISTRY[name] = _FunctionFactory(loaded) if is_reward_function(loaded) else loaded
    return _REGISTRY[name]


def build_reward(name: str, **kwargs) -> Reward:
    """Instantiate a registered reward by name (built-in, plug-in, or registered in a script)."""
    return reward_factory(name)(**kwargs)
