"""Tactical motifs of a solution line, one rule per Lichess theme (definitions in ``themes.py``).

Each rule takes a replayed ``Line`` and returns a bool. Index ``i`` runs over the solver's plies
(even); ``i - 1`` is the reply before it and ``i - 2`` the solver's previous move. The rules
read Lichess's theme definitions as written in its open-source puzzle tagger (what a theme
means there: which move, which square, which piece), so that our labels can agree with its
labels; the code is our own.
"""

from __future__ import annotations

import chess

from reward_models.chess.line import (SLIDERS, VALUE, Line, Ply, advanced_pawn_move, bad_spot, balance, defended,
                                      relative_rank, trapped)


def _solver(line: Line, first: int = 0) -> range:
    """Indices of the solver's plies from the ``first``-th (0-based) on."""
    return range(2 * first, len(line.plies), 2)


def _between(a: chess.Square, b: chess.Square) -> int:
    return chess.between(a, b)


def _is_capture(ply: Ply) -> bool:
    return ply.before.is_capture(ply.move)


# --- piece attacks -----------------------------------------------------------------------------

def fork(line: Line) -> bool:
    """A solver move (not the last, not by the king) to a safe square attacks two or more non-pawn
    pieces, each dearer than the mover or unguarded and not guarding the mover's square."""
    them = not line.solver
    for i in _solver(line):
        ply = line.plies[i]
        if i == len(line.plies) - 1 or ply.moved == chess.KING or bad_spot(ply.after, ply.move.to_square):
            continue
        board, sq = ply.after, ply.move.to_square
        hits = 0
        for t in chess.scan_forward(board.attacks_mask(sq) & board.occupied_co[them]):
            kind = board.piece_type_at(t)
            if kind == chess.PAWN:
                continue
            if VALUE[kind] > VALUE[ply.moved] or (not defended(board, t) and t not in board.attackers(them, sq)):
                hits += 1
        if hits >= 2:
            return True
    return False


def pin(line: Line) -> bool:
    """After a solver move an opponent piece is pinned to its king and either cannot take a solver
    piece it attacks (dearer or unguarded), or cannot escape an attack along the pin (from a
    cheaper piece, or unguarded with a move off the line)."""
    them = not line.solver
    for i in _solver(line):
        board = line.plies[i].after
        for sq in chess.scan_forward(board.occupied_co[them]):
            ray = board.pin_mask(them, sq)
            if ray == chess.BB_ALL:
                continue
            v = VALUE[board.piece_type_at(sq)]
            for target in chess.scan_forward(board.attacks_mask(sq) & board.occupied_co[line.solver] & ~ray):
                if VALUE[board.piece_type_at(target)] > v or not defended(board, target):
                    return True
            for attacker in chess.scan_forward(board.attackers_mask(line.solver, sq) & ray):
                if v > VALUE[board.piece_type_at(attacker)]:
                    return True
                if (not defended(board, sq) and sq not in board.attackers(them, attacker)
                        and any(m.from_square == sq and not chess.BB_SQUARES[m.to_square] & ray
                                for m in board.generate_pseudo_legal_moves(chess.BB_SQUARES[sq]))):
                    return True
    return False


def skewer(line: Line) -> bool:
    """A solver slider captures on a square the opponent's last moved piece stood in front of (it
    moved off the line), that piece being dearer than the one taken, which stood badly."""
    for i in _solver(line, 1):
        ply, reply = line.plies[i], line.plies[i - 1]
        taken = ply.captured
        if taken is None or ply.moved not in SLIDERS or ply.after.is_checkmate():
            continue
        if (reply.move.to_square == ply.move.to_square
                or not chess.BB_SQUARES[reply.move.from_square] & _between(ply.move.from_square, ply.move.to_square)):
            continue
        if VALUE[reply.moved] > VALUE[taken.piece_type] and bad_spot(ply.before, ply.move.to_square):
            return True
    return False


def discovered_check(line: Line) -> bool:
    """Check by a piece other than the one that moved (castling excluded)."""
    for i in _solver(line):
        ply = line.plies[i]
        if not ply.before.is_castling(ply.move) and any(c != ply.move.to_square for c in ply.after.checkers()):
            return True
    return False


