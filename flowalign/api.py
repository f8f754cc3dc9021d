"""``flowalign.train``: one call from Python (a notebook, a script) to a finished run.

Names in a config (a reward, a prompt file, a model path) can be replaced by the objects a Python
user already holds: a ``Reward`` or a plain reward function, a prompt list, a loaded adapter::

    >>> import flowalign
    >>> def brightness(samples, prompts, metadata):    # samples: float [B, 3, H, W] in [0, 1]
    ...     return samples.mean(dim=(1, 2, 3))          # a tensor [B]: the component "score"
    >>> callable(flowalign.train)
    True

A config built as ``RunConfig(...)`` goes through the checks of a YAML file (types, choices, the
cross-field rules, the method's own) before any model loads.
"""

from __future__ import annotations

import copy
from pathlib import Path

from flowalign.config import ConfigError, RunConfig, load_config


def train(config: RunConfig | str | Path | None = None, overrides: list[str] = (), *, reward=None,
          prompts: list | None = None, eval_prompts: list | None = None, adapter=None, callbacks=()) -> dict:
    """Run one experiment and return its summary (``before`` / ``after`` evaluations, ``delta``,
    ``evals``, ``epochs``, ``train_minutes``; the same as ``metrics.json``).

    ``config``: a ``RunConfig``, a YAML recipe's path, or None (the defaults); ``overrides``:
    ``key.sub=value`` strings applied to a path or the defaults. ``reward``: a ``Reward`` object or a
    function ``fn(samples, prompts, metadata) -> dict | Tensor [B]`` (a tensor is the component
    ``score``), used instead of ``reward.name``. ``prompts`` / ``eval_prompts``: lists of prompt
    strings or records (``{"prompt": ..., "tag": ...}``) instead of ``data.train_prompts`` /
    ``data.eval_prompts``. ``adapter``: a loaded adapter (``pipelines.load_adapter``) on the run's
    device instead of ``model.path``; its LoRA is added in place. The config file written to the run
    folder names what was passed (``python:<name>``). ``callbacks``: ``flowalign.Callback`` objects
    (flowalign/callbacks.py)."""
    from flowalign.trainer import Trainer

    for name, value in (("prompts", prompts), ("eval_prompts", eval_prompts)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list of prompts (strings or records), got {type(value).__name__}; a "
                              f"file or split goes in data.{'train' if name == 'prompts' else 'eval'}_prompts")

    if isinstance(config, RunConfig):
        if overrides:
            raise ConfigError("overrides apply to a YAML path or the defaults; set the RunConfig's fields directly")
        config = copy.deepcopy(config)  # the labels below must not change the caller's object
    else:
        config = load_config(config, list(overrides))
    if reward is not None:
        config.reward.name = f"python:{getattr(reward, '__qualname__', type(reward).__name__)}"
    if prompts is not None:
        config.data.train_prompts = f"python:{len(prompts)} prompts"
    if eval_prompts is not None:
        config.data.eval_prompts = f"python:{len(eval_prompts)} prompts"
    if adapter is not None:
        config.model.family, config.model.path = adapter_family(adapter), f"python:{type(adapter).__name__}"
    trainer = Trainer(config, reward=reward, train_prompts=prompts, eval_prompts=eval_prompts, adapter=adapter,
                      callbacks=callbacks)
    return trainer.train()


def adapter_family(adapter) -> str:
    """The ``model.family`` whose adapter class ``adapter`` is (ConfigError for another object)."""
    from pipelines import FAMILIES

    name = f"{type(adapter).__module__}:{type(adapter).__name__}"
    for family, path in FAMILIES.items():
        if path == name:
            return family
    raise ConfigError(f"adapter: {type(adapter).__name__} is not a model family's adapter; load one with "
                      f"pipelines.load_adapter(family, path) (families: {', '.join(sorted(FAMILIES))})")
