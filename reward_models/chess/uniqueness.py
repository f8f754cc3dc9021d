"""Is a position a puzzle with one solution? Engine checks along the principal variation (METHODS §4).

Scale: Lichess's win chance W(cp) = 2 / (1 + exp(−0.00368208·cp)) − 1 ∈ (−1, 1), from the side
to move; a mate for the side to move counts as W = +1, a mate against it as −1.

A solver move is *unique* (``step_problem`` returns None) when, with multipv = 2:
- it is the only legal move; or
- the best line mates: no other move mates as well, except that at a mate in one several
  mating moves are allowed (the puzzle ends there whichever is played); or
- the best line does not mate: W(best) − W(second) ≥ ``gap`` (0.5).

``check_position`` (the reward: a generated position, no known solution) requires the first
move to be winning (≥ ``min_first_cp`` = 200 cp, or a mate) and unique, then follows the
engine's principal variation (solver's best move, the engine's best reply, …):
- when the first move mates, the solution is the mating line: every solver move on it must be
  unique until mate (or ``max_solver_moves``), else the position is not unique;
- otherwise the solution goes on while the solver's move stays unique and ends before the
  first solver move that is not (Lichess's convention: a won piece can be converted many ways),
  again at most ``max_solver_moves`` long. Such a position is unique when its first move is.

``check_line`` (measurement against Lichess) walks a given solution instead and also requires
the engine's best move to be the given one (a different mating move is fine at a mate in one).
Both return a ``UniquenessResult``; a search that failed twice gives ``unique=None`` (NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import chess

from reward_models.chess.engine import EngineFailure, EngineHandle

WIN_CHANCE_K = 0.00368208
FAILURE_KINDS = ("not_winning", "close_second", "second_mate", "mate_lost", "engine_disagrees", "game_over",
                 "engine_failed")


def win_chance(cp: float) -> float:
    """Lichess's win chance of a centipawn score: 2/(1+exp(−0.00368208·cp)) − 1 ∈ (−1, 1).

    >>> win_chance(0.0), round(win_chance(200.0), 4), round(win_chance(-200.0), 4)
    (0.0, 0.3524, -0.3524)
    """
    return 2.0 / (1.0 + math.exp(-WIN_CHANCE_K * cp)) - 1.0


@dataclass(frozen=True)
class LineScore:
    """One engine line, scored from the point of view of the side to move."""

    move: str              # UCI
    cp: int | None = None  # centipawns when not a mate
    mate: int | None = None  # > 0: the side to move mates in ``mate``; < 0: it is mated

    @property
    def win(self) -> float:
        if self.mate is not None:
            return 1.0 if self.mate > 0 else -1.0
        return win_chance(self.cp)

    @property
    def mates(self) -> bool:
        return self.mate is not None and self.mate > 0


def step_problem(best: LineScore, second: LineScore | None, gap: float = 0.5) -> tuple[str, str] | None:
    """None when the best move is unique against the second-best; else (kind, message), kind
    "second_mate" or "close_second".

    >>> step_problem(LineScore("e2e4", cp=500), LineScore("d2d4", cp=-50))
    >>> step_problem(LineScore("e2e4", cp=500), LineScore("d2d4", cp=400))
    ('close_second', 'second-best move d2d4 is within 0.5 win chance (0.73 vs 0.63)')
    >>> step_problem(LineScore("h5h7", mate=1), LineScore("h5f7", mate=1))  # several mates in one: fine
    """
    if second is None:
        return None  # the only legal move
    if best.mates:
        if second.mates and best.mate > 1:
            return "second_mate", f"{second.move} mates too (in {second.mate}; best in {best.mate})"
        return None
    if best.win - second.win < gap:
        return "close_second", (f"second-best move {second.move} is within {gap} win chance "
                                f"({best.win:.2f} vs {second.win:.2f})")
    return None


def line_scores(infos: Sequence[dict], turn: chess.Color) -> list[LineScore]:
    """python-chess InfoDicts (multipv order) → ``LineScore``s from ``turn``'s point of view."""
    out = []
    for info in infos:
        if not info.get("pv"):
            continue
        score = info["score"].pov(turn)
        out.append(LineScore(info["pv"][0].uci(), score.score(), score.mate()))
    return out


