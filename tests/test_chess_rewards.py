"""Chess-puzzle rewards: legality rules, the Stockfish pool under faults, uniqueness, the theme tagger,
and the registered ``chess_puzzle`` reward. Engine tests use the real Stockfish (skipped without it)."""

import math
import os
import signal
import stat
import time

import chess
import pytest
import torch

from pipelines import chess_tokenizer as tokenizer
from reward_models.base import available_rewards, build_reward
from reward_models.chess.engine import EngineFailure, SearchLimit, SearchWatch, StockfishPool, find_stockfish
from reward_models.chess.legality import is_legal, legality_problems
from reward_models.chess.reward import ChessPuzzleReward
from reward_models.chess.themes import SUPPORTED_THEMES, tag_themes
from reward_models.chess.uniqueness import LineScore, check_line, check_position, step_problem, win_chance

needs_stockfish = pytest.mark.skipif(find_stockfish() is None, reason="Stockfish not installed (apt-get install stockfish)")
FAST = SearchLimit(nodes=20_000, time=5.0)

BACK_RANK_M1 = "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"        # Ra8# is the only mate
TWO_MATES_M1 = "6k1/5ppp/8/8/8/8/8/RR4K1 w - - 0 1"       # Ra8# and Rb8#: allowed at the last move
TWO_CAPTURES = "4k3/8/8/3q4/8/8/6B1/3RK3 w - - 0 1"        # Bxd5 and Rxd5 both win the queen
QUEEN_SAC_M2 = "2r3k1/5ppp/8/8/8/8/4QPPP/4R1K1 w - - 0 1"  # 1. Qe8+ Rxe8 2. Rxe8#
START = chess.STARTING_FEN


# --- legality: one position per rule, breaking that rule and nothing else ------------------------

@pytest.mark.parametrize("fen, problems", [
    ("4k3/8/8/8/8/8/8/4K3 w - - 0 1", []),
    ("4k3/8/8/8/8/8/8/3KK3 w - - 0 1", ["white_has_2_kings"]),
    ("8/8/8/8/8/8/8/4K3 w - - 0 1", ["black_has_0_kings"]),
    ("3Pk3/8/8/8/8/8/8/4K3 b - - 0 1", ["pawn_on_back_rank"]),
    ("4k3/8/8/8/8/8/8/p3K3 w - - 0 1", ["pawn_on_back_rank"]),
    ("4k3/8/8/8/8/8/8/4R1K1 w - - 0 1", ["side_not_to_move_in_check"]),
    ("4k3/8/8/8/NNNNNNNN/8/PPPPPPPP/4K3 w - - 0 1", ["white_has_over_16_pieces"]),
    ("4k3/8/8/8/7K/p7/pppppppp/8 w - - 0 1", ["black_has_over_8_pawns"]),
    ("4k3/8/8/8/8/8/8/4K3 w K - 0 1", ["bad_castling_rights"]),
    ("4k3/8/8/8/8/8/8/4K3 w - e6 0 1", ["invalid_ep_square"]),
    ("4k3/8/3N1N2/8/8/8/8/4RK2 b - - 0 1", ["too_many_checkers", "impossible_check"]),
    ("not a fen", ["unparseable_fen"]),
])
def test_each_legality_rule(fen, problems):
    assert legality_problems(fen) == problems
    assert is_legal(fen) == (not problems)


def test_strict_material_counts_promotions_against_missing_pawns():
    two_queens_eight_pawns = "4k3/8/8/8/8/8/PPPPPPPP/QQ2K3 w - - 0 1"
    assert is_legal(two_queens_eight_pawns)
    assert legality_problems(two_queens_eight_pawns, strict_material=True) == ["white_promoted_pieces_exceed_missing_pawns"]
    assert is_legal("4k3/8/8/8/8/8/1PPPPPPP/QQ2K3 w - - 0 1", strict_material=True)  # one pawn became the queen


# --- win chance and the per-move rule (pure) ----------------------------------------------------

