"""A puzzle's solution replayed move by move, and the piece-safety notions the theme rules share.

``Line.plies[0::2]`` are the solver's moves, ``plies[1::2]`` the opponent's replies; ``setup``
is the opponent's move that led to the solver's position when it is known (a Lichess puzzle's
first move; a generated board has none, and rules that need it then do not fire).
Piece values P1 N3 B3 R5 Q9, king 100 where it is a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import chess

VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 100}
SLIDERS = (chess.BISHOP, chess.ROOK, chess.QUEEN)


@dataclass(frozen=True)
class Ply:
    before: chess.Board
    move: chess.Move
    after: chess.Board

    @property
    def captured(self) -> chess.Piece | None:
        """The piece taken by this move (en passant: None, it is not on the target square)."""
        return self.before.piece_at(self.move.to_square)

    @property
    def moved(self) -> chess.PieceType:
        """The moving piece's type where it lands (a promotion's new piece)."""
        return self.after.piece_type_at(self.move.to_square)

    def attacks_them(self) -> bool:
        """The moved piece attacks an opponent piece from its new square."""
        mover = self.after.color_at(self.move.to_square)
        return bool(self.after.attacks_mask(self.move.to_square) & self.after.occupied_co[not mover])


@dataclass(frozen=True)
class Line:
    """A solution replayed: ``plies[0::2]`` are the solver's, ``plies[1::2]`` the replies."""

    plies: tuple[Ply, ...]
    solver: chess.Color
    setup: Ply | None = None

    @property
    def solver_plies(self) -> tuple[Ply, ...]:
        return self.plies[0::2]

    @property
    def final(self) -> chess.Board:
        return self.plies[-1].after

    @property
    def start(self) -> chess.Board:
        return self.plies[0].before

    def prev(self, i: int) -> Ply | None:
        """The ply before ply ``i`` (the setup move before the first; None when unknown)."""
        return self.plies[i - 1] if i > 0 else self.setup


def _play(board: chess.Board, move: str | chess.Move) -> Ply:
    move = chess.Move.from_uci(move) if isinstance(move, str) else move
    if move not in board.legal_moves:
        raise ValueError(f"illegal move {move.uci()} in {board.fen()}")
    after = board.copy(stack=False)
    after.push(move)
    return Ply(board, move, after)


def replay(board: chess.Board, solution: Sequence[str | chess.Move],
           setup: tuple[chess.Board, str | chess.Move] | None = None) -> Line:
    """Play ``solution`` (UCI strings or Moves) from ``board``; raises ValueError on an illegal move.
    ``setup``: (position before it, move) of the opponent's move into ``board``, when known."""
    if not solution:
        raise ValueError("a solution needs at least one move")
    setup_ply = None
    if setup is not None:
        setup_ply = _play(setup[0].copy(stack=False), setup[1])
        if setup_ply.after.fen() != board.fen():
            raise ValueError(f"setup move {setup_ply.move.uci()} leads to {setup_ply.after.fen()}, not {board.fen()}")
    plies, current = [], board.copy(stack=False)
    for move in solution:
        plies.append(_play(current, move))
        current = plies[-1].after
    return Line(tuple(plies), board.turn, setup_ply)


def value(board: chess.Board, square: chess.Square) -> int:
    return VALUE[board.piece_type_at(square)]


def defended(board: chess.Board, square: chess.Square) -> bool:
    """The piece on ``square`` is guarded by its own side: directly, or through an enemy slider
    that attacks it (an x-ray guard: once that slider takes, the guard behind it recaptures)."""
    color = board.color_at(square)
    if board.attackers_mask(color, square):
        return True
    for attacker in board.attackers(not color, square):
        if board.piece_type_at(attacker) in SLIDERS:
            without = board.copy(stack=False)
            without.remove_piece_at(attacker)
            if without.attackers_mask(color, square):
                return True
    return False


def takeable_by_cheaper(board: chess.Board, square: chess.Square) -> bool:
    color, v = board.color_at(square), value(board, square)
    return any(board.piece_type_at(a) != chess.KING and value(board, a) < v
               for a in board.attackers(not color, square))


def bad_spot(board: chess.Board, square: chess.Square) -> bool:
    """The piece on ``square`` is attacked and either unguarded or takeable by something cheaper."""
    color = board.color_at(square)
    return bool(board.attackers_mask(not color, square)) and (
        not defended(board, square) or takeable_by_cheaper(board, square))


def trapped(board: chess.Board, square: chess.Square) -> bool:
    """The piece on ``square`` (side to move's, not a pawn or king, not pinned, no check) stands
    badly and every move it has either lands badly too or takes something cheaper."""
    piece = board.piece_at(square)
    if (piece is None or piece.piece_type in (chess.PAWN, chess.KING) or board.is_check()
            or board.is_pinned(board.turn, square) or not bad_spot(board, square)):
        return False
    for move in board.legal_moves:
        if move.from_square != square:
            continue
        taken = board.piece_at(move.to_square)
        if taken is not None and VALUE[taken.piece_type] >= VALUE[piece.piece_type]:
            return False
        after = board.copy(stack=False)
        after.push(move)
        if not bad_spot(after, move.to_square):
            return False
    return True


def relative_rank(square: chess.Square, color: chess.Color) -> int:
    """0 … 7 counted from ``color``'s own first rank."""
    return chess.square_rank(square) if color == chess.WHITE else 7 - chess.square_rank(square)


def advanced_pawn_move(ply: Ply, min_rank: int = 5) -> bool:
    """A promotion, or a pawn move to ``min_rank`` or further (0-based from the mover's side: 5 = sixth rank)."""
    if ply.move.promotion:
        return True
    return (ply.before.piece_type_at(ply.move.from_square) == chess.PAWN
            and relative_rank(ply.move.to_square, ply.before.turn) >= min_rank)


def material(board: chess.Board, color: chess.Color) -> int:
    return sum(VALUE[p] * len(board.pieces(p, color)) for p in VALUE if p != chess.KING)


def balance(board: chess.Board, color: chess.Color) -> int:
    return material(board, color) - material(board, not color)
