"""Legality of a generated board (METHODS §4): could this position occur, and may an engine see it?

A board is legal when it parses, and: each side has exactly one king; no pawn stands on the
first or eighth rank; the side not to move is not in check; each side has at most 16 pieces and
at most 8 pawns; and python-chess finds nothing else wrong (``Board.status()``: impossible
check configurations, castling rights without the king and rook on their squares, an
en-passant square with no pawn that could just have moved there, …). Stockfish may crash on an
illegal position, so nothing reaches the engine before it passes here.

``strict_material`` adds a plausibility rule METHODS does not ask for: every piece beyond the
initial set (a third knight, a second queen, …) must be accounted for by a missing pawn.
"""

from __future__ import annotations

import chess

# python-chess status flags, by the name a report shows. EMPTY / NO_*_KING / TOO_MANY_KINGS /
# PAWNS_ON_BACKRANK / OPPOSITE_CHECK / TOO_MANY_* duplicate the explicit rules below (and RACE_* belong to a variant): not listed.
_STATUS_NAMES = {
    chess.STATUS_BAD_CASTLING_RIGHTS: "bad_castling_rights",
    chess.STATUS_INVALID_EP_SQUARE: "invalid_ep_square",
    chess.STATUS_TOO_MANY_CHECKERS: "too_many_checkers",
    chess.STATUS_IMPOSSIBLE_CHECK: "impossible_check",
}
_INITIAL_COUNT = {chess.KNIGHT: 2, chess.BISHOP: 2, chess.ROOK: 2, chess.QUEEN: 1}


def parse_board(fen: str) -> chess.Board | None:
    """A python-chess board, or None when the FEN does not parse."""
    try:
        return chess.Board(fen)
    except ValueError:
        return None


def _promoted_at_least(board: chess.Board, color: chess.Color) -> int:
    return sum(max(0, len(board.pieces(p, color)) - n) for p, n in _INITIAL_COUNT.items())


def legality_problems(fen: str, strict_material: bool = False) -> list[str]:
    """Every rule a FEN breaks, as short names; ``[]`` means legal.

    >>> legality_problems("4k3/8/8/8/8/8/8/4K3 w - - 0 1")
    []
    >>> legality_problems("4k3/8/8/8/8/8/8/P3K3 b - - 0 1")
    ['pawn_on_back_rank']
    """
    board = parse_board(fen)
    if board is None:
        return ["unparseable_fen"]
    problems = []
    for color, name in ((chess.WHITE, "white"), (chess.BLACK, "black")):
        kings = len(board.pieces(chess.KING, color))
        if kings != 1:
            problems.append(f"{name}_has_{kings}_kings")
        if chess.popcount(board.occupied_co[color]) > 16:
            problems.append(f"{name}_has_over_16_pieces")
        pawns = len(board.pieces(chess.PAWN, color))
        if pawns > 8:
            problems.append(f"{name}_has_over_8_pawns")
        if strict_material and _promoted_at_least(board, color) > 8 - pawns:
            problems.append(f"{name}_promoted_pieces_exceed_missing_pawns")
    if board.pawns & chess.BB_BACKRANKS:
        problems.append("pawn_on_back_rank")
    if all(len(board.pieces(chess.KING, c)) == 1 for c in chess.COLORS) and board.was_into_check():
        problems.append("side_not_to_move_in_check")
    status = board.status()
    problems += [name for flag, name in _STATUS_NAMES.items() if status & flag]
    return problems


def is_legal(fen: str, strict_material: bool = False) -> bool:
    return not legality_problems(fen, strict_material)
