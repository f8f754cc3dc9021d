"""flowalign: align diffusion and flow-matching generators with reward models by RL.

The Python API, loaded on first use so that ``import flowalign`` (and ``flowalign --help``) stays
cheap — torch and the trainer load only when one of these names is touched::

    import flowalign

    def brightness(samples, prompts, metadata):          # samples: float [B, 3, H, W] in [0, 1]
        return samples.mean(dim=(1, 2, 3))                # a tensor [B]: the component "score"

    config = flowalign.load_config("configs/shapes_nft.yaml", ["train.epochs=2"])
    summary = flowalign.train(config, reward=brightness, prompts=["a photo of a red circle"])
    print(summary["before"]["score"], summary["after"]["score"])

``train`` (flowalign/api.py), ``Trainer`` (flowalign/trainer.py), ``load_config`` / ``RunConfig``
and its sections (flowalign/config.py), ``register_reward`` / ``Reward`` (reward_models/base.py).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from flowalign.layout import check_siblings

__version__ = "0.1.0"

check_siblings(Path(__file__).resolve().parent.parent)  # pipelines and reward_models are ours (layout.py)

_EXPORTS = {
    "train": "flowalign.api",
    "Trainer": "flowalign.trainer",
    "load_config": "flowalign.config",
    "RunConfig": "flowalign.config",
    "ModelConfig": "flowalign.config",
    "SamplingConfig": "flowalign.config",
    "DataConfig": "flowalign.config",
    "RewardConfig": "flowalign.config",
    "TrainConfig": "flowalign.config",
    "EvalConfig": "flowalign.config",
    "ConfigError": "flowalign.errors",
    "Reward": "reward_models.base",
    "register_reward": "reward_models.base",
    "push": "flowalign.hub",
    "Callback": "flowalign.callbacks",
    "demo_model": "flowalign.model_card",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'flowalign' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
