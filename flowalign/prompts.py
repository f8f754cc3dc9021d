"""Prompt sources: the built-in shapes world or a prompt file. A prompt is a dict with at least
``"prompt"``; GenEval-style records also carry ``"tag"`` and ``"include"`` for verifiers."""

from __future__ import annotations

import json
from pathlib import Path


def load_prompts(source: str) -> list[dict]:
    """``"shapes:train"`` / ``"shapes:test"`` / ``"shapes:all"``, ``"chess:train"`` /
    ``"chess:test"`` (theme requests, ``flowalign.chess.requests``; ``chess:<split>:<model folder>``
    for another model's split), ``"av:train"`` / ``"av:test"`` / ``"av:all"`` (the audio-video
    world, ``reward_models.worlds.audio_video``), a ``.txt`` file (one prompt per line) or a ``.jsonl`` file (one
    record per line with a "prompt" key)."""
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
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bad = [i + 1 for i, r in enumerate(records) if not isinstance(r, dict) or "prompt" not in r]
        if bad:
            raise ValueError(f"{path}: line {bad[0]} has no \"prompt\" key")
        return records
    if path.suffix == ".txt":
        return [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    raise ValueError(f"{path}: prompt files must be .txt or .jsonl")
