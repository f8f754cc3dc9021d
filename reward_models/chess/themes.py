"""Puzzle themes from a solution line, by rules (no engine, except the evaluation labels).

Input: the position the solver faces and the solution, solver move first (solver, reply,
solver, …, ending on a solver move); optionally the opponent's setup move into that position
(a Lichess puzzle has one, a generated board does not) and the engine's evaluation of the last
solver move. Output: a set of Lichess theme keys (``../shared/data/chess/themes.md``) out of
``SUPPORTED_THEMES``. Piece values P1 N3 B3 R5 Q9 (king 100 where it is a target); "guarded"
counts x-ray guards through an attacking slider (``line.defended``).

The definitions follow what Lichess's open-source puzzle tagger means by each theme (which
move, which square, which piece), so that our labels can agree with the labels in its
database; the code is written independently. ``docs/chess.md`` has per-theme precision and
recall on a sample of the shared Lichess puzzles that was not used to write the rules.

Length, goal, phase: ``oneMove`` / ``short`` / ``long`` / ``veryLong`` (1, 2, 3, ≥4 solver
moves); ``mate`` and ``mateIn1`` … ``mateIn5`` (5 = five or more) when the line ends in mate;
``endgame`` / ``middlegame`` / ``opening`` from the material of the starting position
(``phase``; no game history is needed, so it works on generated boards).

Evaluation (only when ``eval_cp`` is given and the line does not mate; Lichess's thresholds on
its generator's score of the last solver move, solver's view): ``crushing`` above 600 cp,
``advantage`` above 200, else ``equality``. Lichess's scores come from far deeper searches of
other Stockfish versions, on a larger centipawn scale than Stockfish 15.1's at our nodes, so our
score is multiplied by ``EVAL_SCALE`` (1.3) first: the factor that agreed best with Lichess's
labels on 250 non-mate puzzles of the tuning sample at 30,000 nodes (agreement 163/250 at
1.0, 193/250 at 1.3; Stockfish's own change of scale in 15.1, 361/208 = 1.74, gave 164/250).

Mate patterns, on the final position (K = the mated king), at most one, first match wins:
- ``smotheredMate``: a knight checks and every square next to K holds one of K's own pieces.
- ``backRankMate``: K on its first rank, the squares in front of it held by its own pieces and
  not attacked, a checker on that rank.
- ``anastasiaMate``: K on the a/h file (not in a corner rank), mated by a rook or queen move on
  that file, its own piece beside it towards the centre, a solver knight three files in.
- ``hookMate``: the last move puts a rook next to K, guarded by a knight next to K that a pawn guards.
- ``arabianMate``: K in a corner, the last move puts a rook next to it, guarded by a knight two
  squares diagonally away from K.
- ``bodenMate`` / ``doubleBishopMate``: two or more solver bishops, and K's square and its
  neighbours are attacked by bishops only; Boden when the bishops stand on both sides of K's file.
- ``dovetailMate``: K off the edge, mated by a queen move diagonally next to it; every other
  square next to K is either unattacked (its own piece stands there) or empty and hit by the
  queen alone.

Tactical motifs (``motifs.py`` has each rule's docstring): ``fork``, ``pin``, ``skewer``,
``discoveredAttack``, ``discoveredCheck``, ``doubleCheck``, ``xRayAttack``, ``hangingPiece``,
``trappedPiece``, ``sacrifice``, ``capturingDefender``, ``attraction``, ``deflection``,
``interference``, ``clearance``, ``intermezzo``, ``quietMove``, ``defensiveMove``,
``exposedKing``, ``advancedPawn``, ``attackingF2F7``, ``kingsideAttack`` / ``queensideAttack``
(not with ``backRankMate`` or ``fork``). ``intermezzo`` and ``hangingPiece`` look at the setup
move where it is known. Special moves: ``promotion``, ``underPromotion`` (a non-queen
promotion, or a knight promotion that mates), ``enPassant``, ``castling``.

Endgame types, on the starting position and after the first solver move: ``pawnEndgame``
(kings and pawns), ``queenEndgame`` / ``rookEndgame`` / ``bishopEndgame`` / ``knightEndgame``
(only that piece type besides kings and pawns), ``queenRookEndgame`` (one queen, rooks, pawns).

Not tagged: ``zugzwang`` (Lichess decides it with extra engine searches: ``zugzwang()`` here
takes an evaluation callback and is not part of ``tag_line``), ``collinear``, the game-history
themes (``master``, …) and the rarest mate patterns (Opera, Pillsbury, …).
"""

