"""Built-in recipes by name: the YAML files of the repository's ``configs/`` ship inside the package
(``flowalign/configs`` is a link to it in a checkout, a copy in the wheel), with the prompt files
they need (``configs/prompts/``), so an installed flowalign runs them without a clone::

    flowalign recipes                 # the names, each with its first comment line
    flowalign train shapes_nft        # = flowalign train configs/shapes_nft.yaml in a clone

A name is looked up only when no file of that name exists: a path always means that file.
"""

from __future__ import annotations

from pathlib import Path

from flowalign.errors import ConfigError


def recipes_dir() -> Path:
    """The folder of the built-in recipes."""
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "configs"  # a clone where the link is a plain file (Windows)


def builtin_recipes() -> dict[str, Path]:
    """Every built-in recipe: name (the file's stem) → path."""
    return {path.stem: path for path in sorted(recipes_dir().glob("*.yaml"))}


def describe(path: Path) -> str:
    """A recipe's first sentence: its header comment's first paragraph up to the first full stop
    (not an "et al."), joined from as many lines as it spans."""
    import re

    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or not line.lstrip("# ").strip():
            break
        words.append(line.lstrip("# ").rstrip())
    text = " ".join(words)
    end = re.search(r"(?<!\bal)\.(\s|$)", text)
    return text[:end.start() + 1] if end else text


def find_recipe(name_or_path: str | Path) -> Path:
    """``name_or_path`` when it is a file, else the built-in recipe of that name (``shapes_nft`` or
    ``shapes_nft.yaml``). ConfigError saying what was tried otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    known = builtin_recipes()
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if stem in known and path.parent == Path("."):
        return known[stem]
    hint = (f"; {stem!r} is a built-in recipe: use the name alone ({stem})" if stem in known else
            f"; built-in recipes (flowalign recipes): {', '.join(known)}")
    raise ConfigError(f"config file not found: {path.resolve()}{hint}")