def test_win_chance_by_hand():
    # e^{-0.00368208·200} = e^{-0.736416} = 0.478827, so W = 2 / 1.478827 − 1 = 0.352423
    assert win_chance(200) == pytest.approx(0.352423, abs=1e-6)
    assert win_chance(-200) == pytest.approx(-win_chance(200))
    assert win_chance(0) == 0.0 and 0.998 < win_chance(2000) < 1.0


def test_step_problem_rules():
    assert step_problem(LineScore("a", cp=600), None) is None  # only legal move
    assert step_problem(LineScore("a", cp=600), LineScore("b", cp=0)) is None  # W 0.80 vs 0.00
    assert step_problem(LineScore("a", cp=600), LineScore("b", cp=150)) is None  # 0.802 vs 0.269: gap 0.533
    assert step_problem(LineScore("a", cp=600), LineScore("b", cp=200))[0] == "close_second"  # 0.802 vs 0.352
    assert step_problem(LineScore("a", mate=3), LineScore("b", cp=900)) is None  # only one move mates
    assert step_problem(LineScore("a", mate=3), LineScore("b", mate=5))[0] == "second_mate"
    assert step_problem(LineScore("a", mate=1), LineScore("b", mate=1)) is None  # several mates in one
    assert step_problem(LineScore("a", cp=100), LineScore("b", mate=-2)) is None  # W 0.18 vs −1


# --- the Stockfish pool ------------------------------------------------------------------------

def _wait_dead(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:  # a killed child stays a zombie until reaped
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.02)


@needs_stockfish
def test_pool_survives_a_killed_engine():
    with StockfishPool(size=1, limit=FAST) as pool:
        assert pool.analyse(chess.Board(BACK_RANK_M1))[0]["pv"][0].uci() == "a1a8"
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        assert pool.analyse(chess.Board(BACK_RANK_M1))[0]["pv"][0].uci() == "a1a8"
        assert pool.pids() != [pid]


@needs_stockfish
def test_pool_restarts_a_hung_engine():
    # A stopped engine is caught by the idle rule (grace of no CPU and no runnable thread), not by
    # the wall-clock backstop; the restarted engine's search then succeeds however loaded the machine.
    with StockfishPool(size=1, limit=SearchLimit(nodes=20_000, time=0.3), grace=0.5, max_wait=60) as pool:
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGSTOP)  # alive but silent
        assert pool.analyse(chess.Board(BACK_RANK_M1))[0]["pv"][0].uci() == "a1a8"
        assert pool.pids() != [pid]
        assert len(pool.restart_reasons) == 1 and pool.restart_reasons[0].startswith("idle"), pool.restart_reasons
        _wait_dead(pid)  # the stopped process was killed, not left behind


def _watch_until_hung(proc, **kw) -> str:
    watch = SearchWatch(proc.pid, **kw)
    while (why := watch.hung()) is None:
        time.sleep(0.02)
    return why


def test_search_watch_tells_spinning_sleeping_and_answering_processes_apart():
    import subprocess
    import sys
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen(["sleep", "60"])
    try:
        # a spinning process is hung once it has used its CPU budget, however long that takes in wall time
        assert _watch_until_hung(spin, budget=0.3, idle=60, max_wait=120).startswith("used 0.")
        # a sleeping one once it has been idle for `idle` seconds
        assert _watch_until_hung(sleep, budget=60, idle=0.2, max_wait=120).startswith("idle")
        # one whose answer is waiting unread is never idle: only the backstop ends the wait
        assert _watch_until_hung(sleep, budget=60, idle=0.1, max_wait=0.5, answered=lambda: True).startswith(
            "no answer after")
    finally:
        spin.kill(), sleep.kill(), spin.wait(), sleep.wait()