def discovered_attack(line: Line) -> bool:
    """A discovered check, or a solver capture through the square its previous move vacated (by
    another piece than the one moved; a recapture of the reply's piece does not count); never
    with a double check."""
    if double_check(line):
        return False  # Lichess's labels never carry discoveredAttack with doubleCheck (tuning sample: 0 of 29)
    if discovered_check(line):
        return True
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        if not _is_capture(ply):
            continue
        if reply.move.to_square == ply.move.to_square:
            return False
        if (chess.BB_SQUARES[mine.move.from_square] & _between(ply.move.from_square, ply.move.to_square)
                and ply.move.to_square != mine.move.to_square and ply.move.from_square != mine.move.to_square
                and not mine.before.is_castling(mine.move)):
            return True
    return False


def double_check(line: Line) -> bool:
    return any(len(line.plies[i].after.checkers()) >= 2 for i in _solver(line))


def x_ray(line: Line) -> bool:
    """Solver takes on X, the opponent retakes on X from a square on the line, and the solver
    retakes on X through the square the retaking piece left."""
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        if (_is_capture(ply) and reply.move.to_square == ply.move.to_square and reply.moved != chess.KING
                and mine.move.to_square == reply.move.to_square
                and chess.BB_SQUARES[reply.move.from_square] & _between(ply.move.from_square, ply.move.to_square)):
            return True
    return False


# --- material ---------------------------------------------------------------------------------

def hanging_piece(line: Line) -> bool:
    """The first move takes an unguarded non-pawn piece (not a recapture of an equal trade made by
    the setup move), and the solver keeps the material on its next move."""
    first = line.plies[0]
    taken = first.captured
    if taken is None or taken.piece_type == chess.PAWN or defended(first.before, first.move.to_square):
        return False
    setup = line.setup
    if setup is not None and setup.move.to_square == first.move.to_square:
        lost = setup.captured
        if lost is not None and VALUE[lost.piece_type] >= VALUE[taken.piece_type]:
            return False
    if len(line.plies) < 3:
        return True
    return balance(line.plies[2].after, line.solver) >= balance(first.after, line.solver)


def trapped_piece(line: Line) -> bool:
    """A solver move from the second on takes a non-pawn piece that, before the opponent's last
    move (followed back if that piece just moved), had no safe square."""
    for i in _solver(line, 1):
        ply, reply = line.plies[i], line.plies[i - 1]
        taken = ply.captured
        if taken is None or taken.piece_type == chess.PAWN:
            continue
        square = reply.move.from_square if reply.move.to_square == ply.move.to_square else ply.move.to_square
        if trapped(reply.before, square):
            return True
    return False


def sacrifice(line: Line) -> bool:
    """After a solver move from the second on, the solver is 2 or more points below the start
    (after the solver's own moves, so a piece given and taken straight back is an exchange), and
    no reply promoted."""
    start = balance(line.start, line.solver)
    if any(line.plies[j].move.promotion for j in range(1, len(line.plies), 2)):
        return False
    return any(balance(line.plies[i].after, line.solver) <= start - 2 for i in _solver(line, 1))


def capturing_defender(line: Line) -> bool:
    """A solver move from the second on mates, or takes an unguarded piece no dearer than the
    taker; the solver's previous move (not a check) had taken the piece that guarded that square."""
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        taken, sq = ply.captured, ply.move.to_square
        if not (ply.after.is_checkmate() or (
                taken is not None and ply.moved != chess.KING and VALUE[taken.piece_type] <= VALUE[ply.moved]
                and not defended(ply.before, sq) and reply.move.to_square != sq)):
            continue
        if mine.after.is_check() or mine.move.to_square == ply.move.from_square:
            continue
        start, guard_sq = mine.before, mine.move.to_square
        guard = start.piece_at(guard_sq)
        if guard is not None and guard_sq in start.attackers(guard.color, sq) and not start.is_check():
            return True
    return False


# --- luring and blocking ------------------------------------------------------------------------

