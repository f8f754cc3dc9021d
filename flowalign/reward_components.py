"""``reward.components: {name: weight | {weight, kwargs, component}}``: several registered rewards
trained together (reward_models/combined.py). ``expand`` rewrites such a config, before any other
check, into ``reward.name: combined``, its ``kwargs`` and ``reward.weights: {name: weight}``, so
everything downstream (advantages, ``train.per_reward_advantages``, logging as ``reward/<name>``)
sees named components with weights. Each name must be a registered reward and its kwargs its own."""

from __future__ import annotations

from flowalign.config import RunConfig, source_of
from flowalign.errors import ConfigError

SPEC_KEYS = ("weight", "kwargs", "component")
DEFAULT_WEIGHTS = {"score": 1.0}


def _spec(name: str, value, where: str) -> tuple[float, dict]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), {"kwargs": {}, "component": None}
    if not isinstance(value, dict) or set(value) - set(SPEC_KEYS):
        raise ConfigError(f"{where}: reward.components.{name} must be a weight or a mapping of {', '.join(SPEC_KEYS)}, "
                          f"got {value!r}")
    weight = value.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not isinstance(value.get("kwargs", {}), dict):
        raise ConfigError(f"{where}: reward.components.{name}: weight must be a number and kwargs a mapping")
    return float(weight), {"kwargs": dict(value.get("kwargs") or {}), "component": value.get("component")}


def expand(config: RunConfig, where: str = "config") -> None:
    """Rewrite ``reward.components`` into name / kwargs / weights (a no-op without components)."""
    r = config.reward
    if not r.components or r.name.startswith("python:"):  # a reward passed in Python replaces the config's
        return
    where = source_of(config, "reward.components", where)
    weights, rewards = {}, {}
    for name, value in r.components.items():
        weights[name], rewards[name] = _spec(name, value, where)
    kwargs = {"rewards": rewards}
    if r.name not in ("shapes", "combined"):  # "shapes" is the default name: left unset
        raise ConfigError(f"{where}: reward.name {r.name!r} and reward.components are both set; the components "
                          f"name the rewards (reward.name becomes 'combined'): remove reward.name")
    if r.kwargs and r.kwargs != kwargs:
        raise ConfigError(f"{where}: reward.kwargs is set beside reward.components; give each reward its own: "
                          f"reward.components.NAME: {{weight: W, kwargs: {{...}}}}")
    if r.weights not in (DEFAULT_WEIGHTS, weights):
        raise ConfigError(f"{where}: reward.weights is set beside reward.components; the components carry the "
                          f"weights ({weights})")
    r.name, r.kwargs, r.weights = "combined", kwargs, weights


def check(config: RunConfig) -> None:
    """Each component a registered reward taking the kwargs given (before any model loads)."""
    from flowalign.preflight import reward_arguments, reward_factory

    where = source_of(config, "reward.components")
    for name, spec in (config.reward.kwargs.get("rewards") or {}).items():
        factory = reward_factory(name, f"reward.components.{name}", where)
        reward_arguments(factory, spec["kwargs"], name, f"reward.components.{name}.kwargs", where)
        declared = getattr(factory, "components", ()) if isinstance(factory, type) else ()
        if spec.get("component") and declared and spec["component"] not in declared:
            raise ConfigError(f"{where}: reward.components.{name}.component {spec['component']!r}: reward {name!r} "
                              f"returns {list(declared)}")
