"""``key.sub=value`` overrides on a settings tree (the YAML mapping a recipe is read into): parsing
a value as YAML, setting it at a dotted path, reading number-shaped strings as floats."""

from __future__ import annotations

import re
from typing import Any

import yaml

from flowalign.errors import ConfigError


def set_path(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def numbers_as_floats(tree):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; read number-shaped strings as floats."""
    if isinstance(tree, dict):
        return {k: numbers_as_floats(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [numbers_as_floats(v) for v in tree]
    return float(tree) if isinstance(tree, str) and _FLOAT.match(tree) else tree


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.learning_rate=1e-4"`` → ("train.learning_rate", 1e-4); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({problem}); quote the whole "
                          "override for the shell, e.g. 'reward.kwargs={min_area: 4}'") from None
    return key.strip(), numbers_as_floats(value)


def dotted_keys(tree: dict, prefix: str = ""):
    """Every key of a settings tree as a dotted path (sections and the keys inside them)."""
    for key, value in tree.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from dotted_keys(value, f"{prefix}{key}.")
