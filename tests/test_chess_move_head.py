"""The best-move head: the "last" move schedule, its legal-move mask, and a model pre-trained
without the move task (``scripts/pretrain_chess.py --no-move-task``)."""


import chess
import importlib.util
import pytest
import torch

from pipelines import chess_tokenizer as tok
from pipelines.chess import ChessAdapter, ChessPuzzlePipeline, choose_moves, legal_move_tokens, move_last, partial_tokens
from pipelines.chess_model import ChessDiffusionModel
from reward_models.chess.engine import find_stockfish
from script_module import load_script

MOVES = slice(tok.BOARD_LEN, tok.SEQ_LEN)


def tiny_model(move_task: bool = True, seed: int = 0) -> ChessDiffusionModel:
    torch.manual_seed(seed)
    return ChessDiffusionModel(dim=32, layers=1, heads=2, move_task=move_task).eval()


def names(mask_row: torch.Tensor) -> set[str]:
    return {tok.VOCAB[i] for i in mask_row.nonzero().flatten().tolist()}


def with_move(fen: str, move_tokens: list[str]) -> torch.Tensor:
    ids = tok.encode(fen)[:tok.BOARD_LEN] + [tok.TOKEN_ID[t] for t in move_tokens]
    return torch.tensor([ids])


# -- legal moves and the greedy choice -------------------------------------------------------
PROMO = "7k/P7/8/8/8/8/8/K7 w - - 0 1"  # legal: Ka1-a2/b1/b2, a7-a8 = N/B/R/Q (7 moves)


def uci(triple) -> str:
    names = [tok.VOCAB[i] for i in triple]
    return names[0] + names[1] + ("" if names[2] == tok.ABSENT else names[2][-1])


def test_legal_move_tokens_by_hand():
    assert sorted(uci(m) for m in legal_move_tokens(tok.encode(PROMO))) == [
        "a1a2", "a1b1", "a1b2", "a7a8b", "a7a8n", "a7a8q", "a7a8r"]
    mated = tok.encode("R5k1/5ppp/8/8/8/8/8/6K1 b - - 0 1")  # back-rank mate, black to move
    assert legal_move_tokens(mated) == [(tok.TOKEN_ID[tok.ABSENT],) * 3]
    assert legal_move_tokens(tok.encode("8/8/8/8/8/8/8/K7 w - - 0 1")) is None  # no black king: not valid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choose_moves_takes_the_legal_move_with_the_highest_summed_log_prob(seed):
    fens = [PROMO, "r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3", "8/8/8/8/8/8/8/K7 w - - 0 1"]
    x = torch.tensor([tok.encode(f) for f in fens])
    x[:, MOVES] = tok.MASK_ID
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(len(fens), tok.SEQ_LEN, tok.VOCAB_SIZE, generator=g)).masked_fill(
        ~tok.allowed_token_mask(), float("-inf"))
    out = choose_moves(logits, x)
    log_pi = torch.log_softmax(logits, -1)
    for row, fen in enumerate(fens[:2]):  # by brute force over python-chess's legal moves
        def score(m):
            promo = tok.ABSENT if m.promotion is None else "promo:" + chess.piece_symbol(m.promotion)
            return sum(log_pi[row, pos, tok.TOKEN_ID[t]].item() for pos, t in zip(
                range(tok.BOARD_LEN, tok.SEQ_LEN), (chess.square_name(m.from_square), chess.square_name(m.to_square), promo)))
        best = max(chess.Board(fen).legal_moves, key=score)
        assert uci(out[row, MOVES].tolist()) == best.uci()
    # an invalid board: each position's own most likely token, legal or not
    assert out[2, MOVES].tolist() == log_pi[2, MOVES].argmax(-1).tolist()
    assert torch.equal(out[:, :tok.BOARD_LEN], x[:, :tok.BOARD_LEN])


def test_choose_moves_keeps_a_fixed_from_square():
    x = torch.tensor([tok.encode(PROMO)])
    x[0, tok.MOVE_TO:] = tok.MASK_ID
    x[0, tok.MOVE_FROM] = tok.TOKEN_ID["a7"]
    logits = torch.zeros(1, tok.SEQ_LEN, tok.VOCAB_SIZE)
    logits[0, tok.PROMOTION, tok.TOKEN_ID["promo:r"]] = 5.0
    logits[0, tok.MOVE_TO, tok.TOKEN_ID["b2"]] = 9.0  # the king's move is likelier, but a7 is fixed
    assert uci(choose_moves(logits, x)[0, MOVES].tolist()) == "a7a8r"


