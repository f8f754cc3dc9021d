"""Chess positions as fixed-length token sequences, for masked discrete diffusion (METHODS §1, §4).

Layout (``SEQ_LEN = 73`` positions; one token per position)::

    0..63   the squares in python-chess order (0 = a1, 1 = b1, …, 7 = h1, 8 = a2, …, 63 = h8):
            "." (empty) or a piece letter "PNBRQK" (white) / "pnbrqk" (black)        13 states
    64      side to move: "turn:w" | "turn:b"                                          2
    65..68  castling rights, one slot per right in FEN order K, Q, k, q:
            slot i holds "castle:<right>" when the right is present, else "-"         2 each
    69      en-passant file "ep:a" … "ep:h", or "-" (the rank follows from the side
            to move: 6 when white is to move, 3 when black is)                         9
    70, 71  best move: from-square, to-square ("a1" … "h8"), or "-" for no move        65 each
    72      promotion "promo:n|b|r|q", or "-"                                          5

Vocabulary (``VOCAB``, 97 tokens): ``[MASK]`` (id ``MASK_ID = 0``), ``-`` (absent), the 13 square
states, 2 turns, 4 castling rights, 8 en-passant files, 64 move squares, 4 promotions. Every
position accepts only its own tokens (``allowed_token_mask``), so a sampler can restrict each
position's logits; ``decode`` rejects a token at a position that does not accept it.

Round trip: ``decode(encode(fen))`` reproduces the first four FEN fields (placement, side to
move, castling, en passant) character for character, provided they are written canonically
(castling letters in the order KQkq, en-passant rank consistent with the side to move). The
halfmove and fullmove counters are **dropped**: puzzles do not depend on them (except the
50-move rule, which no puzzle reaches) and generating them would only add noise; ``decode``
writes ``0 1``. Everything here is pure text processing: no board legality is checked (that is
``reward_models.chess.legality``'s job), so any token sequence of valid tokens decodes to a FEN,
possibly of an impossible position.
"""

from __future__ import annotations

from typing import Sequence

import torch

MASK = "[MASK]"
ABSENT = "-"
PIECE_STATES = (".", "P", "N", "B", "R", "Q", "K", "p", "n", "b", "r", "q", "k")
CASTLING_RIGHTS = ("K", "Q", "k", "q")
FILES = "abcdefgh"
SQUARE_NAMES = tuple(f + r for r in "12345678" for f in FILES)  # index = python-chess square
PROMOTIONS = ("n", "b", "r", "q")

VOCAB: tuple[str, ...] = (
    MASK, ABSENT, *PIECE_STATES, "turn:w", "turn:b", *(f"castle:{c}" for c in CASTLING_RIGHTS),
    *(f"ep:{f}" for f in FILES), *SQUARE_NAMES, *(f"promo:{p}" for p in PROMOTIONS))
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
MASK_ID = TOKEN_ID[MASK]
VOCAB_SIZE = len(VOCAB)

SQUARES = slice(0, 64)
TURN = 64
CASTLING = slice(65, 69)
EN_PASSANT = 69
MOVE_FROM, MOVE_TO, PROMOTION = 70, 71, 72
SEQ_LEN = 73
BOARD_LEN = 70  # positions 0..69 describe the board; 70..72 the move

FEN_COUNTERS = "0 1"  # what decode writes for the dropped halfmove / fullmove counters


class TokenError(ValueError):
    """A FEN or move that cannot be encoded, or a token sequence that does not decode."""


def _allowed_tokens() -> list[tuple[str, ...]]:
    allowed = [PIECE_STATES] * 64 + [("turn:w", "turn:b")]
    allowed += [(ABSENT, f"castle:{c}") for c in CASTLING_RIGHTS]
    allowed += [(ABSENT, *(f"ep:{f}" for f in FILES)), (ABSENT, *SQUARE_NAMES), (ABSENT, *SQUARE_NAMES),
                (ABSENT, *(f"promo:{p}" for p in PROMOTIONS))]
    assert len(allowed) == SEQ_LEN
    return allowed


_ALLOWED = _allowed_tokens()


def allowed_token_mask() -> torch.Tensor:
    """Which tokens each position accepts. Returns bool [SEQ_LEN, VOCAB_SIZE] (MASK is never allowed)."""
    mask = torch.zeros(SEQ_LEN, VOCAB_SIZE, dtype=torch.bool)
    for pos, toks in enumerate(_ALLOWED):
        mask[pos, [TOKEN_ID[t] for t in toks]] = True
    return mask


def _parse_placement(placement: str) -> list[str]:
    """FEN piece placement → 64 square states in python-chess order."""
    ranks = placement.split("/")
    if len(ranks) != 8:
        raise TokenError(f"FEN placement {placement!r} has {len(ranks)} ranks, expected 8")
    squares = ["."] * 64
    for row, rank_text in enumerate(ranks):  # FEN lists rank 8 first
        file = 0
        for ch in rank_text:
            if ch in "12345678":
                file += int(ch)
            elif ch in PIECE_STATES[1:]:
                if file < 8:
                    squares[(7 - row) * 8 + file] = ch
                file += 1
            else:
                raise TokenError(f"FEN placement {placement!r}: unexpected character {ch!r}")
        if file != 8:
            raise TokenError(f"FEN placement {placement!r}: rank {8 - row} covers {file} files, expected 8")
    return squares


