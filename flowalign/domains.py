"""The value domain of every numeric config key, declared with the key.

A key's annotation carries its domain: ``max_grad_norm: Annotated[float, above(0)] = 1.0``. The
loader strips the annotation for the type check (``typing.get_type_hints`` without extras), and
``check_domains`` walks every section and names the first value outside its domain, with where it
came from. tests/test_domains.py enumerates every int and float key of ``RunConfig`` (the methods'
options included) and fails for one declared without a domain, so a new key cannot be added without
saying which values it takes.

Floats are finite unless a domain says ``finite=False`` (``inf`` is then "no limit").
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated  # noqa: F401  (re-exported: the config modules declare domains with it)

from pipelines.attention import BACKENDS as ATTENTION_BACKENDS


# the string keys that take one of a few words (checked by flowalign.config.check_values)
CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attention": ATTENTION_BACKENDS,
    "sampling.step_mode": ("all", "fraction", "window"),
    "sampling.sde": ("flow_grpo", "cps", "dance_grpo", "dance_grpo_euler"),
    "explore.mode": ("none", "shape", "magnitude", "both"),
    "sampling.log_prob_reduction": ("mean", "sum"),
    "sampling.autocast": ("none", "auto", "bf16", "fp16"),
    "sampling.unmask_schedule": ("cosine", "linear"),
    "sampling.move_schedule": ("joint", "last"),
    "train.advantage_baseline": ("group", "leave_one_out"),
    "train.mixed_precision": ("no", "fp16", "bf16"),
    "train.optimizer": ("adamw", "adamw8bit"),  # `accelerate launch --mixed_precision` must agree (preflight)
    "train.ema_warmup": ("none", "diffusers", "power"),
    "hub.strategy": ("end", "checkpoint"),
    "train.lr_schedule": ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup"),
    # none, or any tracker Accelerate runs (accelerate.utils.LoggerType but "all"; tests/test_trackers.py checks the list)
    "tracker": ("none", "tensorboard", "wandb", "aim", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab"),
    "reward.on_error": ("raise", "nan"),
}  # method: one of the registered objectives (flowalign/objectives/base.py), checked by check_values


@dataclass(frozen=True)
class Domain:
    """Values ``low`` ≤ (or <) v ≤ (or <) ``high``; ``length``: a list's length; ``note``: what a
    special value means, said with the error."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True
    length: int | None = None
    note: str = ""

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '≥'} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '≤'} {_num(self.high)}"
        return "finite"

    def problem(self, value) -> str | None:
        """None when ``value`` is in the domain, else what it must be (``must be ...``)."""
        if isinstance(value, list):
            if self.length is not None and len(value) != self.length:
                return f"must hold {self.length} numbers"
            return next((p for p in map(self.problem, value) if p), None)
        if isinstance(value, dict):
            if not value:
                return "must name at least one entry"
            return next((f"{k}: {p}" for k, v in value.items() if (p := self.problem(v))), None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value) and (self.finite or math.isnan(value)):
            return "must be a finite number" + ("" if self.text() == "finite" else f" {self.text()}")
        low_bad = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        high_bad = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if low_bad or high_bad:
            return f"must be {self.text()}" + (f" ({self.note})" if self.note else "")
        return None


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def at_least(low: float, note: str = "", **kw) -> Domain:
    return Domain(low=low, note=note, **kw)


def above(low: float, note: str = "", **kw) -> Domain:
    return Domain(low=low, low_open=True, note=note, **kw)


def between(low: float, high: float, note: str = "", low_open: bool = False, high_open: bool = False,
            **kw) -> Domain:
    return Domain(low=low, high=high, low_open=low_open, high_open=high_open, note=note, **kw)


def finite(note: str = "") -> Domain:
    return Domain(note=note)


SEED = between(0, 2**63 - 1, "a seed of torch's generators")
COUNT = at_least(1)  # a count of things that must exist
LARGEST = 10**6  # samples of one epoch or evaluation: past it the allocator fails long before the run ends


def domain_of(hint) -> Domain | None:
    """The Domain in an ``Annotated[...]`` hint (through Optional), else None."""
    if typing.get_origin(hint) is typing.Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Domain)), None)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return next((d for a in typing.get_args(hint) if (d := domain_of(a)) is not None), None)
    return None


def numeric(hint) -> bool:
    """A hint whose values are numbers (int, float, Optional of them, lists and dicts of them)."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return any(numeric(a) for a in args if a is not type(None))
    if origin in (list, dict):
        return numeric(args[-1])
    return hint in (int, float)


def fields_with_hints(cls, prefix: str = ""):
    """(dotted key, hint with its annotations, value path) of every setting under the dataclass ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from fields_with_hints(hint, key + ".")
        else:
            yield key, hint


def undeclared_domains(cls) -> list[str]:
    """The numeric keys under the dataclass ``cls`` declared without a domain."""
    return [key for key, hint in fields_with_hints(cls) if numeric(hint) and domain_of(hint) is None]


def _values_with_hints(obj, prefix: str = ""):
    """(dotted key, hint, value) of every setting of the dataclass instance ``obj``, each section by
    the class of its value: ``train`` holds the options of objectives registered after the config
    module was imported only in a subclass of the declared ``TrainConfig``."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _values_with_hints(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name], value


def check_domains(config, where_of) -> None:
    """ConfigError naming the first key whose value is outside its domain; ``where_of(key)``: where
    the value came from (``flowalign.config.source_of``)."""
    from flowalign.errors import ConfigError

    for key, hint, value in _values_with_hints(config):
        domain = domain_of(hint)
        if domain is None:
            continue
        problem = domain.problem(value)
        if problem:
            raise ConfigError(f"{where_of(key)}: {key} {problem}, got {value!r}")
    t = config.train
    rules = [("train.groups_per_epoch", t.groups_per_epoch * t.group_size <= LARGEST,
              f"× train.group_size must be ≤ {LARGEST:,} samples per epoch (more cannot be held in memory)"),
             ("eval.seeds", config.eval.seeds <= 10**4, "must be ≤ 10000 samples per held-out prompt"),
             ("sampling.window_size", config.sampling.window_size <= config.sampling.num_steps,
              "must be ≤ sampling.num_steps"),
             ("sampling.window_start", config.sampling.window_start is None
              or config.sampling.window_start < config.sampling.num_steps, "must be < sampling.num_steps"),
             ("reward.weights", any(w != 0 for w in config.reward.weights.values()),
              "are all 0: the run would train on nothing"),
             ("routing.layer_scale_max", config.routing.layer_scale_max >= config.routing.layer_scale_min,
              "must be ≥ routing.layer_scale_min"),
             ("model.lora_targets", config.model.lora_targets is None or len(config.model.lora_targets) > 0,
              "must name at least one module (or null: the family's default targets)"),
             ("output_dir", bool(str(config.output_dir).strip()),
              "must name a folder (empty: the run would write into the working directory)")]
    for key, ok, message in rules:
        if not ok:
            raise ConfigError(f"{where_of(key)}: {key} {message}")
