"""Drawing generated chess puzzles (flowalign/chess/render.py), ``flowalign sample --grid`` and
scripts/chess_puzzle_grid.py's selection rule."""

import chess
import numpy as np
import pytest
from PIL import Image, ImageChops

from flowalign.chess.render import CELL_WIDTH, GAP, SQUARE, board_layout, dejavu_path, draw_board, puzzle_cell
from flowalign.chess.sampling import GeneratedPuzzle
from flowalign.cli import main
from pipelines.base import DEMO_MODELS_DIR
from reward_models.chess.engine import find_stockfish
from script_module import load_script

CELL_HEIGHT = 8 * SQUARE + 12 + 4  # the board, its coordinates, the frame
HEADER = 12 + 8                    # the column titles' line


def test_board_layout_puts_white_at_the_bottom_and_file_a_left():
    start = board_layout(chess.STARTING_FEN)
    assert start[7] == "RNBQKBNR" and start[7][4] == "K"  # rank 1 is the last row, e1 its fifth column
    assert start[0] == "rnbqkbnr" and start[6] == "P" * 8 and start[2] == "." * 8
    corners = board_layout("7k/8/8/8/8/8/8/K7 w - - 0 1")  # white king a1, black king h8
    assert corners[7][0] == "K" and corners[0][7] == "k"
    assert sum(row.count(".") for row in corners) == 62


@pytest.mark.parametrize("glyphs", [False, pytest.param(True, marks=pytest.mark.skipif(
    dejavu_path() is None, reason="DejaVu Sans not found"))])
def test_a_king_on_e1_is_drawn_inside_the_e1_square(glyphs):
    # the squares start at x = 12 (rank names on the left), a8 at the top: e1 is column 4, row 7
    empty = draw_board("8/8/8/8/8/8/8/8 w - - 0 1", glyphs=glyphs)
    king = draw_board("8/8/8/8/8/8/8/4K3 w - - 0 1", glyphs=glyphs)
    assert empty.size == king.size == (8 * SQUARE + 12, 8 * SQUARE + 12)
    left, top, right, bottom = ImageChops.difference(empty, king).getbbox()
    assert 12 + 4 * SQUARE <= left < right <= 12 + 5 * SQUARE and 7 * SQUARE <= top < bottom <= 8 * SQUARE
    assert right - left > SQUARE // 3  # a piece, not a stray pixel
    # a black king on e8 lands in row 0 instead, and differs from the white one
    black = draw_board("4k3/8/8/8/8/8/8/8 w - - 0 1", glyphs=glyphs)
    left, top, right, bottom = ImageChops.difference(empty, black).getbbox()
    assert 12 + 4 * SQUARE <= left < right <= 12 + 5 * SQUARE and bottom <= SQUARE