from __future__ import annotations

from typing import Callable, Sequence

import chess

from reward_models.chess import motifs
from reward_models.chess.line import VALUE, Line, Ply, replay  # noqa: F401  (re-exported)
from reward_models.chess.uniqueness import win_chance

LENGTH_THEMES = ("oneMove", "short", "long", "veryLong")
MATE_THEMES = ("mate", "mateIn1", "mateIn2", "mateIn3", "mateIn4", "mateIn5")
EVAL_THEMES = ("advantage", "crushing", "equality")
EVAL_SCALE = 1.3  # our engine's cp → Lichess's generator's cp (see the module docstring)


# --- mate patterns (final position) -------------------------------------------------------------

def _mate(line: Line) -> tuple[chess.Board, chess.Square, Ply] | None:
    final = line.final
    return (final, final.king(final.turn), line.plies[-1]) if final.is_checkmate() else None


def _around(square: chess.Square) -> list[chess.Square]:
    return list(chess.scan_forward(chess.BB_KING_ATTACKS[square]))


def _smothered_mate(line: Line) -> bool:
    final, king, _ = _mate(line)
    return (any(final.piece_type_at(c) == chess.KNIGHT for c in final.checkers())
            and all(final.color_at(s) == final.turn for s in _around(king)))


def _back_rank_mate(line: Line) -> bool:
    final, king, _ = _mate(line)
    home = 0 if final.turn == chess.WHITE else 7
    if chess.square_rank(king) != home:
        return False
    forward = home + (1 if final.turn == chess.WHITE else -1)
    front = [chess.square(f, forward) for f in range(max(0, chess.square_file(king) - 1),
                                                     min(7, chess.square_file(king) + 1) + 1)]
    if any(final.color_at(s) != final.turn or final.is_attacked_by(line.solver, s) for s in front):
        return False
    return any(chess.square_rank(c) == home for c in final.checkers())


def _anastasia_mate(line: Line) -> bool:
    final, king, last = _mate(line)
    kf, kr = chess.square_file(king), chess.square_rank(king)
    if kf not in (0, 7) or kr in (0, 7) or chess.square_file(last.move.to_square) != kf:
        return False
    if last.moved not in (chess.QUEEN, chess.ROOK):
        return False
    inward = 1 if kf == 0 else -1
    return (final.color_at(chess.square(kf + inward, kr)) == final.turn
            and final.piece_at(chess.square(kf + 3 * inward, kr)) == chess.Piece(chess.KNIGHT, line.solver))


def _hook_mate(line: Line) -> bool:
    final, king, last = _mate(line)
    rook = last.move.to_square
    if last.moved != chess.ROOK or chess.square_distance(rook, king) != 1:
        return False
    return any(final.piece_type_at(n) == chess.KNIGHT and chess.square_distance(n, king) == 1
               and any(final.piece_type_at(p) == chess.PAWN for p in final.attackers(line.solver, n))
               for n in final.attackers(line.solver, rook))


def _arabian_mate(line: Line) -> bool:
    final, king, last = _mate(line)
    rook = last.move.to_square
    if (king not in (chess.A1, chess.H1, chess.A8, chess.H8) or last.moved != chess.ROOK
            or chess.square_distance(rook, king) != 1):
        return False
    return any(final.piece_type_at(n) == chess.KNIGHT
               and abs(chess.square_rank(n) - chess.square_rank(king)) == 2
               and abs(chess.square_file(n) - chess.square_file(king)) == 2
               for n in final.attackers(line.solver, rook))


def _bishops_mate(line: Line) -> str | None:
    final, king, _ = _mate(line)
    bishops = sorted(final.pieces(chess.BISHOP, line.solver))
    if len(bishops) < 2:
        return None
    for square in [king, *_around(king)]:
        if any(final.piece_type_at(a) != chess.BISHOP for a in final.attackers(line.solver, square)):
            return None
    kf = chess.square_file(king)
    both_sides = (chess.square_file(bishops[0]) < kf) == (chess.square_file(bishops[1]) > kf)
    return "bodenMate" if both_sides else "doubleBishopMate"