def attraction(line: Line) -> bool:
    """A solver piece is taken by the king, queen or rook on its square; the solver's next move
    attacks that square with the piece it moves, then checks (king) or takes there (queen, rook)."""
    for i in _solver(line):
        if i + 2 >= len(line.plies):
            break
        ply, reply, nxt = line.plies[i], line.plies[i + 1], line.plies[i + 2]
        sq = ply.move.to_square
        if reply.move.to_square != sq or reply.moved not in (chess.KING, chess.QUEEN, chess.ROOK):
            continue
        if nxt.move.to_square not in nxt.after.attackers(line.solver, sq):
            continue
        if reply.moved == chess.KING:
            return True
        if i + 4 < len(line.plies) and line.plies[i + 4].move.to_square == sq:
            return True
    return False


def deflection(line: Line) -> bool:
    """The solver's previous move (a sacrifice taken on its square, or a check) made an opponent
    piece leave a square it guarded; now the solver takes (or promotes) there, no longer guarded."""
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        taken, sq = ply.captured, ply.move.to_square
        if taken is None and not ply.move.promotion:
            continue
        if taken is not None and VALUE[taken.piece_type] > VALUE[ply.moved]:
            continue
        mine_taken = mine.captured
        if mine_taken is not None and VALUE[mine_taken.piece_type] >= VALUE[mine.moved]:
            continue  # the earlier move won material itself: not a lure
        if sq in (reply.move.to_square, mine.move.to_square):
            continue
        if not (reply.move.to_square == mine.move.to_square or mine.after.is_check()):
            continue
        guard = reply.move.from_square
        guarded = sq in mine.after.attacks(guard) or (
            ply.move.promotion and chess.square_file(sq) == chess.square_file(guard)
            and ply.move.from_square in mine.after.attacks(guard))
        if guarded and sq not in ply.before.attacks(reply.move.to_square):
            return True
    return False


def interference(line: Line) -> bool:
    """A solver move from the second on takes an unguarded piece whose slider guard was cut off:
    by the opponent's last move, or by the solver's previous move."""
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        taken, sq = ply.captured, ply.move.to_square
        if taken is None or defended(ply.before, sq):
            continue
        for board, blocker, ok in ((reply.before, reply.move.to_square, True),
                                   (mine.before, mine.move.to_square, sq != reply.move.to_square)):
            if not ok:
                continue
            for guard in board.attackers(taken.color, sq):
                if (board.piece_type_at(guard) in SLIDERS
                        and chess.BB_SQUARES[blocker] & _between(sq, guard)):
                    return True
    return False


def clearance(line: Line) -> bool:
    """The solver's previous move left a square (at no cost, or to a square where it stands badly)
    that a solver slider now passes through or lands on, without capturing."""
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        if ply.captured is not None or ply.moved not in SLIDERS:
            continue
        if mine.move.promotion or mine.move.to_square in (ply.move.from_square, ply.move.to_square):
            continue
        if ply.before.is_check() or (ply.after.is_check() and reply.moved == chess.KING):
            continue
        vacated = mine.move.from_square
        if not (vacated == ply.move.to_square
                or chess.BB_SQUARES[vacated] & _between(ply.move.from_square, ply.move.to_square)):
            continue
        if mine.captured is None or bad_spot(mine.after, mine.move.to_square):
            return True
    return False


def intermezzo(line: Line) -> bool:
    """The opponent took on X; instead of retaking at once (it could), the solver played another
    move, and retakes on X a move later. Decided at the first solver capture that fits."""
    them = not line.solver
    for i in _solver(line, 1):
        ply, reply, mine = line.plies[i], line.plies[i - 1], line.plies[i - 2]
        if not _is_capture(ply):
            continue
        sq = ply.move.to_square
        if reply.move.from_square in mine.after.attackers(them, sq) or mine.move.to_square == sq:
            continue
        earlier = line.prev(i - 2)
        if earlier is None:  # no setup move known (a generated board): the piece on X must have stood
            # there, takeable by this very move, since the start, and be a piece (not a pawn)
            start = mine.before
            return (i == 2 and start.color_at(sq) == them and start.piece_type_at(sq) != chess.PAWN
                    and ply.move in start.legal_moves)
        return (earlier.move.to_square == sq and _is_capture(earlier) and ply.move in mine.before.legal_moves)
    return False


