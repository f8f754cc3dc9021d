"""Puzzle themes from a solution line, by rules written from chess definitions (no engine).

Input: the position the solver faces and the solution, solver move first (solver, reply,
solver, …, ending on a solver move). Output: a set of Lichess theme keys
(``../shared/data/chess/themes.md``) out of ``SUPPORTED_THEMES``. Piece values P1 N3 B3 R5 Q9
(king 100 where it is a target); "attacked" is python-chess's (pseudo-legal) attack. Where a
definition left a threshold open it was chosen on a seeded development sample of the shared
Lichess puzzles, disjoint from the one ``scripts/measure_chess_rewards.py`` reports on
(``docs/chess.md`` has the numbers).

Length, goal, phase: ``oneMove`` / ``short`` / ``long`` / ``veryLong`` (1, 2, 3, ≥4 solver
moves); ``mate`` and ``mateIn1`` … ``mateIn5`` (5 = five or more) when the line ends in mate;
``endgame`` / ``middlegame`` / ``opening`` from the material of the starting position
(``phase``; no game history is needed, so it works on generated boards).

Mate patterns, on the final position (K = the mated king):
- ``backRankMate``: K on its own first rank, every checker a rook or queen on that rank, and all
  squares of the rank in front of K held by K's own pieces.
- ``smotheredMate``: a lone knight check, every square next to K held by K's own pieces.
- ``arabianMate``: K in a corner, checked by an adjacent rook that a knight guards.
- ``hookMate``: checked by an adjacent rook guarded by a knight that a pawn guards.
- ``dovetailMate``: a guarded queen diagonally next to K gives check, and the two squares next to
  K that the queen does not reach hold K's own pieces.
- ``doubleBishopMate``: only bishops check, and two or more solver bishops cover K's square and
  every flight square not blocked by K's own pieces.

Solver-move motifs (each needs its follow-up in the line: a motif that is not cashed in is not
what the puzzle is about):
- ``fork``: the moved piece (not the king) attacks two or more non-pawn targets (the king, a
  piece worth more than it, or an undefended one), cannot be taken for free or by something
  cheaper, and captures one of them on the next solver move.
- ``pin``: a non-checking move of a slider pins a piece to the king or queen behind it, and that
  piece is captured later (followed as it moves), or the line ends with it attacked by something
  cheaper or undefended; or the moved piece stands where a pinned piece attacks it and no legal
  move can take it.
- ``skewer``: the moved slider attacks a valuable piece (a target as for ``fork``) with a cheaper
  opponent piece behind it; the front piece moves away and the next solver move captures on the
  square behind.
- ``discoveredAttack``: a move (not castling) uncovers a solver slider's attack on a non-pawn
  target; on the next solver move the uncovered slider or the moved piece captures (the target
  itself, unless it was the king or the moved piece does the capturing).
- ``discoveredCheck``: check by a piece other than the one that moved (castling excluded);
  ``doubleCheck``: two checkers at once.
- ``hangingPiece``: in a puzzle of at most three solver moves that does not end in mate, the
  first move captures an undefended knight or better.
- ``sacrifice``: after one of the solver's moves from the second on, the solver's material
  balance is at least 2 below where it started (measured after the solver's own moves, so that a
  piece given and taken straight back is an exchange).
- ``promotion`` / ``underPromotion`` / ``enPassant`` / ``castling``: a solver move of that kind;
  ``advancedPawn``: a solver pawn move to its seventh or eighth rank.
- ``attackingF2F7``: capturing the pawn on f7 (f2) with check while the king is still on e8 (e1).
- ``kingsideAttack`` / ``queensideAttack``: not an endgame, the opponent king on files f–h / a–c
  of its first rank with no castling rights left, and a solver move gives check.
- Endgame types, on the starting position, in the endgame phase: ``pawnEndgame`` (kings and
  pawns), ``rookEndgame`` / ``bishopEndgame`` / ``knightEndgame`` / ``queenEndgame`` (only that
  piece type besides kings and pawns), ``queenRookEndgame`` (queen(s) on one side, rook(s) on the
  other, nothing else).

Not tagged (needs an engine, a game history, or rules not written yet): advantage, crushing,
equality, deflection, attraction, clearance, interference, intermezzo, quietMove,
defensiveMove, zugzwang, trappedPiece, xRayAttack, capturingDefender, exposedKing, and the other
mate patterns (Anastasia, Boden, Opera, Pillsbury, …).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import chess

VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 100}
SLIDERS = (chess.BISHOP, chess.ROOK, chess.QUEEN)
LENGTH_THEMES = ("oneMove", "short", "long", "veryLong")
MATE_THEMES = ("mate", "mateIn1", "mateIn2", "mateIn3", "mateIn4", "mateIn5")


@dataclass(frozen=True)
class Ply:
    before: chess.Board
    move: chess.Move
    after: chess.Board


@dataclass(frozen=True)
class Line:
    """A solution replayed: ``plies[0::2]`` are the solver's, ``plies[1::2]`` the replies."""

    plies: tuple[Ply, ...]
    solver: chess.Color

    @property
    def solver_plies(self) -> tuple[Ply, ...]:
        return self.plies[0::2]

    @property
    def final(self) -> chess.Board:
        return self.plies[-1].after


