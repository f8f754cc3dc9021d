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
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a YAML recipe file")
    known = builtin_recipes()
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if stem in known and path.parent == Path("."):
        return known[stem]
    hint = (f"; {stem!r} is a built-in recipe: use the name alone ({stem})" if stem in known else
            f"; built-in recipes (flowalign recipes): {', '.join(known)}")
    raise ConfigError(f"config file not found: {path.resolve()}{hint}")


def read_recipe(path: Path) -> dict:
    """A recipe file's settings: UTF-8 YAML whose top level is a non-empty mapping (ConfigError naming
    the file otherwise)."""
    import yaml

    from flowalign.errors import ConfigError

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text, so not a YAML recipe (byte {error.object[error.start]:#04x} at "
                          f"offset {error.start})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None
    if loaded is None or loaded == {}:
        raise ConfigError(f"{path}: the recipe is empty (no settings); start from a built-in one: flowalign recipes "
                          "--show shapes_flow_grpo")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    return loaded