# --- move character -----------------------------------------------------------------------------

def _quiet(ply: Ply) -> bool:
    return not (ply.after.is_check() or _is_capture(ply) or ply.attacks_them() or advanced_pawn_move(ply))


def quiet_move(line: Line) -> bool:
    """A solver move before the last that neither checks nor escapes a check, captures nothing,
    attacks nothing, is no advanced pawn push and no king move."""
    return any(not line.plies[i].before.is_check() and _quiet(line.plies[i]) and line.plies[i].moved != chess.KING
               for i in _solver(line) if i < len(line.plies) - 1)


def defensive_move(line: Line) -> bool:
    """The last move is quiet (as for quietMove) with at least 3 legal moves to choose from; or the
    first solver move that neither checks nor captures escapes a check, among at least 3 moves."""
    last = line.plies[-1]
    if last.before.legal_moves.count() >= 3 and _quiet(last):
        return True
    for i in _solver(line):
        ply = line.plies[i]
        if ply.after.is_check() or _is_capture(ply) or ply.before.legal_moves.count() < 3:
            return False
        if ply.before.is_check():
            return True
    return False


def exposed_king(line: Line) -> bool:
    """The opponent king stands on its third rank or beyond (towards the solver) with no pawn of
    its own beside it or in front of it, and a solver move between the first and the last checks."""
    board, them = line.start, not line.solver
    king = board.king(them)
    if king is None or relative_rank(king, line.solver) < 5:
        return False
    forward = -1 if line.solver == chess.WHITE else 1  # towards the solver's side
    kf, kr = chess.square_file(king), chess.square_rank(king)
    for df, dr in ((0, forward), (-1, forward), (1, forward), (-1, 0), (1, 0)):
        f, r = kf + df, kr + dr
        if 0 <= f < 8 and 0 <= r < 8 and board.piece_at(chess.square(f, r)) == chess.Piece(chess.PAWN, them):
            return False
    return any(line.plies[i].after.is_check() for i in _solver(line, 1) if i < len(line.plies) - 1)


def advanced_pawn(line: Line) -> bool:
    """A solver promotion or pawn move to its seventh or eighth rank."""
    return any(advanced_pawn_move(line.plies[i], min_rank=6) for i in _solver(line))


def attacking_f2f7(line: Line) -> bool:
    """The first solver capture on f2/f7 is made with the opponent king on e1/e8."""
    for i in _solver(line):
        ply = line.plies[i]
        sq = ply.move.to_square
        if ply.captured is not None and sq in (chess.F2, chess.F7):
            king = ply.after.piece_at(chess.E8 if sq == chess.F7 else chess.E1)
            return king == chess.Piece(chess.KING, not line.solver)
    return False


def wing_attack(line: Line, corner_file: int, king_files: tuple[int, ...], min_pieces: int) -> bool:
    """The opponent king on its first rank on ``king_files``, ``min_pieces`` or more on the board
    (no endgame), a solver check, and a score ≥ 2: +1 per checking solver move, +1 per capture
    within 3 squares of the opponent's corner on that wing, −1 per other move 5 or more away."""
    board, them = line.start, not line.solver
    home = 7 if line.solver == chess.WHITE else 0
    king = board.king(them)
    solver_plies = [line.plies[i] for i in _solver(line)]
    if (king is None or chess.square_rank(king) != home or chess.square_file(king) not in king_files
            or len(board.piece_map()) < min_pieces or not any(p.after.is_check() for p in solver_plies)):
        return False
    corner, score = chess.square(corner_file, home), 0
    for ply in solver_plies:
        distance = chess.square_distance(corner, ply.move.to_square)
        score += ply.after.is_check()
        if _is_capture(ply) and distance <= 3:
            score += 1
        elif distance >= 5:
            score -= 1
    return score >= 2


def kingside_attack(line: Line) -> bool:
    return wing_attack(line, 7, (6, 7), 20)


def queenside_attack(line: Line) -> bool:
    return wing_attack(line, 0, (0, 1, 2), 18)