@dataclass
class UniquenessResult:
    unique: bool | None               # None: the engine failed (score NaN)
    kind: str                         # "unique", or one of FAILURE_KINDS
    reason: str                       # human-readable detail
    line: list[str] = field(default_factory=list)  # solution followed, UCI: solver, reply, solver, …
    first: LineScore | None = None    # the engine's best first move
    mate: bool = False                # the line ends in checkmate

    @property
    def solver_moves(self) -> int:
        return (len(self.line) + 1) // 2


def _search(engine: EngineHandle, board: chess.Board) -> tuple[LineScore, LineScore | None, list[chess.Move]]:
    infos = engine.analyse(board, multipv=2)
    scores = line_scores(infos, board.turn)
    if not scores:
        raise EngineFailure(f"Stockfish returned no line for {board.fen()}")
    return scores[0], (scores[1] if len(scores) > 1 else None), list(infos[0]["pv"])


def _first_move_problem(best: LineScore, min_first_cp: int) -> str | None:
    if best.mates or (best.mate is None and best.cp >= min_first_cp):
        return None
    got = f"mated in {-best.mate}" if best.mate is not None else f"{best.cp} cp"
    return f"first move not winning ({got} < {min_first_cp} cp)"


def _reply(engine: EngineHandle, board: chess.Board, pv: list[chess.Move]) -> chess.Move:
    """The engine's best reply: the principal variation's next move, or a fresh search when it stops."""
    if len(pv) > 1 and pv[1] in board.legal_moves:
        return pv[1]
    return _search(engine, board)[2][0]


def check_position(board: chess.Board, engine: EngineHandle, gap: float = 0.5, min_first_cp: int = 200,
                   max_solver_moves: int = 5) -> UniquenessResult:
    """Uniqueness of a position whose side to move is the solver (see the module docstring)."""
    board = board.copy(stack=False)
    line: list[str] = []
    first = None

    def fail(kind: str, reason: str) -> UniquenessResult:
        return UniquenessResult(False, kind, reason, line, first)

    try:
        for k in range(max_solver_moves):
            if board.is_game_over(claim_draw=False):
                if k == 0:
                    return fail("game_over", f"game already over ({board.result()})")
                break  # e.g. the engine's reply stalemated: the line ends, keep what was unique
            best, second, pv = _search(engine, board)
            if k == 0:
                first = best
                if problem := _first_move_problem(best, min_first_cp):
                    return fail("not_winning", problem)
            problem = step_problem(best, second, gap)
            if problem and (k == 0 or first.mates):
                return fail(problem[0], f"solver move {k + 1}: {problem[1]}")
            if problem:
                break
            if first.mates and not best.mates:
                return fail("mate_lost", f"solver move {k + 1}: the mate was lost ({best.cp} cp; too few nodes?)")
            board.push_uci(best.move)
            line.append(best.move)
            if board.is_checkmate():
                return UniquenessResult(True, "unique", "unique", line, first, mate=True)
            if board.is_game_over(claim_draw=False) or k == max_solver_moves - 1:
                break
            reply = _reply(engine, board, pv)
            board.push(reply)
            line.append(reply.uci())
    except EngineFailure as exc:
        return UniquenessResult(None, "engine_failed", str(exc), line, first)
    if len(line) % 2 == 0:
        line = line[:-1]  # end on the solver's move
    return UniquenessResult(True, "unique", "unique", line, first)


def check_line(board: chess.Board, solution: Sequence[str], engine: EngineHandle, gap: float = 0.5,
               min_first_cp: int = 200) -> UniquenessResult:
    """Uniqueness of a known solution (solver move, reply, …, ending on a solver move)."""
    board = board.copy(stack=False)
    line, first = list(solution), None

    def fail(kind: str, reason: str) -> UniquenessResult:
        return UniquenessResult(False, kind, reason, line, first)

    try:
        for i in range(0, len(solution), 2):
            k, expected = i // 2, solution[i]
            best, second, _ = _search(engine, board)
            if k == 0:
                first = best
                if problem := _first_move_problem(best, min_first_cp):
                    return fail("not_winning", problem)
            if problem := step_problem(best, second, gap):
                return fail(problem[0], f"solver move {k + 1}: {problem[1]}")
            board.push_uci(expected)
            if best.move != expected and not (best.mate == 1 and board.is_checkmate()):
                return fail("engine_disagrees", f"solver move {k + 1}: engine prefers {best.move} to {expected}")
            if i + 1 < len(solution):
                board.push_uci(solution[i + 1])
    except EngineFailure as exc:
        return UniquenessResult(None, "engine_failed", str(exc), line, first)
    return UniquenessResult(True, "unique", "unique", line, first, mate=board.is_checkmate())