def replay(board: chess.Board, solution: Sequence[str | chess.Move]) -> Line:
    """Play ``solution`` (UCI strings or Moves) from ``board``; raises ValueError on an illegal move."""
    if not solution:
        raise ValueError("a solution needs at least one move")
    plies, current = [], board.copy(stack=False)
    for move in solution:
        move = chess.Move.from_uci(move) if isinstance(move, str) else move
        if move not in current.legal_moves:
            raise ValueError(f"illegal move {move.uci()} in {current.fen()}")
        after = current.copy(stack=False)
        after.push(move)
        plies.append(Ply(current, move, after))
        current = after
    return Line(tuple(plies), board.turn)


def _value(board: chess.Board, square: chess.Square) -> int:
    return VALUE[board.piece_type_at(square)]


def _cheapest_attacker(board: chess.Board, color: chess.Color, square: chess.Square) -> int | None:
    values = [_value(board, s) for s in board.attackers(color, square)]
    return min(values) if values else None


def _en_prise(board: chess.Board, square: chess.Square) -> bool:
    """The piece on ``square`` can be taken for free or by something cheaper."""
    color = board.color_at(square)
    cheapest = _cheapest_attacker(board, not color, square)
    if cheapest is None:
        return False
    return not board.is_attacked_by(color, square) or cheapest < _value(board, square)


def _is_target(board: chess.Board, square: chess.Square, attacker_value: int) -> bool:
    """Worth attacking with a piece of ``attacker_value``: the king, a dearer piece, or an undefended one."""
    piece = board.piece_at(square)
    return (piece.piece_type == chess.KING or VALUE[piece.piece_type] > attacker_value
            or not board.is_attacked_by(piece.color, square))


def _material(board: chess.Board, color: chess.Color) -> int:
    return sum(VALUE[p] * len(board.pieces(p, color)) for p in VALUE if p != chess.KING)


def _balance(board: chess.Board, color: chess.Color) -> int:
    return _material(board, color) - _material(board, not color)


def _captures_on(ply: Ply, square: chess.Square, piece: chess.Piece | None = None) -> bool:
    """The ply captures on ``square`` (the piece there is ``piece`` when given)."""
    return (ply.move.to_square == square and ply.before.is_capture(ply.move)
            and (piece is None or ply.before.piece_at(square) == piece))


def _behind(board: chess.Board, origin: chess.Square, front: chess.Square) -> chess.Square | None:
    """The first occupied square beyond ``front`` on the line from ``origin`` through it."""
    beyond = chess.ray(origin, front) & board.occupied & ~chess.BB_SQUARES[origin] & ~chess.BB_SQUARES[front]
    candidates = [s for s in chess.scan_forward(beyond) if chess.BB_SQUARES[front] & chess.between(origin, s)]
    return min(candidates, key=lambda s: chess.square_distance(front, s)) if candidates else None


def _next_solver_ply(line: Line, i: int) -> Ply | None:
    return line.plies[i + 2] if i + 2 < len(line.plies) else None


# --- mate patterns (final position) -------------------------------------------------------------

def _mated_king(line: Line) -> chess.Square | None:
    final = line.final
    return final.king(final.turn) if final.is_checkmate() else None


def _back_rank_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    if king is None:
        return False
    color = final.turn
    home = 0 if color == chess.WHITE else 7
    checkers = list(final.checkers())
    if chess.square_rank(king) != home or not all(
            chess.square_rank(c) == home and final.piece_type_at(c) in (chess.ROOK, chess.QUEEN) for c in checkers):
        return False
    forward = home + (1 if color == chess.WHITE else -1)
    front = [chess.square(f, forward) for f in range(max(0, chess.square_file(king) - 1),
                                                     min(7, chess.square_file(king) + 1) + 1)]
    return all(final.color_at(s) == color for s in front)


