"""Theme requests of the chess world as prompt records: the ``chess:train`` / ``chess:test`` prompt sources.

A record is ``{"prompt": "<themes, space-separated>", "themes": [...], "tag": <first theme>}``
(themes sorted; the prompt is what ``ChessAdapter.encode`` reads, ``themes`` what the
``chess_puzzle`` reward checks, ``tag`` the category that evaluation reports per-tag means of).

- ``chess:test``: the held-out requests of the model's ``split.json`` (written by
  ``scripts/pretrain_chess.py``: 1–2 themes of held-out puzzles; what
  ``scripts/measure_chess_model.py`` and ``baseline.json`` measure).
- ``chess:train``: ``TRAIN_REQUESTS`` requests drawn the same way (1–2 themes of one puzzle) from
  the puzzles that were *not* held out (``split.json``'s ``test_puzzle_ids``), seeded by
  ``split.json``'s seed, leaving out every held-out request: the held-out requests stay unseen
  in RL too. Repeats are kept, so a request is drawn as often as the data asks for it (the
  records are not distinct; choosing a record uniformly is choosing by frequency). Themes are
  kept only where both the model (its config's theme list) and the reward's tagger know them;
  game phases are never requested on their own (as in pre-training).

``chess:<split>:<model>`` reads another model folder's ``split.json`` (default: the built-in
``chess-md``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PHASES = ("opening", "middlegame", "endgame")
TRAIN_REQUESTS = 512
DEFAULT_MODEL = "chess-md"


def request_record(themes) -> dict:
    themes = sorted(themes.split() if isinstance(themes, str) else themes)
    return {"prompt": " ".join(themes), "themes": themes, "tag": themes[0] if themes else "unconditional"}


def _split(model: str) -> tuple[Path, dict]:
    from pipelines.base import resolve_model_path

    folder = Path(resolve_model_path(model))
    path = folder / "split.json"
    if not path.is_file():
        raise FileNotFoundError(f"chess prompts: no split.json in {folder.resolve()} (scripts/pretrain_chess.py "
                                "writes it next to the model)")
    return folder, json.loads(path.read_text())


def _known_themes(folder: Path) -> set[str]:
    from reward_models.chess.themes import SUPPORTED_THEMES

    config = folder / "model" / "config.json"
    if config.is_file():
        model_themes = set(json.loads(config.read_text()).get("themes", ()))
    else:
        from pipelines.chess_model import THEMES

        model_themes = set(THEMES)
    return model_themes & set(SUPPORTED_THEMES)


def chess_requests(split: str, model: str = DEFAULT_MODEL, *, n: int = TRAIN_REQUESTS,
                   puzzles_csv: str | Path | None = None) -> list[dict]:
    """Prompt records of ``split`` ("train" | "test") for the model folder (or demo name) ``model``."""
    folder, info = _split(model)
    held_out = [request_record(r) for r in info["requests"]]
    if split == "test":
        return held_out
    if split != "train":
        raise ValueError(f"chess prompts: split must be train or test, got {split!r}")
    from flowalign.chess.puzzles import DEFAULT_PUZZLES, read_puzzles

    puzzles = read_puzzles(puzzles_csv or DEFAULT_PUZZLES)
    test_ids = set(info.get("test_puzzle_ids", ()))
    known, excluded = _known_themes(folder), {tuple(r["themes"]) for r in held_out}
    rng = random.Random(info.get("seed", 0) + 1)
    pool = sorted((p for p in puzzles if p.puzzle_id not in test_ids), key=lambda p: p.puzzle_id)
    out = []
    for p in rng.sample(pool, len(pool)):
        themes = sorted(t for t in p.themes if t in known and t not in PHASES)
        if not themes:
            continue
        request = tuple(sorted(rng.sample(themes, min(len(themes), rng.choice((1, 2))))))
        if request not in excluded:
            out.append(request_record(request))
        if len(out) == n:
            break
    return out
