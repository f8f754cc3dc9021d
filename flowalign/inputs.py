"""The files a run reads that are not shipped: prompt files and a reward's local weights. A dry run
of a recipe whose files are missing here stops with exit 2 naming each file and how to get it
(the recipe's own words: the paragraph of its header comment that names the file, else the
comment on the line that sets it)."""

from __future__ import annotations

import re
from pathlib import Path

from flowalign.config import RunConfig, source_of
from flowalign.errors import ConfigError


class MissingInputs(ConfigError):
    """Files the run needs are absent; ``report`` is the dry run's text, printed before the error."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message)
        self.report = report


def _local(value) -> bool:
    return isinstance(value, str) and value.startswith(("/", "./", "../", "~"))


def missing_inputs(config: RunConfig) -> list[tuple[str, str]]:
    """(key, path) of every prompt file and local reward file the config names that does not exist."""
    missing = []
    for key in ("train_prompts", "eval_prompts"):
        source = getattr(config.data, key)
        is_file = Path(source).suffix in (".txt", ".jsonl", ".csv", ".parquet", ".json")
        if ":" not in source.split("/")[0] and is_file and not Path(source).expanduser().exists():
            missing.append((f"data.{key}", source))
    for arg, value in config.reward.kwargs.items():
        if _local(value) and not Path(value).expanduser().exists():
            missing.append((f"reward.kwargs.{arg}", value))
    return missing


def _header_chunks(text: str) -> list[str]:
    """The recipe's leading comment as paragraphs and ``*`` bullets, each on one line."""
    chunks, current = [], []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if not body or body.startswith("* "):
            if current:
                chunks.append(" ".join(current))
            current = [body[2:]] if body else []
        else:
            current.append(body)
    if current:
        chunks.append(" ".join(current))
    return chunks


def how_to_get(recipe: Path | None, path: str) -> str:
    """The recipe's words about ``path`` (its header's paragraph naming it, else its line's comment)."""
    if recipe is None or not recipe.is_file():
        return ""
    text = recipe.read_text()
    name, folder = Path(path).name, Path(path).parent.name
    for chunk in _header_chunks(text):
        if name in chunk or (folder and f"{folder}/" in chunk):
            return re.sub(r"\s+", " ", chunk)
    for line in text.splitlines():
        if name in line and "#" in line.split(name, 1)[1]:
            return line.split(name, 1)[1].split("#", 1)[1].strip()
    return ""


def check_inputs(config: RunConfig, report: str = "") -> None:
    """Raise MissingInputs (one line) when a file the run reads is missing here."""
    missing = missing_inputs(config)
    if not missing:
        return
    sources = getattr(config, "sources", None) or {}
    recipe = Path(sources["file"]) if sources.get("file", "defaults") != "defaults" else None
    files = ", ".join(f"{key} {path}" for key, path in missing)
    hints = []
    for key, path in missing:
        hint = how_to_get(recipe, path) if source_of(config, key) == sources.get("file") else ""
        if hint and hint not in hints:
            hints.append(hint)
    said = f" The recipe says: {' | '.join(hints)}" if hints else ""
    raise MissingInputs(f"{sources.get('file', 'config')}: missing here: {files}.{said} Create the file(s), or set "
                        f"the key(s) to yours (key=PATH on the command line).", report)
