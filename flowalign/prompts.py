"""Prompt sources: the built-in shapes world or a prompt file. A prompt is a dict with at least
``"prompt"``; GenEval-style records also carry ``"tag"`` and ``"include"`` for verifiers; an
image-conditioned task's records carry ``"image"``, the conditioning image's path (relative paths
are resolved against the prompt file's folder; several, for Qwen-Image-Edit-Plus: a list, or in a
CSV paths separated by "|"), which the adapter encodes with the prompt and the rewards receive in
their metadata."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def load_prompts(source: str | list) -> list[dict]:
    """A list given in Python (prompt strings or records with a "prompt" key) as records, or
    ``"shapes:train"`` / ``"shapes:test"`` / ``"shapes:all"``, ``"chess:train"`` /
    ``"chess:test"`` (theme requests, ``flowalign.chess.requests``; ``chess:<split>:<model folder>``
    for another model's split), ``"av:train"`` / ``"av:test"`` / ``"av:all"`` (the audio-video
    world, ``reward_models.worlds.audio_video``), a ``.txt`` file (one prompt per line), a ``.jsonl`` file (one
    record per line with a "prompt" key) or a ``.csv`` file (a header row naming a "prompt" column;
    every column becomes a key of the record)."""
    if isinstance(source, (list, tuple)):
        records = [{"prompt": p} if isinstance(p, str) else dict(p) for p in source]
        bad = next((i for i, r in enumerate(records) if not str(r.get("prompt", "")).strip()), None)
        if bad is not None:
            raise ValueError(f"prompt list: item {bad} has no prompt (a string, or a record with a \"prompt\" key)")
        return records
    if source.startswith("shapes:"):
        from reward_models.worlds.shapes import prompt_split

        return prompt_split(source.split(":", 1)[1])
    if source.startswith("av:"):
        from reward_models.worlds.audio_video import prompt_split as av_split

        return av_split(source.split(":", 1)[1])
    if source.startswith("chess:"):
        from flowalign.chess.requests import DEFAULT_MODEL, chess_requests

        _, split, *model = source.split(":", 2)
        return chess_requests(split, model[0] if model else DEFAULT_MODEL)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: tried {path.resolve()} (or use shapes:train / shapes:test / chess:train / chess:test / av:train / av:test)")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}: line {number} is not JSON ({error})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ValueError(f"{path}: line {number} has no \"prompt\" key")
            records.append(record)
        return [resolve_image(r, path) for r in records]
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames and "prompt" not in reader.fieldnames:
                raise ValueError(f"{path}: the first line must be a header naming a \"prompt\" column "
                                 f"(and optionally \"image\", \"tag\", ...), got {reader.fieldnames}")
            records = list(reader)
        bad = [i + 2 for i, r in enumerate(records) if not r.get("prompt")]  # line 1 is the header
        if bad:
            raise ValueError(f"{path}: line {bad[0]} has no \"prompt\" value")
        return [resolve_image(r, path) for r in records]
    if path.suffix == ".txt":
        return [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    raise ValueError(f"{path}: prompt files must be .txt (one prompt a line), .jsonl (one record a line) or .csv "
                     f"(a header with a prompt column), got {path.suffix or 'no extension'}")


def resolve_image(record: dict, prompt_file: Path) -> dict:
    """A record's "image" as an absolute path (relative to the prompt file's folder); it must exist.
    Several input images (Qwen-Image-Edit-Plus): a list of paths (jsonl) or paths separated by "|"
    (CSV), resolved to a list."""
    if not record.get("image"):
        return record
    given = record["image"]
    several = isinstance(given, list) or "|" in given
    paths = given if isinstance(given, list) else given.split("|")
    resolved = []
    for path in paths:
        image = (prompt_file.parent / Path(str(path).strip()).expanduser()).resolve()
        if not image.is_file():
            raise FileNotFoundError(f"{prompt_file}: conditioning image of {record['prompt']!r} not found: "
                                    f"tried {image}")
        resolved.append(str(image))
    return {**record, "image": resolved if several else resolved[0]}