def _dovetail_mate(line: Line) -> bool:
    final, king, last = _mate(line)
    queen = last.move.to_square
    kf, kr = chess.square_file(king), chess.square_rank(king)
    if (kf in (0, 7) or kr in (0, 7) or last.moved != chess.QUEEN or chess.square_distance(queen, king) != 1
            or chess.square_file(queen) == kf or chess.square_rank(queen) == kr):
        return False
    for square in _around(king):
        if square == queen:
            continue
        attackers = list(final.attackers(line.solver, square))
        if attackers == [queen]:
            if final.piece_at(square) is not None:
                return False
        elif attackers:
            return False
    return True


def mate_pattern(line: Line) -> str | None:
    """The named mate pattern of a mating line (first match in Lichess's order), or None."""
    if _mate(line) is None:
        return None
    for name, detect in (("smotheredMate", _smothered_mate), ("backRankMate", _back_rank_mate),
                         ("anastasiaMate", _anastasia_mate), ("hookMate", _hook_mate),
                         ("arabianMate", _arabian_mate)):
        if detect(line):
            return name
    return _bishops_mate(line) or ("dovetailMate" if _dovetail_mate(line) else None)


MATE_PATTERNS = ("smotheredMate", "backRankMate", "anastasiaMate", "hookMate", "arabianMate", "bodenMate",
                 "doubleBishopMate", "dovetailMate")


def _solver_any(rule: Callable[[Ply], bool]) -> Callable[[Line], bool]:
    return lambda line: any(rule(line.plies[i]) for i in range(0, len(line.plies), 2))


def _under_promotion(line: Line) -> bool:
    for ply in line.solver_plies:
        if ply.after.is_checkmate():
            return ply.move.promotion == chess.KNIGHT
        if ply.move.promotion not in (None, chess.QUEEN):
            return True
    return False


MOVE_MOTIFS: dict[str, Callable[[Line], bool]] = {
    "fork": motifs.fork,
    "pin": motifs.pin,
    "skewer": motifs.skewer,
    "discoveredAttack": motifs.discovered_attack,
    "discoveredCheck": motifs.discovered_check,
    "doubleCheck": motifs.double_check,
    "xRayAttack": motifs.x_ray,
    "hangingPiece": motifs.hanging_piece,
    "trappedPiece": motifs.trapped_piece,
    "sacrifice": motifs.sacrifice,
    "capturingDefender": motifs.capturing_defender,
    "attraction": motifs.attraction,
    "deflection": motifs.deflection,
    "interference": motifs.interference,
    "clearance": motifs.clearance,
    "intermezzo": motifs.intermezzo,
    "quietMove": motifs.quiet_move,
    "defensiveMove": motifs.defensive_move,
    "exposedKing": motifs.exposed_king,
    "advancedPawn": motifs.advanced_pawn,
    "attackingF2F7": motifs.attacking_f2f7,
    "promotion": _solver_any(lambda ply: ply.move.promotion is not None),
    "underPromotion": _under_promotion,
    "enPassant": _solver_any(lambda ply: ply.before.is_en_passant(ply.move)),
    "castling": _solver_any(lambda ply: ply.before.is_castling(ply.move)),
}
WING_THEMES = ("kingsideAttack", "queensideAttack")


def eval_theme(cp: int) -> str:
    """Lichess's goal label of a non-mating puzzle from the score of its last solver move (cp,
    solver's view): ``crushing`` above 600, ``advantage`` above 200, else ``equality``."""
    return "crushing" if cp > 600 else "advantage" if cp > 200 else "equality"


def zugzwang(line: Line, evaluate: Callable[[chess.Board], float]) -> bool:
    """After a solver move (opponent to move, not in check, at most 15 legal moves), having to
    move costs the opponent more than 0.3 win chance against passing: ``evaluate(board)`` is the
    engine's score in cp from the side to move's view (mates as ±100,000)."""
    for ply in line.solver_plies:
        board = ply.after
        if board.is_check() or board.legal_moves.count() > 15 or board.is_game_over():
            continue
        passed = board.copy(stack=False)
        passed.push(chess.Move.null())
        to_move, after_pass = evaluate(board), -evaluate(passed)  # both from the opponent's view
        if win_chance(to_move) < win_chance(after_pass) - 0.3:
            return True
    return False


