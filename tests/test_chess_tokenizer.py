"""Board tokenizer: exact round trips on every shared Lichess position, the layout by hand, clear errors."""

import chess
import pytest
import torch

from pipelines import chess_tokenizer as tok
from flowalign.chess.puzzles import DEFAULT_PUZZLES, read_puzzles

START = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"


def _names(ids):
    return [tok.VOCAB[i] for i in ids]


def test_start_position_layout_by_hand():
    names = _names(tok.encode(START, "e2e4"))
    assert len(names) == tok.SEQ_LEN == 73
    assert names[0:8] == ["R", "N", "B", "Q", "K", "B", "N", "R"]  # a1..h1
    assert names[8:16] == ["P"] * 8 and names[16:48] == ["."] * 32 and names[48:56] == ["p"] * 8
    assert names[56:64] == ["r", "n", "b", "q", "k", "b", "n", "r"]  # a8..h8
    assert names[64:] == ["turn:w", "castle:K", "castle:Q", "castle:k", "castle:q", "-", "e2", "e4", "-"]


def test_rights_en_passant_and_promotion_round_trip():
    fen = "r3k2r/pp1p1ppp/8/2pPp3/8/8/PPP2PPP/R3K2R w Kq c6 0 12"
    names = _names(tok.encode(fen, "d5c6"))
    assert names[tok.CASTLING] == ["castle:K", "-", "-", "castle:q"]
    assert names[tok.EN_PASSANT] == "ep:c"
    assert tok.decode(tok.encode(fen, "d5c6")) == ("r3k2r/pp1p1ppp/8/2pPp3/8/8/PPP2PPP/R3K2R w Kq c6 0 1", "d5c6")
    black = "8/8/8/8/3pP3/8/8/k6K b - e3 5 40"
    assert tok.decode(tok.encode(black, "d4e3")) == ("8/8/8/8/3pP3/8/8/k6K b - e3 0 1", "d4e3")
    assert tok.decode(tok.encode("8/1P6/8/8/8/8/8/k6K w - - 0 1", "b7b8n"))[1] == "b7b8n"


@pytest.mark.skipif(not DEFAULT_PUZZLES.exists(), reason=f"shared puzzle CSV not at {DEFAULT_PUZZLES}")
def test_round_trip_on_every_shared_puzzle_position():
    """Both the CSV's FEN (before the setup move) and the solver's position (after it), with the
    move that follows each; the first four FEN fields come back character for character."""
    puzzles = read_puzzles()
    assert len(puzzles) > 70_000
    for p in puzzles:
        assert tok.decode(tok.encode(p.fen, p.moves[0])) == (f"{tok.board_fields(p.fen)} 0 1", p.moves[0]), p.puzzle_id
        board = chess.Board(p.fen)
        board.push(chess.Move.from_uci(p.moves[0]))  # legal by construction (SOURCES.md); no re-check
        after = board.fen(en_passant="fen")  # every double push keeps its en-passant square
        assert tok.decode(tok.encode(after, p.moves[1])) == (f"{tok.board_fields(after)} 0 1", p.moves[1]), p.puzzle_id


def test_allowed_mask_accepts_exactly_what_decode_accepts():
    mask = tok.allowed_token_mask()
    assert mask.shape == (tok.SEQ_LEN, tok.VOCAB_SIZE) and not mask[:, tok.MASK_ID].any()
    assert mask[:64].sum(1).tolist() == [13] * 64
    assert mask[64:].sum(1).tolist() == [2, 2, 2, 2, 2, 9, 65, 65, 5]
    ids = torch.tensor(tok.encode(START))
    assert mask[torch.arange(tok.SEQ_LEN), ids].all()
    bad = ids.clone()
    bad[tok.TURN] = tok.TOKEN_ID["P"]  # a piece where the side to move belongs
    with pytest.raises(tok.TokenError, match="position 64"):
        tok.decode(bad)


def test_decode_rejects_masks_and_half_moves():
    ids = tok.encode(START)
    with pytest.raises(tok.TokenError, match="position 3 does not accept token '\\[MASK\\]'"):
        tok.decode(ids[:3] + [tok.MASK_ID] + ids[4:])
    half = ids[:tok.MOVE_FROM] + [tok.TOKEN_ID["e2"], tok.TOKEN_ID["-"], tok.TOKEN_ID["-"]]
    with pytest.raises(tok.TokenError, match="both be squares"):
        tok.decode(half)
    with pytest.raises(tok.TokenError, match="expected 73 tokens"):
        tok.decode(ids[:-1])


@pytest.mark.parametrize("fen, message", [
    ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP w KQkq - 0 1", "7 ranks"),
    ("rnbqkbnr/ppppppp2/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "covers 9 files"),
    ("rnbqkbnr/ppppXppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "unexpected character 'X'"),
    (START.replace(" w ", " x "), "side to move"),
    (START.replace("KQkq", "QK"), "subsequence of 'KQkq'"),
    (START.replace(" - 0", " e3 0"), "rank 6"),
    ("8/8/8/8/8/8/8/8 w -", "at least 4"),
])
def test_encode_errors_name_the_problem(fen, message):
    with pytest.raises(tok.TokenError, match=message):
        tok.encode(fen)


def test_encode_batch_and_bad_moves():
    batch = tok.encode_batch([START, START], ["e2e4", None])
    assert batch.shape == (2, tok.SEQ_LEN) and batch.dtype == torch.long
    assert tok.decode(batch[1]) == (START, None)
    for move in ("e2e9", "e7e8k", "e2"):
        with pytest.raises(tok.TokenError, match="move"):
            tok.encode(START, move)
