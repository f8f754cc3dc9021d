"""Generating chess puzzles for a user: theme requests, a partial board, puzzles with solutions.

``flowalign sample --model chess-md "fork short" --partial-fen FEN --out puzzles.pgn`` runs
``generate``: one board per seed from the masked-diffusion pipeline, with the partial board's
fixed squares kept (inpainting), then the ``chess_puzzle`` reward's judgement of each board
(legal, unique by Stockfish, the engine's solution line and the themes the tagger finds on it),
written as PGN (one game per puzzle from its FEN, the solution as moves) or CSV.

>>> fixed_positions("6k1/5ppp/8/8/8/8/8/8 w - - 0 1", "pieces,turn")  # f7 g7 h7 g8, side to move
[53, 54, 55, 62, 64]
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import chess
import chess.pgn


@dataclass
class GeneratedPuzzle:
    seed: int
    requested: tuple[str, ...]
    fen: str                          # the generated board (counters "0 1")
    model_move: str | None            # the model's own best-move tokens
    legal: bool = False
    unique: bool | None = None        # None: not checked (no engine) or the engine failed
    solution: list[str] = field(default_factory=list)  # UCI, solver first (the engine's line)
    themes: set[str] = field(default_factory=set)       # found by the tagger on the solution
    problems: list[str] = field(default_factory=list)

    @property
    def theme_match(self) -> bool:
        return set(self.requested) <= self.themes


def fixed_positions(fen: str, fixed: str) -> list[int]:
    """Token positions to keep from ``fen``, from a comma list of: "pieces" (its occupied squares),
    square names, "turn" (the side to move), "castling" (the four rights), "ep" (the en-passant
    file) and "all" (the whole board: every square and those three).
    Squares are python-chess indices (a1 = 0 … h8 = 63), the tokenizer's first 64 positions."""
    from pipelines import chess_tokenizer as tokenizer

    try:
        board = chess.Board(fen)
    except ValueError as error:
        raise ValueError(f"--partial-fen: not a FEN ({error}): {fen!r}") from None
    names = [n.strip() for n in fixed.split(",") if n.strip()]
    positions = []
    for name in names:
        if name == "pieces":
            positions += sorted(board.piece_map())
        elif name == "turn":
            positions.append(tokenizer.TURN)
        elif name == "castling":
            positions += list(range(tokenizer.CASTLING.start, tokenizer.CASTLING.stop))
        elif name == "ep":
            positions.append(tokenizer.EN_PASSANT)
        elif name == "all":
            positions += list(range(tokenizer.BOARD_LEN))
        elif name in chess.SQUARE_NAMES:
            positions.append(chess.parse_square(name))
        else:
            raise ValueError(f"--fixed: {name!r} is not a square name, 'pieces', 'turn', 'castling', 'ep' or 'all'")
    return list(dict.fromkeys(positions))


def generate(pipe, themes: str, seeds: Sequence[int], *, partial_fen: str | None = None, fixed: str = "pieces",
             num_steps: int = 16, guidance_scale: float = 1.0, temperature: float = 1.0,
             reward=None, move_schedule: str = "joint") -> list[GeneratedPuzzle]:
    """One puzzle per seed for the request ``themes`` (space-separated keys), around the
    partial board (``fixed_positions`` of ``partial_fen``), judged by ``reward`` (a
    ``ChessPuzzleReward``; None: boards only); ``move_schedule`` as in ``ChessPuzzlePipeline``."""
    import torch

    from pipelines.chess import partial_tokens

    partial = None
    if partial_fen is not None:
        partial = partial_tokens(partial_fen, fixed_positions(partial_fen, fixed))
    out = []
    for seed in seeds:
        result = pipe([themes], partial=partial, num_steps=num_steps, temperature=temperature,
                      guidance_scale=guidance_scale, move_schedule=move_schedule,
                      generator=torch.Generator().manual_seed(seed))
        out.append(GeneratedPuzzle(seed, tuple(themes.split()), result.fens[0], result.moves[0]))
    return judge(out, reward)