def _format_placement(squares: Sequence[str]) -> str:
    """64 square states (python-chess order) → canonical FEN placement (runs of empties as digits)."""
    ranks = []
    for rank in range(7, -1, -1):
        text, empty = "", 0
        for file in range(8):
            state = squares[rank * 8 + file]
            if state == ".":
                empty += 1
                continue
            text += (str(empty) if empty else "") + state
            empty = 0
        ranks.append(text + (str(empty) if empty else ""))
    return "/".join(ranks)


def _ep_rank(turn: str) -> str:
    return "6" if turn == "w" else "3"  # the square a pawn that just moved two squares skipped


def _encode_move(move: str | None) -> list[str]:
    if move is None:
        return [ABSENT] * 3
    if len(move) not in (4, 5) or move[:2] not in SQUARE_NAMES or move[2:4] not in SQUARE_NAMES:
        raise TokenError(f"move {move!r} is not a UCI move like 'e2e4' or 'e7e8q'")
    if len(move) == 5 and move[4] not in PROMOTIONS:
        raise TokenError(f"move {move!r}: promotion must be one of {''.join(PROMOTIONS)}")
    return [move[:2], move[2:4], f"promo:{move[4]}" if len(move) == 5 else ABSENT]


def encode(fen: str, move: str | None = None) -> list[int]:
    """FEN (+ optional UCI best move) → token ids, a list of ``SEQ_LEN`` ints.

    >>> ids = encode("8/8/8/8/8/8/4P3/4K2k w - - 0 1", "e2e4")
    >>> len(ids), VOCAB[ids[12]], VOCAB[ids[TURN]], [VOCAB[i] for i in ids[MOVE_FROM:]]
    (73, 'P', 'turn:w', ['e2', 'e4', '-'])
    >>> decode(ids)
    ('8/8/8/8/8/8/4P3/4K2k w - - 0 1', 'e2e4')
    """
    fields = fen.split()
    if len(fields) < 4:
        raise TokenError(f"FEN {fen!r} has {len(fields)} fields, expected at least 4")
    placement, turn, castling, ep = fields[:4]
    tokens = _parse_placement(placement)
    if turn not in ("w", "b"):
        raise TokenError(f"FEN {fen!r}: side to move must be 'w' or 'b', got {turn!r}")
    tokens.append(f"turn:{turn}")
    present = "" if castling == "-" else castling
    if "".join(c for c in CASTLING_RIGHTS if c in present) != present:
        raise TokenError(f"FEN {fen!r}: castling field must be '-' or a subsequence of 'KQkq', got {castling!r}")
    tokens += [f"castle:{c}" if c in present else ABSENT for c in CASTLING_RIGHTS]
    if ep == "-":
        tokens.append(ABSENT)
    elif len(ep) == 2 and ep[0] in FILES and ep[1] == _ep_rank(turn):
        tokens.append(f"ep:{ep[0]}")
    else:
        raise TokenError(f"FEN {fen!r}: en-passant square must be '-' or on rank {_ep_rank(turn)}, got {ep!r}")
    tokens += _encode_move(move)
    return [TOKEN_ID[t] for t in tokens]


def decode(ids: Sequence[int] | torch.Tensor) -> tuple[str, str | None]:
    """Token ids [SEQ_LEN] → (FEN with counters ``0 1``, UCI move or None).

    Raises ``TokenError`` naming the first position whose token it does not accept (a leftover
    MASK included), or a half-specified move.
    """
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if len(ids) != SEQ_LEN:
        raise TokenError(f"expected {SEQ_LEN} tokens, got {len(ids)}")
    toks = []
    for pos, i in enumerate(ids):
        tok = VOCAB[i] if 0 <= i < VOCAB_SIZE else f"<id {i}>"
        if tok not in _ALLOWED[pos]:
            raise TokenError(f"position {pos} does not accept token {tok!r} (accepts {_ALLOWED[pos][:3]}…)")
        toks.append(tok)
    turn = toks[TURN][-1]
    castling = "".join(t[-1] for t in toks[CASTLING] if t != ABSENT) or "-"
    ep = "-" if toks[EN_PASSANT] == ABSENT else toks[EN_PASSANT][-1] + _ep_rank(turn)
    fen = f"{_format_placement(toks[SQUARES])} {turn} {castling} {ep} {FEN_COUNTERS}"
    src, dst, promo = toks[MOVE_FROM], toks[MOVE_TO], toks[PROMOTION]
    if src == dst == promo == ABSENT:
        return fen, None
    if ABSENT in (src, dst):
        raise TokenError(f"move tokens {src!r} {dst!r} {promo!r}: from and to must both be squares or both '-'")
    return fen, src + dst + ("" if promo == ABSENT else promo[-1])


def encode_batch(fens: Sequence[str], moves: Sequence[str | None] | None = None) -> torch.Tensor:
    """B FENs (+ optional B moves) → long [B, SEQ_LEN]."""
    moves = [None] * len(fens) if moves is None else moves
    if len(moves) != len(fens):
        raise TokenError(f"{len(fens)} FENs but {len(moves)} moves")
    return torch.tensor([encode(f, m) for f, m in zip(fens, moves)], dtype=torch.long).reshape(len(fens), SEQ_LEN)


def board_fields(fen: str) -> str:
    """The first four FEN fields, the part ``decode(encode(fen))`` reproduces exactly."""
    return " ".join(fen.split()[:4])