# -- the "last" schedule ---------------------------------------------------------------------
def test_last_schedule_unmasks_the_move_only_after_the_whole_board():
    model, seen = tiny_model(), []

    def logits_fn(x):
        seen.append(x.clone())
        return model(x, torch.zeros(x.shape[0], len(model.config.themes)))

    free = torch.full((4, tok.SEQ_LEN), tok.MASK_ID)
    out = move_last(logits_fn, free, 6, generator=torch.Generator().manual_seed(0))
    assert len(seen) == 6 + 1  # six board steps, then one for the move
    for x in seen[:6]:  # while any board position is masked, the model sees no move token
        assert bool((x[:, MOVES] == tok.MASK_ID).all())
    assert bool((seen[5][:, :tok.BOARD_LEN] == tok.MASK_ID).any())  # the last board step still had work
    assert not bool((seen[6][:, :tok.BOARD_LEN] == tok.MASK_ID).any())  # the move's step: a finished board
    assert bool((seen[6][:, MOVES] == tok.MASK_ID).all())
    assert not bool((out == tok.MASK_ID).any())


def test_last_schedule_board_draws_equal_a_no_move_models():
    """The board's plan and draws under "last" are those of a model whose move is fixed "-": the
    same weights give the same board, so the ablation's two arms share their random numbers."""
    with_task, without = tiny_model(True), tiny_model(False)
    without.load_state_dict(with_task.state_dict())
    a = ChessPuzzlePipeline(with_task)(["fork"] * 8, move_schedule="last", generator=torch.Generator().manual_seed(3))
    b = ChessPuzzlePipeline(without)(["fork"] * 8, move_schedule="joint", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens[:, :tok.BOARD_LEN], b.tokens[:, :tok.BOARD_LEN])


@pytest.mark.parametrize("fen", ["6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", PROMO,
                                 "r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3"])
def test_the_chosen_move_is_legal_on_a_legal_board(fen):
    """An untrained model (random move logits) on a fixed legal board: every "last" move is legal,
    while the "joint" schedule's are mostly not (so the check can fail)."""
    partial = partial_tokens(fen, range(tok.BOARD_LEN))
    pipe = ChessPuzzlePipeline(tiny_model())
    legal = {m.uci() for m in chess.Board(fen).legal_moves}
    last = pipe([""] * 64, partial=partial, move_schedule="last", generator=torch.Generator().manual_seed(0))
    joint = pipe([""] * 64, partial=partial, move_schedule="joint", generator=torch.Generator().manual_seed(0))
    assert all(m in legal for m in last.moves)
    assert sum(m in legal for m in joint.moves) < 32


def test_unknown_move_schedule_is_an_error():
    with pytest.raises(ValueError, match="move_schedule"):
        ChessPuzzlePipeline(tiny_model())(["fork"], move_schedule="first")


# -- a model without the move task -----------------------------------------------------------
@pytest.mark.parametrize("move_schedule", ["joint", "last"])
def test_a_no_move_task_model_never_unmasks_its_move(move_schedule, tmp_path):
    ChessPuzzlePipeline(tiny_model(move_task=False)).save_pretrained(tmp_path)
    pipe = ChessPuzzlePipeline.from_pretrained(tmp_path)  # the flag survives saving
    assert pipe.model.config.move_task is False
    out = pipe(["fork", "mateIn2"] * 8, move_schedule=move_schedule, generator=torch.Generator().manual_seed(0))
    assert bool((out.tokens[:, MOVES] == tok.TOKEN_ID[tok.ABSENT]).all())
    assert out.moves == [None] * 16


