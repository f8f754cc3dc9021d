"""The Objective protocol: what one method adds to the training loop, and the registry of methods.

The trainer (``flowalign/trainer.py``) runs sample → score → advantages → update → end-epoch and
asks the objective, by this protocol only, for what differs between methods::

    rollout             what the epoch sampler must produce: "sde" (stochastic steps with
                        log-probs), "ode" (final samples, any solver), "unmasking" (masked
                        discrete diffusion), "offline" (pre-generated groups; nothing sampled)
    predictions         the adapter predictions it trains ("velocity", "epsilon", "logits")
    validate(config)    its own config rules, checked before any model loads (ConfigError
                        naming the key)
    num_terms(config)   loss terms per minibatch (Accelerate's gradient accumulation), known
                        before the model loads
    unit                samples that must share a minibatch (whole groups for GDRO)
    terms(batch)        this epoch's term ids (trained steps, noising draws)
    sampling_weights()  the weights to sample with (DiffusionNFT's old policy swapped in)
    begin_update(batch) per-update draws, once per inner epoch (noising draws)
    loss(batch, idx, term, advantages, valid) → (loss, stats) of one term of minibatch ``idx``
    end_epoch(batch, epoch) → stats: end-of-epoch work (an old policy's decay)
    options             dataclasses of its own ``train.*`` options, joined into ``TrainConfig``
                        under the same keys (documented and checked here, beside the method)
    state_dict() / load_state_dict(state)   checkpointed under its name (flowalign.checkpoint)
    components()        the state to checkpoint, by name ({name: self} for a stateful objective)

A method is one file beside its kernel that defines a class with these members and decorates it
with ``@register``; ``flowalign/objectives/__init__.py`` imports the file (one line).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from flowalign.errors import ConfigError

RunConfig = object  # flowalign.config.RunConfig (not imported: the config is built from this registry)


@dataclass
class Context:
    """What an objective sees of the run: the config, the adapter (``predict`` with ``model=`` for
    the forward pass that trains), the prepared model (the DDP / FSDP wrapper), the trained
    parameters and the processes / streams (``flowalign.distributed.Distributed``)."""

    config: RunConfig
    adapter: object
    model: torch.nn.Module
    params: list
    dist: object

    @property
    def reward_weights(self) -> torch.Tensor:
        """[C] the configured reward weights, in the order of the per-reward advantage columns."""
        return torch.tensor(list(self.config.reward.weights.values()), dtype=torch.float32)

    @property
    def reference_model(self):
        """The module the reference policy's forward pass runs through: under FSDP a LoRA's
        reference (adapters off) must run through the wrapper that holds the shards."""
        return self.model if self.dist.fsdp and self.config.model.lora_rank > 0 else None


class Objective(Protocol):
    name: ClassVar[str]
    rollout: ClassVar[str]
    predictions: ClassVar[tuple[str, ...]]
    unit: int

    @classmethod
    def validate(cls, config: RunConfig) -> list[tuple[str, bool, str]]: ...

    @classmethod
    def num_terms(cls, config: RunConfig) -> int: ...

    def terms(self, batch) -> list[int]: ...

    def sampling_weights(self) -> contextlib.AbstractContextManager: ...

    def begin_update(self, batch) -> None: ...

    def loss(self, batch, idx: torch.Tensor, term: int, advantages: torch.Tensor,
             valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def end_epoch(self, batch, epoch: int) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def components(self) -> dict: ...


class BaseObjective:
    """Defaults for the optional members: one sample per unit, current weights, nothing per
    update, nothing at the end of an epoch, no state."""

    unit = 1
    predictions: ClassVar[tuple[str, ...]] = ("velocity",)
    options: ClassVar[tuple[type, ...]] = ()
    stateful = False  # True: state_dict() is checkpointed under the objective's name

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.config = ctx.config

    @classmethod
    def validate(cls, config: RunConfig) -> list[tuple[str, bool, str]]:
        """Rules (key, holds, message) of this method's options; ``check`` raises on the first broken one."""
        return []

    def sampling_weights(self):
        return contextlib.nullcontext()

    def begin_update(self, batch) -> None:
        pass

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def components(self) -> dict:
        """Checkpointed state by name (flowalign/checkpoint.py)."""
        return {self.name: self} if self.stateful else {}

    @classmethod
    def validate_family(cls, config: RunConfig) -> list[tuple[str, bool, str]]:
        """Rules that hold once the family is known to be one this objective trains."""
        return []


OBJECTIVES: dict[str, list[type]] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` the objective of ``method: cls.name`` for its predictions."""
    OBJECTIVES.setdefault(cls.name, []).append(cls)
    return cls


def method_options() -> tuple[type, ...]:
    """The registered objectives' option dataclasses, once each (``TrainConfig``'s bases)."""
    import flowalign.objectives  # noqa: F401

    found = []
    for classes in OBJECTIVES.values():
        for cls in classes:
            for option in cls.options:
                if option not in found:
                    found.append(option)
    return tuple(found)


def methods() -> tuple[str, ...]:
    import flowalign.objectives  # noqa: F401  (the registry lines)

    return tuple(OBJECTIVES)


def objective_class(method: str, family: str, prediction: str) -> type:
    """The objective of ``method`` for a family of ``prediction``; ConfigError naming both otherwise."""
    import flowalign.objectives  # noqa: F401

    if method not in OBJECTIVES:
        raise ConfigError(f"config: method must be one of {', '.join(OBJECTIVES)}, got {method!r}")
    for cls in OBJECTIVES[method]:
        if prediction in cls.predictions:
            return cls
    fitting = [name for name, classes in OBJECTIVES.items() if any(prediction in c.predictions for c in classes)]
    raise ConfigError(f"config: method {method!r} does not apply to model family {family!r} ({prediction} "
                      f"prediction): use {' / '.join(fitting)} for it")


def check(rules, where: str = "config", config=None) -> None:
    """ConfigError for the first failed (key, ok, message) rule, naming the override that set the
    key when ``config`` knows one (``flowalign.config.source_of``), else ``where``."""
    for key, ok, message in rules:
        if not ok:
            if config is not None:
                from flowalign.config import source_of

                where = source_of(config, key, where)
            raise ConfigError(f"{where}: {key} {message}")
