"""The Lichess puzzle database (CSV, CC0): reading it and replaying a puzzle's setup move.

A row's FEN is the position **before** the opponent's setup move ``Moves[0]``; the solver then
plays ``Moves[1]``, ``Moves[3]``, … against the replies ``Moves[2]``, ``Moves[4]``, …. The shared
copy and its columns are described in ``../shared/data/SOURCES.md``.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import chess

DEFAULT_PUZZLES = Path(__file__).resolve().parents[3] / "shared" / "data" / "chess" / "lichess_puzzles.csv"


@dataclass(frozen=True)
class Puzzle:
    puzzle_id: str
    fen: str                 # before the setup move
    moves: tuple[str, ...]   # UCI; moves[0] is the opponent's setup move
    rating: int
    themes: frozenset[str]

    @property
    def solution(self) -> tuple[str, ...]:
        """The line from the solver's position: solver move, reply, solver move, …"""
        return self.moves[1:]

    @property
    def solver_moves(self) -> int:
        return (len(self.moves)) // 2

    def solver_board(self) -> chess.Board:
        """The position the solver faces: ``fen`` after the setup move."""
        board = chess.Board(self.fen)
        board.push_uci(self.moves[0])
        return board


def read_puzzles(path: str | Path = DEFAULT_PUZZLES) -> list[Puzzle]:
    """Every row of a Lichess puzzle CSV (header ``PuzzleId,FEN,Moves,Rating,…,Themes,…``), in file order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Lichess puzzle CSV not found at {path}; pass its path explicitly")
    with path.open(newline="") as f:
        return [Puzzle(r["PuzzleId"], r["FEN"], tuple(r["Moves"].split()), int(r["Rating"]),
                       frozenset(r["Themes"].split())) for r in csv.DictReader(f)]


def sample_puzzles(puzzles: list[Puzzle], n: int, seed: int, exclude: set[str] = frozenset()) -> list[Puzzle]:
    """A seeded sample of ``n`` puzzles (fewer if there are not enough), skipping ids in ``exclude``."""
    pool = [p for p in puzzles if p.puzzle_id not in exclude]
    return random.Random(seed).sample(pool, min(n, len(pool)))
