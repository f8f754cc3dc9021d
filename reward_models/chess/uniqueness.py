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

Lichess's generator (lichess-puzzler) is stricter, and searches far deeper (up to 25M nodes):
the solver's best move must beat the second by more than 0.7 win chance at every move (a mate
counts as 1, so a longer mate with any alternative above ≈ 165 cp fails), stay ≥ 200 cp at every
move, and at a mate in one the best non-mating move must score ≤ 0.6 win chance. ``LICHESS``
holds those thresholds; with ``deep_nodes`` a step whose verdict is within ``margin`` win chance
of a threshold (or failing) is searched again that deep, and the deeper search decides: the
cheap search settles the clear cases, the expensive one only the close ones. ``LICHESS_GENERATOR``
is the generator of 2021–22 (its cp scale and win chance, and ``cook_mate``'s mate logic: a mate in
≤ 15 announced at every later solver move of a mating line, searched deeper when it is not;
five lines at a mate in one with several mating moves; see ``Rule`` and docs/chess.md). Its cp
scale is for Stockfish 15.1; ``lichess_generator(engine_name)`` converts another version's cp
(``generator_units``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import chess

from reward_models.chess.engine import EngineFailure, EngineHandle

WIN_CHANCE_K = 0.00368208
FAILURE_KINDS = ("not_winning", "close_second", "second_mate", "mate_lost", "engine_disagrees", "game_over",
                 "engine_failed")
# lichess-puzzler's generator.py, ``mate_soon = Mate(15)``: in ``cook_mate`` every solver move's best must be
# a mate in at most this many ("we're probably not searching deep enough" otherwise)
MATE_SOON = 15
# its ``is_valid_mate_in_one`` of 2020-12 to 2023-04 (v27–v48; e.g. commit eb747a9, 2021-02-14): with a second
# mate in one, ``multipv = 5`` lines, and any of them that is not a mate in one may score at most 0.6 win
# chance; since 3392708 / 77d0a12 (2023-04-08) it searches ``mates + 1`` lines and reads only the last one
MATE_IN_ONE_LINES_2020_22 = 5


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


@dataclass(frozen=True)
class Rule:
    """Thresholds of the per-move uniqueness rule (see the module docstring).

    gap: W(best) − W(second) must reach this (W of a mate = 1); ``strict_gap``: must exceed it
    and a longer mate's alternatives count too (Lichess), else only a second *mate* breaks a mate;
    min_first_cp: the first move's score (cp) at least; ``every_move_cp``: every solver move's too;
    mate_in_one_max: at a mate in one, the best non-mating move's W at most this (None: no limit);
    deep_nodes / margin: re-search a step at ``deep_nodes`` when its slack is below ``margin``;
    cp_scale: multiply the engine's cp by this before judging (Lichess's thresholds were set on
    deeper searches of other Stockfish versions, on a larger scale: ``themes.EVAL_SCALE``, or
    ``SF15_1_TO_SF12_15`` from Stockfish's own source);
    win_k: the win-chance constant of W, 2/(1+exp(−win_k·cp)) − 1 (0.004 in lichess-puzzler
    until 2022-08-22, then ``WIN_CHANCE_K``);
    mate_within: in a mating line (the first move mates), every later solver move's best must be a
    mate in at most this many (``MATE_SOON``), else "mate_lost" — and such a step is searched again
    at ``deep_nodes`` first, since a mate expected but not announced is a search too shallow;
    None: a later step is judged by its score like any other (the other rules);
    mate_in_one_lines: at a mate in one with several mating moves, the lines searched for the best
    non-mating move: None → one more than the mates in one; N → N lines (a non-mate among them is
    the best one; none, when there are ≥ N mates in one: unique).
    """

    gap: float = 0.5
    min_first_cp: int = 200
    strict_gap: bool = False
    every_move_cp: bool = False
    mate_in_one_max: float | None = None
    deep_nodes: int | None = None
    margin: float = 0.15
    cp_scale: float = 1.0
    win_k: float = WIN_CHANCE_K
    mate_within: int | None = None
    mate_in_one_lines: int | None = None


DEFAULT_RULE = Rule()
LICHESS = Rule(gap=0.7, strict_gap=True, every_move_cp=True, mate_in_one_max=0.6)
# Stockfish 12–15 printed cp = internal / PawnValueEg (208); 15.1 (Debian bookworm's) prints internal /
# NormalizeToPawnValue (361), so the same internal score reads 361/208 ≈ 1.74× larger in the versions
# lichess-puzzler ran in 2020–22, when most of the puzzle database was generated (src/uci.cpp)
SF15_1_TO_SF12_15 = 361 / 208
# printed cp × this = Stockfish 12–15's printed cp, by release (src/uci.cpp and uci.h of each tag): 15.1 divides
# by NormalizeToPawnValue 361, 16 by 328, 16.1 by 356; from 17 on the divisor depends on the position's material
_TO_SF12_15_UNITS = {"12": 1.0, "13": 1.0, "14": 1.0, "14.1": 1.0, "15": 1.0, "15.1": SF15_1_TO_SF12_15,
                     "16": 328 / 208, "16.1": 356 / 208}


def generator_units(engine_name: str) -> float:
    """The factor from the cp that the engine named ``engine_name`` (its UCI ``id name``, e.g.
    "Stockfish 15.1") prints to Stockfish 12–15's printed cp, the units lichess-puzzler's thresholds
    were set in. Raises ValueError for an engine whose units are not a known constant (Stockfish 17
    and later, development builds, other engines)."""
    version = engine_name.removeprefix("Stockfish ").strip()
    if version not in _TO_SF12_15_UNITS:
        raise ValueError(f"no known cp scale for the engine {engine_name!r} (known: Stockfish "
                         f"{', '.join(_TO_SF12_15_UNITS)}); rule 'lichess_generator' needs one")
    return _TO_SF12_15_UNITS[version]


# Lichess's generator as it ran then (v44–v48, 2021-02 to 2022-08): its thresholds on that cp scale, its win
# chance of the time, and cook_mate's mate logic (MATE_SOON, MATE_IN_ONE_LINES_2020_22). The cp scale here
# is Stockfish 15.1's; ``lichess_generator(engine_name)`` gives the rule for another engine.
LICHESS_GENERATOR = dataclasses.replace(LICHESS, cp_scale=SF15_1_TO_SF12_15, win_k=0.004, mate_within=MATE_SOON,
                                        mate_in_one_lines=MATE_IN_ONE_LINES_2020_22)


def lichess_generator(engine_name: str) -> Rule:
    """``LICHESS_GENERATOR`` for the engine named ``engine_name``: its cp converted to the generator's units."""
    return dataclasses.replace(LICHESS_GENERATOR, cp_scale=generator_units(engine_name))


@dataclass
class UniquenessResult:
    unique: bool | None               # None: the engine failed (score NaN)
    kind: str                         # "unique", or one of FAILURE_KINDS
    reason: str                       # human-readable detail
    line: list[str] = field(default_factory=list)  # solution followed, UCI: solver, reply, solver, …
    first: LineScore | None = None    # the engine's best first move
    mate: bool = False                # the line ends in checkmate
    last: LineScore | None = None     # the engine's best line at the last solver move searched
    steps: list[dict] = field(default_factory=list)  # per search: nodes, best, second (for measurement)

    @property
    def solver_moves(self) -> int:
        return (len(self.line) + 1) // 2


def _search(engine: EngineHandle, board: chess.Board, nodes: int | None = None,
            multipv: int = 2) -> tuple[LineScore, LineScore | None, list[chess.Move], list[LineScore]]:
    # a deeper search's time cap allows 100k nodes/s at least (≥ 60 s), so a loaded machine does not cut it short
    limit = None if nodes is None else dataclasses.replace(engine.limit, nodes=nodes,
                                                           time=max(engine.limit.time, 60.0, nodes / 100_000))
    infos = engine.analyse(board, multipv=multipv, limit=limit)
    scores = line_scores(infos, board.turn)
    if not scores:
        raise EngineFailure(f"Stockfish returned no line for {board.fen()}")
    return scores[0], (scores[1] if len(scores) > 1 else None), list(infos[0]["pv"]), scores


def _mates_in_one(board: chess.Board) -> int:
    count = 0
    for move in board.legal_moves:
        board.push(move)
        count += board.is_checkmate()
        board.pop()
    return count


def _scaled(score: LineScore | None, k: float, exact: bool = False) -> LineScore | None:
    """The score with its cp × k (rounded to a cp, as an engine prints it, unless ``exact``)."""
    if score is None or score.cp is None:
        return score
    return dataclasses.replace(score, cp=score.cp * k if exact else round(score.cp * k))


def _judge(best: LineScore, second: LineScore | None, rule: Rule, first_move: bool,
           non_mating: LineScore | None, expect_mate: bool = False) -> tuple[tuple[str, str] | None, float]:
    """(problem or None, slack): how far, in win chance, the step is from its nearest threshold
    (negative when it fails). ``non_mating``: the best non-mating move at a mate in one;
    ``expect_mate``: a later solver move of a mating line (``rule.mate_within`` applies)."""
    if expect_mate and rule.mate_within is not None and not (best.mates and best.mate <= rule.mate_within):
        got = f"mate in {best.mate}" if best.mate is not None else f"{best.cp} cp"
        return ("mate_lost", f"the mate was lost ({got}, not a mate in ≤ {rule.mate_within}; too few nodes?)"), -1.0
    if rule.cp_scale != 1.0:
        best, second, non_mating = (_scaled(x, rule.cp_scale) for x in (best, second, non_mating))
    cp = -10**6 if best.mate is not None else best.cp
    if rule.win_k != WIN_CHANCE_K:  # W with win_k on cp = W with WIN_CHANCE_K on cp·win_k/WIN_CHANCE_K
        best, second, non_mating = (_scaled(x, rule.win_k / WIN_CHANCE_K, exact=True)
                                    for x in (best, second, non_mating))
    slacks, problem = [], None
    if not best.mates and (first_move or rule.every_move_cp):
        slacks.append(best.win - win_chance(rule.min_first_cp * rule.win_k / WIN_CHANCE_K))
        if cp < rule.min_first_cp:
            got = f"mated in {-best.mate}" if best.mate is not None else f"{cp} cp"
            problem = ("not_winning", f"{'first' if first_move else 'solver'} move not winning "
                                      f"({got} < {rule.min_first_cp} cp)")
    if second is not None and problem is None:
        if best.mates and best.mate == 1:
            if rule.mate_in_one_max is not None:
                # is_valid_mate_in_one: only a second mate *in one* sends it to the non-mating lines; a
                # second move that mates in more (W = 1 > 0.6) fails (it was accepted offline, where the
                # non-mating line was not recorded, until 2026-12-06)
                alt = non_mating if second.mate == 1 else second
                if alt is not None:
                    slacks.append(rule.mate_in_one_max - alt.win)
                    if alt.win > rule.mate_in_one_max:
                        problem = ("close_second", f"mate in one, but {alt.move} also wins "
                                                   f"({alt.win:.2f} > {rule.mate_in_one_max} win chance)")
        elif best.mates and not rule.strict_gap:
            problem = step_problem(best, second, rule.gap)
        else:
            if best.mates and second.mates:
                problem = ("second_mate", f"{second.move} mates too (in {second.mate}; best in {best.mate})")
                slacks.append(-1.0)
            else:
                slack = best.win - second.win - rule.gap
                slacks.append(slack)
                if slack < 0 or (rule.strict_gap and slack == 0):
                    problem = ("close_second", f"second-best move {second.move} is within {rule.gap} win chance "
                                               f"({best.win:.2f} vs {second.win:.2f})")
    return problem, min(slacks, default=1.0)


def _step(engine: EngineHandle, board: chess.Board, rule: Rule, first_move: bool, steps: list[dict],
          expect_mate: bool = False):
    """Search one solver position (again, deeper, when the verdict is close): best, second, pv, problem.
    ``expect_mate``: a later solver move of a mating line (see ``Rule.mate_within``). Each search is
    recorded in ``steps`` with the best non-mating line of a multi-mate mate in one ("non_mating")."""
    nodes = None
    while True:
        best, second, pv, _ = _search(engine, board, nodes)
        non_mating = None
        if rule.mate_in_one_max is not None and best.mate == 1 and second is not None and second.mate == 1:
            mates = _mates_in_one(board)
            scores = _search(engine, board, nodes, multipv=rule.mate_in_one_lines or mates + 1)[3]
            non_mating = scores[mates] if len(scores) > mates else None  # lines are ordered: the best non-mate
        problem, slack = _judge(best, second, rule, first_move, non_mating, expect_mate)
        steps.append({"fen": board.fen(), "nodes": nodes or engine.limit.nodes, "best": dataclasses.asdict(best),
                      "second": second and dataclasses.asdict(second),
                      "non_mating": non_mating and dataclasses.asdict(non_mating), "problem": problem and problem[0],
                      "slack": round(slack, 4)})
        if nodes is not None or rule.deep_nodes is None or slack >= rule.margin:
            return best, second, pv, problem
        nodes = rule.deep_nodes


def _reply(engine: EngineHandle, board: chess.Board, pv: list[chess.Move]) -> chess.Move:
    """The engine's best reply: the principal variation's next move, or a fresh search when it stops."""
    if len(pv) > 1 and pv[1] in board.legal_moves:
        return pv[1]
    return _search(engine, board)[2][0]


def _rule(rule: Rule | None, gap: float | None, min_first_cp: int | None) -> Rule:
    rule = rule or DEFAULT_RULE
    if gap is not None:
        rule = dataclasses.replace(rule, gap=gap)
    if min_first_cp is not None:
        rule = dataclasses.replace(rule, min_first_cp=min_first_cp)
    return rule


def check_position(board: chess.Board, engine: EngineHandle, gap: float | None = None,
                   min_first_cp: int | None = None, max_solver_moves: int = 5,
                   rule: Rule | None = None) -> UniquenessResult:
    """Uniqueness of a position whose side to move is the solver (see the module docstring).
    ``rule`` (default ``DEFAULT_RULE``; ``gap`` / ``min_first_cp`` override its fields)."""
    rule = _rule(rule, gap, min_first_cp)
    board = board.copy(stack=False)
    line: list[str] = []
    steps: list[dict] = []
    first = last = None

    def fail(kind: str, reason: str) -> UniquenessResult:
        return UniquenessResult(False, kind, reason, line, first, last=last, steps=steps)

    try:
        for k in range(max_solver_moves):
            if board.is_game_over(claim_draw=False):
                if k == 0:
                    return fail("game_over", f"game already over ({board.result()})")
                break  # e.g. the engine's reply stalemated: the line ends, keep what was unique
            best, second, pv, problem = _step(engine, board, rule, k == 0, steps, k > 0 and first.mates)
            if k == 0:
                first = best
            if problem and (k == 0 or first.mates):
                return fail(problem[0], f"solver move {k + 1}: {problem[1]}")
            if problem:
                break
            if first.mates and not best.mates:
                return fail("mate_lost", f"solver move {k + 1}: the mate was lost ({best.cp} cp; too few nodes?)")
            last = best
            board.push_uci(best.move)
            line.append(best.move)
            if board.is_checkmate():
                return UniquenessResult(True, "unique", "unique", line, first, mate=True, last=last, steps=steps)
            if board.is_game_over(claim_draw=False) or k == max_solver_moves - 1:
                break
            reply = _reply(engine, board, pv)
            board.push(reply)
            line.append(reply.uci())
    except EngineFailure as exc:
        return UniquenessResult(None, "engine_failed", str(exc), line, first, last=last, steps=steps)
    if len(line) % 2 == 0:
        line = line[:-1]  # end on the solver's move
    return UniquenessResult(True, "unique", "unique", line, first, last=last, steps=steps)


def ends_line(problem: tuple[str, str] | None, k: int, first: LineScore) -> bool:
    """Does solver move k (0-based) of a known line end it instead of failing it? Lichess's
    convention: a close second at the third solver move or later of a line that does not mate."""
    return problem is not None and problem[0] == "close_second" and k >= 2 and not first.mates


def ends_in_mate(board: chess.Board, solution: Sequence[str]) -> bool:
    """Does the line (UCI moves from ``board``) end in checkmate? A Lichess puzzle that does came
    from the generator's ``cook_mate``; one that does not, from ``cook_advantage``."""
    board = board.copy(stack=False)
    for move in solution:
        board.push_uci(move)
    return board.is_checkmate()


def check_line(board: chess.Board, solution: Sequence[str], engine: EngineHandle, gap: float | None = None,
               min_first_cp: int | None = None, rule: Rule | None = None) -> UniquenessResult:
    """Uniqueness of a known solution (solver move, reply, …, ending on a solver move).

    Lichess's generator's convention for a line that does not mate: a solver move that is not
    unique ends the line before it, and the line stands when it keeps at least two solver moves
    (the generator discards one-movers). So a close second at the third solver move or later
    gives "unique" with the line cut there (``line``); a mating line must be unique to the end."""
    rule = _rule(rule, gap, min_first_cp)
    board = board.copy(stack=False)
    line, first, last, steps = list(solution), None, None, []
    mating = ends_in_mate(board, solution)  # lichess-puzzler's cook_mate made it (Rule.mate_within applies)

    def fail(kind: str, reason: str) -> UniquenessResult:
        return UniquenessResult(False, kind, reason, line, first, last=last, steps=steps)

    try:
        for i in range(0, len(solution), 2):
            k, expected = i // 2, solution[i]
            best, second, _, problem = _step(engine, board, rule, k == 0, steps, k > 0 and mating and first.mates)
            if k == 0:
                first = best
            if ends_line(problem, k, first):
                return UniquenessResult(True, "unique", "unique", line[:i - 1], first, last=last, steps=steps)
            last = best
            if problem:
                return fail(problem[0], f"solver move {k + 1}: {problem[1]}")
            board.push_uci(expected)
            if best.move != expected and not (best.mate == 1 and board.is_checkmate()):
                return fail("engine_disagrees", f"solver move {k + 1}: engine prefers {best.move} to {expected}")
            if i + 1 < len(solution):
                board.push_uci(solution[i + 1])
    except EngineFailure as exc:
        return UniquenessResult(None, "engine_failed", str(exc), line, first, last=last, steps=steps)
    return UniquenessResult(True, "unique", "unique", line, first, mate=board.is_checkmate(), last=last, steps=steps)