def _smothered_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    if king is None:
        return False
    checkers = list(final.checkers())
    return (len(checkers) == 1 and final.piece_type_at(checkers[0]) == chess.KNIGHT
            and all(final.color_at(s) == final.turn for s in chess.scan_forward(chess.BB_KING_ATTACKS[king])))


def _checker(line: Line, piece_type: chess.PieceType) -> chess.Square | None:
    final = line.final
    checkers = [c for c in final.checkers() if final.piece_type_at(c) == piece_type]
    return checkers[0] if len(list(final.checkers())) == 1 and checkers else None


def _arabian_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    if king is None or king not in (chess.A1, chess.H1, chess.A8, chess.H8):
        return False
    rook = _checker(line, chess.ROOK)
    return (rook is not None and chess.square_distance(rook, king) == 1
            and any(final.piece_type_at(s) == chess.KNIGHT for s in final.attackers(line.solver, rook)))


def _hook_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    rook = _checker(line, chess.ROOK) if king is not None else None
    if rook is None or chess.square_distance(rook, king) != 1:
        return False
    knights = [s for s in final.attackers(line.solver, rook) if final.piece_type_at(s) == chess.KNIGHT]
    return any(final.piece_type_at(p) == chess.PAWN for n in knights for p in final.attackers(line.solver, n))


def _dovetail_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    queen = _checker(line, chess.QUEEN) if king is not None else None
    if queen is None or chess.square_distance(queen, king) != 1 or (
            chess.square_file(queen) == chess.square_file(king) or chess.square_rank(queen) == chess.square_rank(king)):
        return False
    # The two squares beside the king that the queen's diagonal does not cover, i.e. the far corners' neighbours.
    df, dr = chess.square_file(king) - chess.square_file(queen), chess.square_rank(king) - chess.square_rank(queen)
    kf, kr = chess.square_file(king), chess.square_rank(king)
    blockers = [(kf + df, kr), (kf, kr + dr)]
    return (final.is_attacked_by(line.solver, queen)
            and all(0 <= f < 8 and 0 <= r < 8 and final.color_at(chess.square(f, r)) == final.turn for f, r in blockers))


def _double_bishop_mate(line: Line) -> bool:
    final, king = line.final, _mated_king(line)
    if king is None or any(final.piece_type_at(c) != chess.BISHOP for c in final.checkers()):
        return False
    bishops = final.pieces(chess.BISHOP, line.solver)
    flights = [s for s in chess.scan_forward(chess.BB_KING_ATTACKS[king]) if final.color_at(s) != final.turn]
    covering = {b for s in flights for b in final.attackers(line.solver, s) if b in bishops}
    covering |= set(final.checkers())
    return len(covering) >= 2 and all(any(b in bishops for b in final.attackers(line.solver, s)) for s in flights)


# --- solver-move motifs -------------------------------------------------------------------------

def _fork(line: Line, i: int) -> bool:
    ply, nxt = line.plies[i], _next_solver_ply(line, i)
    if nxt is None or nxt.move.from_square != ply.move.to_square:
        return False
    board, sq = ply.after, ply.move.to_square
    if board.piece_type_at(sq) == chess.KING or _en_prise(board, sq):
        return False
    v = _value(board, sq)
    targets = [t for t in chess.scan_forward(board.attacks_mask(sq) & board.occupied_co[not line.solver])
               if board.piece_type_at(t) != chess.PAWN and _is_target(board, t, v)]
    return len(targets) >= 2 and nxt.move.to_square in targets and nxt.before.is_capture(nxt.move)


def _line_pieces(line: Line, i: int) -> list[tuple[chess.Square, chess.Square]]:
    """(front, behind) opponent pairs on the moved slider's lines after solver ply ``i``."""
    ply = line.plies[i]
    board, sq = ply.after, ply.move.to_square
    if board.piece_type_at(sq) not in SLIDERS:
        return []
    pairs = []
    for front in chess.scan_forward(board.attacks_mask(sq) & board.occupied_co[not line.solver]):
        back = _behind(board, sq, front)
        if back is not None and board.color_at(back) == (not line.solver):
            pairs.append((front, back))
    return pairs


def _captured_later(line: Line, i: int, square: chess.Square) -> bool:
    """The opponent piece on ``square`` after ply ``i`` is captured by a later solver move (followed as it moves)."""
    for j in range(i + 1, len(line.plies)):
        move = line.plies[j].move
        if j % 2 == 1 and move.from_square == square:
            square = move.to_square
        elif j % 2 == 0 and move.to_square == square:
            return True
    return False