def test_a_no_move_task_model_ignores_move_tokens_and_refuses_a_fixed_move():
    model = tiny_model(move_task=False)
    themes = torch.zeros(1, len(model.config.themes))
    given = with_move(PROMO, ["a7", "a8", "promo:q"])
    masked = with_move(PROMO, [tok.MASK] * 3)
    assert torch.equal(model(given, themes), model(masked, themes))
    assert not torch.equal(tiny_model()(given, themes), tiny_model()(masked, themes))
    with pytest.raises(ValueError, match="move_task"):
        ChessPuzzlePipeline(model)(["fork"], partial=partial_tokens(PROMO, [tok.MOVE_FROM], move="a7a8q"))


# -- the "last" schedule in training (sampling.move_schedule) ---------------------------------
def _last_sampling(num_steps: int = 6):
    from flowalign.config import SamplingConfig

    return SamplingConfig(num_steps=num_steps, move_schedule="last")


@pytest.fixture
def tiny_adapter(tmp_path):
    ChessPuzzlePipeline(tiny_model()).save_pretrained(tmp_path)
    return ChessAdapter.from_pretrained(str(tmp_path))


def test_training_rollout_under_last_samples_what_the_pipeline_samples(tiny_adapter):
    """The trainer's rollout (``masked_rollout``) with the same seed gives the pipeline's "last"
    samples, board and move; no step unmasks a move position, so no log-prob covers the move."""
    from flowalign.epoch_sampler import masked_rollout

    adapter = tiny_adapter
    requests = ["fork", "mateIn2", "", "pin short"] * 2
    traj = masked_rollout(adapter, adapter.encode(requests), _last_sampling(), torch.Generator().manual_seed(4))
    out = adapter.pipe(requests, num_steps=6, move_schedule="last", generator=torch.Generator().manual_seed(4))
    assert torch.equal(traj.samples, out.tokens)
    assert not bool(traj.unmask[:, :, MOVES].any())
    assert not bool((traj.samples == tok.MASK_ID).any())


def test_rescoring_a_last_rollout_gives_ratio_exactly_one_only_with_the_move_view(tiny_adapter):
    """Rescoring reads the trajectory's conditioning, which carries the move view: every step's
    log-prob is reproduced exactly. Shown "-" instead (the held-out token), the model would
    condition on "no move" and the log-probs differ, which is what the view prevents."""
    from flowalign.epoch_sampler import masked_rollout
    from pipelines.base import Conditioning
    from pipelines.unmasking import score_step

    adapter = tiny_adapter
    traj = masked_rollout(adapter, adapter.encode(["fork short", "mateIn2", "", "pin"]), _last_sampling(4),
                          torch.Generator().manual_seed(3))
    blind = Conditioning({k: v for k, v in traj.cond.tensors.items() if k != "move_view"})
    differs = False
    for s in range(traj.num_steps):
        step = (traj.states[:, s], traj.states[:, s + 1], traj.unmask[:, s])
        seen = score_step(adapter.predict(step[0], None, traj.cond, model=adapter.trainable()), *step[1:])
        assert torch.equal(seen.log_prob, traj.log_probs[:, s])
        differs |= not torch.equal(score_step(adapter.predict(step[0], None, blind), *step[1:]).log_prob,
                                   traj.log_probs[:, s])
    assert differs


def test_move_schedule_last_is_refused_for_a_family_without_a_move():
    from flowalign.config import ConfigError, load_config
    from flowalign.preflight import check_model

    config = load_config("configs/shapes_nft.yaml", ["sampling.move_schedule=last"])
    with pytest.raises(ConfigError, match="sampling.move_schedule"):
        check_model(config)
    with pytest.raises(ConfigError, match="sampling.move_schedule"):
        load_config("configs/chess_ddpo.yaml", ["sampling.move_schedule=first"])


@pytest.mark.skipif(find_stockfish() is None or importlib.util.find_spec("chess") is None,
                    reason="needs Stockfish and python-chess: apt-get install stockfish; pip install 'chess>=1.10'")