@pytest.fixture
def crashing_engine(tmp_path):
    """A real UCI process that handshakes, then dies on every search."""
    path = tmp_path / "crashing-engine"
    path.write_text("#!/bin/sh\nwhile read line; do case \"$line\" in\n"
                    "uci) echo 'id name crasher'; echo 'option name Threads type spin default 1 min 1 max 8';"
                    " echo 'option name Hash type spin default 16 min 1 max 64'; echo uciok;;\n"
                    "isready) echo readyok;;\ngo*) exit 3;;\nquit) exit 0;;\nesac; done\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_engine_failing_twice_is_reported_not_raised_to_the_trainer(crashing_engine):
    with StockfishPool(size=1, limit=FAST, path=crashing_engine) as pool:
        with pytest.raises(EngineFailure, match="failed twice"):
            pool.analyse(chess.Board(BACK_RANK_M1))
        with pool.engine() as engine:
            result = check_position(chess.Board(BACK_RANK_M1), engine)
        assert result.unique is None and result.kind == "engine_failed"
    reward = ChessPuzzleReward(stockfish=crashing_engine)
    out = reward([BACK_RANK_M1, "8/8/8/8/8/8/8/8 w - - 0 1"], ["", ""], [{}, {}])
    reward.close()
    assert out["legal"].tolist() == [1.0, 0.0]
    assert math.isnan(out["unique"][0]) and math.isnan(out["yield"][0]) and out["unique"][1] == 0.0


@needs_stockfish
def test_pool_map_over_threads_matches_one_engine():
    fens = [BACK_RANK_M1, TWO_CAPTURES, QUEEN_SAC_M2, START]

    def first_line(engine, fen):
        info = engine.analyse(chess.Board(fen), multipv=2)[0]
        return info["pv"][0].uci(), info["score"].relative

    with StockfishPool(size=1, limit=FAST) as one, StockfishPool(size=2, limit=FAST) as two:
        assert two.map(first_line, fens) == one.map(first_line, fens)  # nodes-limited, fresh hash per checkout


# --- uniqueness ---------------------------------------------------------------------------------

def _check(fen, **kw):
    with StockfishPool(size=1, limit=FAST) as pool, pool.engine() as engine:
        return check_position(chess.Board(fen), engine, **kw)


@needs_stockfish
def test_unique_mate_in_one_and_allowed_twin_mates():
    result = _check(BACK_RANK_M1)
    assert (result.unique, result.line, result.mate, result.first.mate) == (True, ["a1a8"], True, 1)
    twin = _check(TWO_MATES_M1)
    assert twin.unique and twin.mate and twin.line in (["a1a8"], ["b1b8"])


@needs_stockfish
def test_two_equally_good_moves_are_not_unique():
    result = _check(TWO_CAPTURES)
    assert result.unique is False and result.kind == "close_second"
    assert {result.first.move} <= {"g2d5", "d1d5"}


@needs_stockfish
def test_mate_in_two_line_and_rejections():
    result = _check(QUEEN_SAC_M2)
    assert (result.unique, result.line, result.mate) == (True, ["e2e8", "c8e8", "e1e8"], True)
    assert _check(START).kind == "not_winning"
    assert _check("R5k1/5ppp/8/8/8/8/8/6K1 b - - 0 1").kind == "game_over"  # already mated


@needs_stockfish
def test_check_line_against_a_given_solution():
    with StockfishPool(size=1, limit=FAST) as pool:
        with pool.engine() as engine:
            assert check_line(chess.Board(QUEEN_SAC_M2), ["e2e8", "c8e8", "e1e8"], engine).unique
        with pool.engine() as engine:
            wrong = check_line(chess.Board(BACK_RANK_M1), ["a1a7"], engine)
        assert wrong.kind == "engine_disagrees" and "prefers a1a8" in wrong.reason


# --- theme tagger on hand-checked lines ---------------------------------------------------------

@pytest.mark.parametrize("fen, line, expected, absent", [
    (BACK_RANK_M1, ["a1a8"], {"mate", "mateIn1", "oneMove", "backRankMate", "rookEndgame", "endgame"}, set()),
    ("6rk/6pp/8/6N1/8/8/8/6K1 w - - 0 1", ["g5f7"], {"mate", "mateIn1", "smotheredMate"}, {"backRankMate"}),
    (QUEEN_SAC_M2, ["e2e8", "c8e8", "e1e8"], {"mateIn2", "short", "sacrifice", "backRankMate"}, {"fork"}),
    ("r3k3/8/8/1N6/8/8/8/4K3 w - - 0 1", ["b5c7", "e8d7", "c7a8"], {"fork", "short"}, {"pin", "mate", "sacrifice"}),
    ("7k/7p/5r2/8/8/8/5BPP/6K1 w - - 0 1", ["f2d4"], {"pin", "oneMove"}, {"fork", "skewer"}),
    ("3q4/8/8/3k4/8/8/8/R3K3 w - - 0 1", ["a1d1", "d5e6", "d1d8"], {"skewer"}, {"pin", "fork"}),
    ("4k3/8/8/8/4N3/8/8/4R1K1 w - - 0 1", ["e4f6"], {"doubleCheck", "discoveredCheck"}, {"mate"}),
    ("4k3/1P6/8/8/8/8/8/4K3 w - - 0 1", ["b7b8n"], {"promotion", "underPromotion", "advancedPawn", "pawnEndgame"}, set()),
    ("4k3/8/8/3pP3/8/8/8/4K3 w - d6 0 1", ["e5d6"], {"enPassant"}, {"advancedPawn"}),
    # Lichess 000Pw (themes "crushing endgame fork short"): after the setup move e4d2, Ne2+ forks Kg1 and Qc3
    ("6k1/5p1p/4p3/4q3/3n4/2Q3P1/PP1N1P1P/6K1 b - - 3 37", ["d4e2", "g1f1", "e2c3"], {"fork", "short", "endgame"},
     {"pin", "skewer", "sacrifice", "hangingPiece"}),
])
def test_tagger_on_hand_checked_lines(fen, line, expected, absent):
    tags = tag_themes(chess.Board(fen), line)
    assert expected <= tags and not (absent & tags), sorted(tags)
    assert tags <= set(SUPPORTED_THEMES)


def test_tagger_rejects_an_illegal_line():
    with pytest.raises(ValueError, match="illegal move e2e5"):
        tag_themes(chess.Board(START), ["e2e5"])


# --- the registered reward ----------------------------------------------------------------------

@needs_stockfish
def test_chess_puzzle_reward_components():
    reward = build_reward("chess_puzzle", nodes=20_000)
    assert "chess_puzzle" in available_rewards() and isinstance(reward, ChessPuzzleReward)
    fens = [BACK_RANK_M1, BACK_RANK_M1, TWO_CAPTURES, "4k3/8/8/8/8/8/8/3KK3 w - - 0 1", QUEEN_SAC_M2]
    meta = [{"themes": ["backRankMate", "mateIn1"]}, {"themes": "fork mateIn1"}, {}, {}, {"themes": ["sacrifice"]}]
    out = reward(fens, [""] * 5, meta)
    assert out["legal"].tolist() == [1, 1, 1, 0, 1]
    assert out["unique"].tolist() == [1, 1, 0, 0, 1]
    assert out["theme_match"].tolist() == [1, 0, 1, 0, 1]
    assert out["theme_score"].tolist() == [1, 0.5, 1, 0, 1]
    assert out["yield"].tolist() == [1, 0, 0, 0, 1]
    assert out["partial_yield"].tolist() == [1, 0.5, 0, 0, 1]  # unique × theme_score
    assert torch.isnan(out["best_move"]).all()  # FEN strings carry no move

    tokens = tokenizer.encode_batch([BACK_RANK_M1, BACK_RANK_M1, BACK_RANK_M1], ["a1a8", "a1a7", None])
    tokens[2, 10] = tokenizer.MASK_ID  # a square left masked: not a board
    out = reward(tokens, [""] * 3, [{}] * 3)
    reward.close()
    assert out["legal"].tolist() == [1, 1, 0] and out["unique"].tolist() == [1, 1, 0]
    assert out["best_move"].tolist()[:2] == [1, 0] and math.isnan(out["best_move"][2])


def test_chess_puzzle_reward_names_unknown_themes():
    with pytest.raises(ValueError, match="cannot produce \\['deflection'\\]"):
        ChessPuzzleReward().judge([BACK_RANK_M1], [{"themes": ["deflection"]}])