def _pin(line: Line, i: int) -> bool:
    ply = line.plies[i]
    board, them = ply.after, not line.solver
    if not board.is_check():  # a checking move wins its tempo from the check, not from a pin
        for front, back in _line_pieces(line, i):
            if board.piece_type_at(front) == chess.KING or _value(board, back) < max(9, _value(board, front) + 1):
                continue  # pinned to the king or the queen only
            if _captured_later(line, i, front):
                return True
            if i == len(line.plies) - 1:  # the line ends on the pin: the piece must be lost
                cheapest = _cheapest_attacker(board, line.solver, front)
                if cheapest is not None and (cheapest < _value(board, front)
                                             or not board.is_attacked_by(them, front)):
                    return True
    # the moved piece stands where a pinned piece attacks it, and nothing can take it
    sq = ply.move.to_square
    pinned = [d for d in board.attackers(them, sq) if board.is_pinned(them, d)]
    return bool(pinned) and not any(m.to_square == sq for m in board.legal_moves)


def _skewer(line: Line, i: int) -> bool:
    ply, nxt = line.plies[i], _next_solver_ply(line, i)
    if nxt is None:
        return False
    board, reply = ply.after, line.plies[i + 1]
    v = _value(board, ply.move.to_square)
    for front, back in _line_pieces(line, i):
        if (_value(board, front) > _value(board, back) and _is_target(board, front, v)
                and reply.move.from_square == front and _captures_on(nxt, back)):
            return True
    return False


def _discovered_attack(line: Line, i: int) -> bool:
    ply, nxt = line.plies[i], _next_solver_ply(line, i)
    before, after, moved_to = ply.before, ply.after, ply.move.to_square
    if before.is_castling(ply.move):
        return False
    them = not line.solver
    for slider in chess.scan_forward(after.occupied_co[line.solver] & ~chess.BB_SQUARES[moved_to]):
        if after.piece_type_at(slider) not in SLIDERS:
            continue
        uncovered = after.attacks_mask(slider) & ~before.attacks_mask(slider) & after.occupied_co[them]
        v = _value(after, slider)
        for target in chess.scan_forward(uncovered):
            if not _is_target(after, target, v) or after.piece_type_at(target) == chess.PAWN:
                continue
            if nxt is None:
                continue
            cashed = nxt.before.is_capture(nxt.move) and nxt.move.from_square in (slider, moved_to)
            if cashed and (after.piece_type_at(target) == chess.KING or nxt.move.to_square == target
                           or nxt.move.from_square == moved_to):
                return True
    return False


def _discovered_check(line: Line, i: int) -> bool:
    ply = line.plies[i]
    if ply.before.is_castling(ply.move):
        return False
    return any(c != ply.move.to_square for c in ply.after.checkers())


def _double_check(line: Line, i: int) -> bool:
    return len(line.plies[i].after.checkers()) >= 2


def _hanging_piece(line: Line, i: int) -> bool:
    ply = line.plies[i]
    if i != 0 or len(line.solver_plies) > 3 or line.final.is_checkmate() or not ply.before.is_capture(ply.move):
        return False
    before, sq = ply.before, ply.move.to_square
    return (not before.is_en_passant(ply.move) and _value(before, sq) >= 3
            and not before.is_attacked_by(not line.solver, sq))


def _advanced_pawn(line: Line, i: int) -> bool:
    ply = line.plies[i]
    if ply.before.piece_type_at(ply.move.from_square) != chess.PAWN:
        return False
    rank = chess.square_rank(ply.move.to_square)
    return (rank if line.solver == chess.WHITE else 7 - rank) >= 6  # to the 7th or 8th rank


def _attacking_f2f7(line: Line, i: int) -> bool:
    ply = line.plies[i]
    them = not line.solver
    target, king_home = (chess.F7, chess.E8) if line.solver == chess.WHITE else (chess.F2, chess.E1)
    return (_captures_on(ply, target, chess.Piece(chess.PAWN, them)) and ply.after.is_check()
            and ply.before.king(them) == king_home)


def _wing_attack(files: range) -> Callable[[Line, int], bool]:
    def detect(line: Line, i: int) -> bool:
        ply, them = line.plies[i], not line.solver
        king = ply.before.king(them)
        home = 0 if them == chess.WHITE else 7
        return (phase(line.plies[0].before) != "endgame" and ply.after.is_check()
                and chess.square_rank(king) == home and chess.square_file(king) in files
                and not ply.before.has_castling_rights(them))
    return detect


