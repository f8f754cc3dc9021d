"""docs/config.md is the generated reference of every config key, and is not stale."""

import dataclasses
import typing
from pathlib import Path

from flowalign.config import RunConfig
from flowalign.config_reference import field_comments, reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_the_reference_in_the_docs_is_the_generated_one():
    assert DOC.read_text() == reference(), \
        "docs/config.md is stale: python -m flowalign.config_reference --write docs/config.md"


def all_keys(cls=RunConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):  # RunConfig.sources: where the values came from, not a setting
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            yield from all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_key_is_in_the_reference_and_every_key_of_config_py_says_what_it_means():
    text = reference()
    missing = [key for key in all_keys() if f"| `{key}` |" not in text]
    assert not missing, missing
    undocumented = []
    hints = typing.get_type_hints(RunConfig)
    sections = [hints[f.name] for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])]
    for cls in (RunConfig, *sections):
        for base in cls.__mro__:
            if dataclasses.is_dataclass(base) and base.__module__ in ("flowalign.config", "flowalign.experimental.options"):
                kinds = typing.get_type_hints(base)
                undocumented += [f"{base.__name__}.{name}" for name, comment in field_comments(base).items()
                                 if not comment and not dataclasses.is_dataclass(kinds[name])]
    assert not undocumented, f"comment these fields where they are defined (flowalign/config.py): {undocumented}"


def test_a_field_comment_is_read_from_above_and_beside():
    @dataclasses.dataclass
    class Example:
        # above, line one
        # line two
        a: int = 1  # beside
        b: str = "x"

    assert field_comments(Example) == {"a": "above, line one line two beside", "b": ""}