def test_a_yield_cell_is_framed_green_and_an_illegal_one_is_not():
    mate = GeneratedPuzzle(0, ("backRankMate",), "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", None, legal=True,
                           unique=True, solution=["a1a8"], themes={"backRankMate", "mate", "mateIn1"})
    illegal = GeneratedPuzzle(1, ("mate",), "6kK/8/8/8/8/8/8/k7 b - - 0 1", None, problems=["black_has_2_kings"])
    not_unique = GeneratedPuzzle(2, ("fork",), chess.STARTING_FEN, None, legal=True, unique=False)
    cells = [puzzle_cell(p) for p in (mate, illegal, not_unique)]
    assert all(c.size == (CELL_WIDTH, CELL_HEIGHT) for c in cells)
    corners = [c.getpixel((0, CELL_HEIGHT // 2)) for c in cells]
    assert corners[0] == (30, 140, 60) and corners[1] == corners[2] == (255, 255, 255)
    # the text differs between the three (solution / illegal reason / no line), so their right halves do
    right = [np.asarray(c.crop((8 * SQUARE + 20, 0, CELL_WIDTH - 4, CELL_HEIGHT - 4))) for c in cells]
    assert not np.array_equal(right[0], right[1]) and not np.array_equal(right[1], right[2])


def test_sample_grid_draws_one_cell_per_seed(tmp_path):
    out = tmp_path / "grid.png"
    code = main(["sample", "--model", "chess-md", "--family", "chess", "mate short", "--seeds", "0,1,2,3,4,5",
                 "--no-engine", "--out", str(tmp_path / "p.csv"), "--grid", str(out)])
    assert code == 0
    # 6 cells, four to a row: two rows, no header
    assert Image.open(out).size == (4 * (CELL_WIDTH + GAP) + GAP, 2 * (CELL_HEIGHT + GAP) + GAP)


def test_sample_grid_must_be_a_png(tmp_path, capsys):
    code = main(["sample", "--model", "chess-md", "--family", "chess", "mate", "--no-engine",
                 "--out", str(tmp_path / "p.csv"), "--grid", str(tmp_path / "grid.svg")])
    assert code == 2 and "--grid must end in .png" in capsys.readouterr().err


@pytest.mark.skipif(not (DEMO_MODELS_DIR / "chess-md" / "model_index.json").is_file(), reason="demo model not built")
def test_grid_script_takes_the_first_legal_samples_of_the_seeded_draw(tmp_path):
    import torch

    from reward_models.chess.legality import is_legal

    script = load_script("chess_puzzle_grid")
    pipe = script.load_pipe("chess-md", None)
    requests = [["mate", "short"], ["fork"], ["skewer"]]
    picked = script.pick(pipe, requests, rows=2, seed=5, per_request=8, take=2)
    for k, (request, row) in enumerate(zip(requests, picked)):
        # the rule by hand: the batch of request k is drawn with seed 5·3 + k
        batch = pipe([request] * 8, generator=torch.Generator().manual_seed(5 * 3 + k))
        legal = [i for i, fen in enumerate(batch.fens) if is_legal(fen)]
        expected = (legal + [i for i in range(8) if i not in legal])[:2]
        assert [p.seed for p in row] == expected and [p.fen for p in row] == [batch.fens[i] for i in expected]
        assert all(p.requested == tuple(request) for p in row)


@pytest.mark.skipif(not (DEMO_MODELS_DIR / "chess-md" / "model_index.json").is_file(), reason="demo model not built")
@pytest.mark.skipif(find_stockfish() is None, reason="Stockfish not installed (apt-get install stockfish)")
def test_grid_script_writes_the_grid_with_engine_verdicts(tmp_path):
    from reward_models.chess.reward import ChessPuzzleReward

    script = load_script("chess_puzzle_grid")
    reward = ChessPuzzleReward(nodes=2_000)
    try:
        summary = script.build("chess-md", None, tmp_path / "g.png", seed=3, rows=1, per_request=8, take=2,
                               reward=reward)
    finally:
        reward.close()
    # base only: 2 columns, 1 row, under the header line
    assert Image.open(tmp_path / "g.png").size == (2 * (CELL_WIDTH + GAP) + GAP, HEADER + CELL_HEIGHT + 2 * GAP)
    cells = summary["cells"]["base"][0]
    assert len(cells) == 2 and summary["engine"]
    for cell in cells:  # a legal cell was searched: a unique verdict, and a line when unique
        assert cell["unique"] is not None if cell["legal"] else cell["unique"] is None
        assert not cell["unique"] or cell["solution"]
    assert summary["yield_cells"]["base"] == sum(c["yield"] for c in cells)


@pytest.mark.skipif(not (DEMO_MODELS_DIR / "chess-md" / "model_index.json").is_file(), reason="demo model not built")
@pytest.mark.skipif(find_stockfish() is None, reason="Stockfish not installed (apt-get install stockfish)")
def test_yield_only_draws_the_first_yield_puzzles_of_each_request():
    from flowalign.chess.render import is_yield
    from reward_models.chess.reward import ChessPuzzleReward

    script = load_script("chess_puzzle_grid")
    pipe = script.load_pipe("chess-md", None)
    requests = [["oneMove"], ["rookEndgame"], ["skewer"]]
    reward = ChessPuzzleReward(nodes=2_000)
    try:
        found = script.first_yields(pipe, requests, seed=1, per_request=16, take=1, reward=reward)
        # the rule by hand: every legal board of the same draw (pick with take = the whole batch), judged
        everything = script.pick(pipe, requests, rows=3, seed=1, per_request=16, take=16)
        for row in everything:
            script.judge(row, reward)
    finally:
        reward.close()
    expected, legal_counts, yield_counts = [], [], []
    for k, row in enumerate(everything):
        legal = [p for p in row if p.legal]
        yields = [p for p in legal if is_yield(p)]
        legal_counts.append(len(legal))
        yield_counts.append(len(yields))
        expected += [(k, p.seed) for p in sorted(yields, key=lambda p: p.seed)[:1]]
    assert found["legal"] == legal_counts and found["yield"] == yield_counts
    assert found["rows"] == expected and all(is_yield(p) for p in found["puzzles"])