def test_a_short_ddpo_run_under_last_runs_on_policy(tmp_path):
    """``flowalign train`` with ``sampling.move_schedule=last`` as a user runs it: the move view
    travels with the conditioning through the trainer's batching (epoch cat, minibatch
    indexing, the reference's rescoring), the run finishes on-policy in its first epoch and
    records the schedule. (That rollout and rescoring show the same view is the unit test's
    job above: dropping the view from both keeps this ratio at 1.)"""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "flowalign.cli", "train", "configs/chess_ddpo.yaml", "train.epochs=1",
                    "train.groups_per_epoch=2", "train.train_batch_size=16", "reward.kwargs={engines: 1, nodes: 2000}",
                    "eval.seeds=1", "eval.grid_prompts=1", "eval.grid_seeds=1", "checkpoint_every=0", "threads=1",
                    "tracker=none", "sampling.move_schedule=last", f"output_dir={out}"], check=True, capture_output=True)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert abs(history[0]["train/ratio"] - 1.0) < 0.05 and history[0]["train/clipfrac"] < 0.1
    assert json.loads((out / "config.json").read_text())["sampling"]["move_schedule"] == "last"


# -- pre-training masks ----------------------------------------------------------------------
def _pretrain_module():
    return load_script("pretrain_chess")


def test_pretraining_masks_without_the_move_task_train_no_move_and_mask_the_board_alike():
    mask_batch = _pretrain_module().mask_batch
    tokens = torch.tensor([tok.encode(PROMO, "a7a8q")] * 256)
    noisy_with, trained_with = mask_batch(tokens, torch.Generator().manual_seed(5))
    noisy_wo, trained_wo = mask_batch(tokens, torch.Generator().manual_seed(5), move_task=False)
    assert not bool(trained_wo[:, MOVES].any())  # no loss on the move
    assert bool((noisy_wo[:, MOVES] == tok.MASK_ID).all())  # and never shown
    assert bool(trained_wo[:, :tok.BOARD_LEN].any(1).all())  # every sample trains a board position
    assert bool(trained_with[:, MOVES].any())  # the with-arm does train the move
    # the same draws: rows where the board was masked without forcing are masked identically
    natural = trained_with[:, :tok.BOARD_LEN].sum(1) > 1
    assert int(natural.sum()) > 200
    assert torch.equal(trained_with[natural, :tok.BOARD_LEN], trained_wo[natural, :tok.BOARD_LEN])


# -- pre-training continued from a saved model (--init-from) ---------------------------------
def _run_pretrain(tmp_path, *args):
    import subprocess
    import sys

    from flowalign.chess.puzzles import DEFAULT_PUZZLES

    if not DEFAULT_PUZZLES.exists():
        pytest.skip(f"shared puzzle CSV not at {DEFAULT_PUZZLES}")
    small = tmp_path / "puzzles.csv"
    if not small.exists():
        small.write_text("".join(DEFAULT_PUZZLES.open().readlines()[:301]))  # header + 300 puzzles
    return subprocess.run([sys.executable, "scripts/pretrain_chess.py", "--data", str(small), "--batch", "8",
                           "--test-fraction", "0.1", "--eval-every", "1000", *args], capture_output=True, text=True)


def test_pretraining_continues_from_the_saved_weights_and_keeps_the_split(tmp_path):
    """--init-from with 0 steps evaluates the loaded model: the same held-out loss as the run it
    continues (a fresh init would not give it), the architecture read from the saved config, the
    same split; a different --seed (another split: the held-out puzzles would leak) is refused."""
    import json

    first = _run_pretrain(tmp_path, "--out", str(tmp_path / "a"), "--steps", "3", "--dim", "32", "--layers", "1",
                          "--heads", "2")
    assert first.returncode == 0, first.stderr
    again = _run_pretrain(tmp_path, "--out", str(tmp_path / "b"), "--steps", "0", "--init-from", str(tmp_path / "a"),
                          "--data-seed", "1")
    assert again.returncode == 0, again.stderr
    a, b = (json.loads((tmp_path / d / "pretraining.json").read_text()) for d in "ab")
    assert b["final_heldout_loss"] == a["final_heldout_loss"]
    assert (b["dim"], b["layers"], b["heads"]) == (32, 1, 2) and b["continued_from"]["steps"] == 3
    assert (tmp_path / "a" / "split.json").read_text() == (tmp_path / "b" / "split.json").read_text()
    refused = _run_pretrain(tmp_path, "--out", str(tmp_path / "c"), "--steps", "0", "--init-from", str(tmp_path / "a"),
                            "--seed", "1")
    assert refused.returncode != 0 and "split" in refused.stderr