def judge(puzzles: list[GeneratedPuzzle], reward=None) -> list[GeneratedPuzzle]:
    """Fill in each puzzle's verdict (in place; returns ``puzzles``): with ``reward`` (a
    ``ChessPuzzleReward``) legal, unique, the engine's solution line and the themes found on it;
    without, legality only."""
    if reward is not None:
        verdicts = reward.judge([p.fen for p in puzzles], [{"themes": list(p.requested)} for p in puzzles])
        for puzzle, verdict in zip(puzzles, verdicts):
            puzzle.legal, puzzle.problems = verdict.legal, list(verdict.problems)
            if verdict.uniqueness is not None:
                puzzle.unique = verdict.uniqueness.unique
                puzzle.solution = list(verdict.uniqueness.line)
                puzzle.themes = set(verdict.themes)
    else:
        from reward_models.chess.legality import legality_problems

        for puzzle in puzzles:
            puzzle.problems = legality_problems(puzzle.fen)
            puzzle.legal = not puzzle.problems
    return puzzles


def san_line(fen: str, line: Sequence[str]) -> str:
    """A UCI line from ``fen`` in SAN with move numbers ("1. Qxh7+ Kxh7 2. Rh3#"; "" for no moves)."""
    board = chess.Board(fen)
    return board.variation_san([chess.Move.from_uci(m) for m in line]) if line else ""


def write_csv(puzzles: Sequence[GeneratedPuzzle], path: str | Path) -> None:
    """One row per puzzle: seed, fen, legal, unique, solution (UCI and SAN), themes requested and found."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "fen", "legal", "unique", "solution_uci", "solution_san", "requested", "found",
                    "theme_match", "model_move", "problems"])
        for p in puzzles:
            w.writerow([p.seed, p.fen, int(p.legal), "" if p.unique is None else int(p.unique), " ".join(p.solution),
                        san_line(p.fen, p.solution) if p.legal else "", " ".join(p.requested), " ".join(sorted(p.themes)),
                        int(p.theme_match), p.model_move or "", " ".join(p.problems)])


def write_pgn(puzzles: Sequence[GeneratedPuzzle], path: str | Path) -> None:
    """One PGN game per legal puzzle, starting from its FEN, the solution as the moves; the
    request, the themes found and the verdict in headers. Illegal boards are skipped."""
    games = []
    for p in puzzles:
        if not p.legal:
            continue
        game = chess.pgn.Game()
        game.setup(chess.Board(p.fen))
        game.headers.update({"Event": f"flowalign puzzle, seed {p.seed}", "Site": "flowalign sample",
                             "Requested": " ".join(p.requested), "Themes": " ".join(sorted(p.themes)),
                             "Unique": "?" if p.unique is None else str(int(p.unique)),
                             "ThemeMatch": str(int(p.theme_match))})
        node = game
        for move in p.solution:
            node = node.add_variation(chess.Move.from_uci(move))
        games.append(str(game))
    Path(path).write_text("\n\n".join(games) + ("\n" if games else ""))


def write_boards(puzzles: Sequence[GeneratedPuzzle], folder: str | Path) -> list[Path]:
    """An SVG diagram per legal puzzle (the solution's first move drawn as an arrow)."""
    import chess.svg

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in puzzles:
        if not p.legal:
            continue
        board = chess.Board(p.fen)
        first = chess.Move.from_uci(p.solution[0]) if p.solution else None
        arrows = [chess.svg.Arrow(first.from_square, first.to_square)] if first else []
        path = folder / f"puzzle-{p.seed}.svg"
        path.write_text(chess.svg.board(board, arrows=arrows, size=320))
        paths.append(path)
    return paths


def summary(puzzles: Sequence[GeneratedPuzzle]) -> str:
    buf = io.StringIO()
    n = len(puzzles)
    legal = sum(p.legal for p in puzzles)
    unique = sum(bool(p.unique) for p in puzzles)
    hits = sum(bool(p.unique) and p.theme_match for p in puzzles)
    buf.write(f"{n} boards: {legal} legal, {unique} unique, {hits} unique with every requested theme")
    return buf.getvalue()