MOVE_MOTIFS: dict[str, Callable[[Line, int], bool]] = {
    "fork": _fork,
    "pin": _pin,
    "skewer": _skewer,
    "discoveredAttack": _discovered_attack,
    "discoveredCheck": _discovered_check,
    "doubleCheck": _double_check,
    "hangingPiece": _hanging_piece,
    "promotion": lambda line, i: line.plies[i].move.promotion is not None,
    "underPromotion": lambda line, i: line.plies[i].move.promotion not in (None, chess.QUEEN),
    "enPassant": lambda line, i: line.plies[i].before.is_en_passant(line.plies[i].move),
    "castling": lambda line, i: line.plies[i].before.is_castling(line.plies[i].move),
    "advancedPawn": _advanced_pawn,
    "attackingF2F7": _attacking_f2f7,
    "kingsideAttack": _wing_attack(range(5, 8)),
    "queensideAttack": _wing_attack(range(0, 3)),
}

MATE_PATTERNS: dict[str, Callable[[Line], bool]] = {
    "backRankMate": _back_rank_mate,
    "smotheredMate": _smothered_mate,
    "arabianMate": _arabian_mate,
    "hookMate": _hook_mate,
    "dovetailMate": _dovetail_mate,
    "doubleBishopMate": _double_bishop_mate,
}


def _sacrifice(line: Line) -> bool:
    # Measured after the solver's own moves (from the second on), so that a piece given and
    # taken straight back (Qxe8+ Rxe8 Rxe8+) is an exchange, not a sacrifice.
    start = _balance(line.plies[0].before, line.solver)
    return any(_balance(ply.after, line.solver) <= start - 2 for ply in line.plies[2::2])


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


def _endgame(board: chess.Board) -> str | None:
    """The endgame type from the piece types on the board (both sides, besides kings and pawns)."""
    present = {p for p in (chess.KNIGHT, chess.BISHOP, chess.ROOK, chess.QUEEN) if board.pieces_mask(p, chess.WHITE)
               | board.pieces_mask(p, chess.BLACK)}
    if present == {chess.QUEEN, chess.ROOK}:
        # queen against rook(s): one side has the queens, the other only rooks
        queens = [c for c in chess.COLORS if board.pieces_mask(chess.QUEEN, c)]
        return "queenRookEndgame" if len(queens) == 1 and board.pieces_mask(chess.ROOK, not queens[0]) else None
    single = {frozenset(): "pawnEndgame", frozenset({chess.ROOK}): "rookEndgame",
              frozenset({chess.BISHOP}): "bishopEndgame", frozenset({chess.KNIGHT}): "knightEndgame",
              frozenset({chess.QUEEN}): "queenEndgame"}
    return single.get(frozenset(present))


SUPPORTED_THEMES: tuple[str, ...] = (
    *LENGTH_THEMES, *MATE_THEMES, *MATE_PATTERNS, *MOVE_MOTIFS, "sacrifice", "opening", "middlegame", "endgame",
    "pawnEndgame", "rookEndgame", "bishopEndgame", "knightEndgame", "queenEndgame", "queenRookEndgame")


def tag_line(line: Line) -> set[str]:
    """Themes of a replayed solution (see the module docstring)."""
    n = len(line.solver_plies)
    tags = {LENGTH_THEMES[min(n, 4) - 1]}
    if line.final.is_checkmate():
        tags |= {"mate", f"mateIn{min(n, 5)}"}
        tags |= {name for name, detect in MATE_PATTERNS.items() if detect(line)}
    for name, detect in MOVE_MOTIFS.items():
        if any(detect(line, i) for i in range(0, len(line.plies), 2)):
            tags.add(name)
    if _sacrifice(line):
        tags.add("sacrifice")
    start = line.plies[0].before
    tags.add(phase(start))
    if phase(start) == "endgame" and _endgame(start):
        tags.add(_endgame(start))
    return tags


def tag_themes(board: chess.Board, solution: Sequence[str | chess.Move]) -> set[str]:
    """Themes of ``solution`` played from ``board`` (solver to move).

    >>> sorted(tag_themes(chess.Board("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"), ["a1a8"]))
    ['backRankMate', 'endgame', 'mate', 'mateIn1', 'oneMove', 'rookEndgame']
    """
    return tag_line(replay(board, solution))
