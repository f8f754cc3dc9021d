"""``flowalign sample`` for the chess family: theme request + partial FEN → puzzles in PGN/CSV."""

import csv

import chess
import chess.pgn
import pytest

from flowalign.chess.sampling import fixed_positions
from flowalign.cli import main
from pipelines import chess_tokenizer as tok
from pipelines.chess import ChessPuzzlePipeline
from pipelines.chess_model import ChessDiffusionModel
from reward_models.chess.engine import find_stockfish

PARTIAL = "6k1/5ppp/8/8/8/8/8/R5K1 b - - 0 1"  # a back-rank frame: Kg8, f7 g7 h7, Ra1, Kg1, black to move


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("chess-tiny")
    ChessPuzzlePipeline(ChessDiffusionModel(dim=32, layers=1, heads=2).eval()).save_pretrained(path)
    return path


def test_fixed_positions_by_hand():
    # occupied squares of PARTIAL: a1 = 0, g1 = 6, f7 = 53, g7 = 54, h7 = 55, g8 = 62; "turn" is token 64
    assert fixed_positions(PARTIAL, "pieces") == [0, 6, 53, 54, 55, 62]
    assert fixed_positions(PARTIAL, "e4,turn,a1") == [28, tok.TURN, 0]
    assert fixed_positions(PARTIAL, "all") == list(range(70))  # 64 squares, turn, 4 castling slots, en passant
    with pytest.raises(ValueError, match="'z9' is not a square name"):
        fixed_positions(PARTIAL, "z9")


def test_sample_keeps_the_fixed_squares(tiny_dir, tmp_path):
    out = tmp_path / "puzzles.csv"
    code = main(["sample", "--model", str(tiny_dir), "--family", "chess", "fork short", "--partial-fen", PARTIAL,
                 "--fixed", "pieces,turn,e4", "--seeds", "0,1,2,3,4,5", "--steps", "4", "--no-engine",
                 "--out", str(out)])
    assert code == 0
    rows = list(csv.DictReader(out.open()))
    assert [int(r["seed"]) for r in rows] == [0, 1, 2, 3, 4, 5] and {r["requested"] for r in rows} == {"fork short"}
    frame = chess.Board(PARTIAL)
    for row in rows:
        board = chess.Board(row["fen"])
        for square in (chess.A1, chess.G1, chess.F7, chess.G7, chess.H7, chess.G8, chess.E4):
            assert board.piece_at(square) == frame.piece_at(square), (row["fen"], chess.square_name(square))
        assert board.turn == chess.BLACK
    assert len({r["fen"] for r in rows}) > 1  # the free squares are generated, not copied


@pytest.mark.skipif(find_stockfish() is None, reason="needs Stockfish: apt-get install stockfish")
def test_sample_writes_pgn_with_engine_solutions(tiny_dir, tmp_path):
    # the whole board fixed: the back-rank mate Ra8# (white to move) is the only puzzle the model can make
    out = tmp_path / "puzzles.pgn"
    mate = "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"
    code = main(["sample", "--model", str(tiny_dir), "--family", "chess", "backRankMate mateIn1", "--partial-fen",
                 mate, "--fixed", "all", "--seeds", "0,1", "--steps", "2",
                 "--nodes", "20000", "--out", str(out)])
    assert code == 0
    with out.open() as f:
        games = [chess.pgn.read_game(f), chess.pgn.read_game(f)]
    for game in games:
        assert game.board().fen().split()[:2] == mate.split()[:2]
        assert [m.uci() for m in game.mainline_moves()] == ["a1a8"]
        assert game.headers["Unique"] == "1" and game.headers["ThemeMatch"] == "1"
        assert {"backRankMate", "mateIn1"} <= set(game.headers["Themes"].split())


def test_sample_errors_before_loading(tiny_dir, tmp_path, capsys):
    assert main(["sample", "--model", str(tiny_dir), "--family", "chess", "fork", "--out", "x.png"]) == 2
    assert "--out must end in .pgn or .csv" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot produce \\['zugzwang'\\]"):
        main(["sample", "--model", str(tiny_dir), "--family", "chess", "zugzwang", "--out", str(tmp_path / "x.csv")])


def test_sample_with_the_move_last_writes_a_legal_model_move(tiny_dir, tmp_path):
    # an untrained model's move tokens: under "last" they are the likeliest legal move of the board
    out = tmp_path / "puzzles.csv"
    mate = "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"
    code = main(["sample", "--model", str(tiny_dir), "--family", "chess", "mateIn1", "--partial-fen", mate,
                 "--fixed", "all", "--seeds", "0,1", "--steps", "2", "--no-engine", "--move-schedule", "last",
                 "--out", str(out)])
    assert code == 0
    legal = {m.uci() for m in chess.Board(mate).legal_moves}
    assert [r["model_move"] in legal for r in csv.DictReader(out.open())] == [True, True]