def _pieces(board: chess.Board) -> int:
    """Knights, bishops, rooks and queens of both sides."""
    return chess.popcount(board.occupied & ~board.pawns & ~board.kings)


def phase(board: chess.Board) -> str:
    """``endgame`` with at most 6 pieces (N, B, R, Q of both sides); ``opening`` with at least 11
    and both first ranks still holding 4 or more of their own pieces; else ``middlegame``."""
    if _pieces(board) <= 6:
        return "endgame"
    full_back_ranks = all(chess.popcount(board.occupied_co[c] & (chess.BB_RANK_1 if c else chess.BB_RANK_8)) >= 4
                          for c in chess.COLORS)
    return "opening" if _pieces(board) >= 11 and full_back_ranks else "middlegame"


def _endgame_type(board: chess.Board) -> str | None:
    """The endgame type from the piece types on the board (both sides, besides kings and pawns)."""
    present = {p for p in (chess.KNIGHT, chess.BISHOP, chess.ROOK, chess.QUEEN)
               if board.pieces_mask(p, chess.WHITE) | board.pieces_mask(p, chess.BLACK)}
    if present == {chess.QUEEN, chess.ROOK}:
        return "queenRookEndgame" if chess.popcount(board.queens) == 1 else None
    single = {frozenset(): "pawnEndgame", frozenset({chess.ROOK}): "rookEndgame",
              frozenset({chess.BISHOP}): "bishopEndgame", frozenset({chess.KNIGHT}): "knightEndgame",
              frozenset({chess.QUEEN}): "queenEndgame"}
    return single.get(frozenset(present))


def _endgame(line: Line) -> str | None:
    kind = _endgame_type(line.start)
    return kind if kind is not None and _endgame_type(line.plies[0].after) == kind else None


ENDGAME_THEMES = ("pawnEndgame", "rookEndgame", "bishopEndgame", "knightEndgame", "queenEndgame", "queenRookEndgame")
SUPPORTED_THEMES: tuple[str, ...] = (
    *LENGTH_THEMES, *MATE_THEMES, *EVAL_THEMES, *MATE_PATTERNS, *MOVE_MOTIFS, *WING_THEMES, "opening", "middlegame",
    "endgame", *ENDGAME_THEMES)


def tag_line(line: Line, eval_cp: int | None = None, eval_scale: float = EVAL_SCALE) -> set[str]:
    """Themes of a replayed solution (see the module docstring); ``eval_cp`` (our engine's score of
    the last solver move, solver's view) adds the evaluation label of ``eval_cp · eval_scale``."""
    n = len(line.solver_plies)
    tags = {LENGTH_THEMES[min(n, 4) - 1]}
    if line.final.is_checkmate():
        tags |= {"mate", f"mateIn{min(n, 5)}"}
        if pattern := mate_pattern(line):
            tags.add(pattern)
    elif eval_cp is not None:
        tags.add(eval_theme(eval_cp * eval_scale))
    tags |= {name for name, detect in MOVE_MOTIFS.items() if detect(line)}
    if "backRankMate" not in tags and "fork" not in tags:
        if motifs.kingside_attack(line):
            tags.add("kingsideAttack")
        elif motifs.queenside_attack(line):
            tags.add("queensideAttack")
    tags.add(phase(line.start))
    if kind := _endgame(line):
        tags.add(kind)
    return tags


def tag_themes(board: chess.Board, solution: Sequence[str | chess.Move],
               setup: tuple[chess.Board, str | chess.Move] | None = None, eval_cp: int | None = None,
               eval_scale: float = EVAL_SCALE) -> set[str]:
    """Themes of ``solution`` played from ``board`` (solver to move); ``setup`` = (position before,
    move) of the opponent's move into ``board`` when known; ``eval_cp`` = the engine's score of
    the last solver move (solver's view) for the evaluation label.

    >>> sorted(tag_themes(chess.Board("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"), ["a1a8"]))
    ['backRankMate', 'endgame', 'mate', 'mateIn1', 'oneMove', 'rookEndgame']
    """
    return tag_line(replay(board, solution, setup), eval_cp, eval_scale)
