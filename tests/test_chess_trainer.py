"""The generic trainer on the chess family (masked diffusion, method ddpo): on-policy ratio, KL at
init, exact resume, per-tag evaluation with board diversity and drawn boards, config errors, and the
chess prompt sources. A tiny model built here and a cheap reward: no Stockfish, no demo model."""

import json

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.prompts import load_prompts
from flowalign.objectives.masked_ddpo import masked_trained_steps
from flowalign.trainer import Trainer
from pipelines.chess import ChessPuzzlePipeline
from pipelines.chess_model import ChessDiffusionModel
from reward_models.base import Reward, register_reward
from reward_models.chess.legality import legality_problems

REQUESTS = [["fork"], ["mate", "mateIn2"], ["short"]]


@register_reward("test_chess_cheap")
class CheapChessReward(Reward):
    """legal (the chess_puzzle reward's legality rule) and the fraction of empty squares: a
    continuous component so that every group has a spread even when no board is legal."""

    components = ("legal", "empty")

    def __call__(self, samples, prompts, metadata):
        assert all(isinstance(fen, str) for fen in samples) and all("themes" in m for m in metadata)
        legal = [float(not legality_problems(fen)) for fen in samples]
        empty = [sum(int(c) for c in fen.split()[0] if c.isdigit()) / 64 for fen in samples]
        return {"legal": torch.tensor(legal), "empty": torch.tensor(empty)}




@pytest.fixture(scope="module")
def tiny_chess_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chess")
    torch.manual_seed(0)
    ChessPuzzlePipeline(ChessDiffusionModel(dim=32, layers=1, heads=2)).save_pretrained(path)
    (path / "split.json").write_text(json.dumps({"seed": 0, "requests": REQUESTS, "test_puzzle_ids": []}))
    return path


def chess_config(model_dir, out, *overrides):
    return load_config(None, [
        f"output_dir={out}", "method=ddpo", "model.family=chess", f"model.path={model_dir}", "model.lora_rank=4",
        "tracker=none", "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=4", "train.train_batch_size=8", "train.advantage_baseline=leave_one_out",
        "train.clip_range=0.2", "train.kl_beta=0.1", "train.entropy_coef=0.2", "train.learning_rate=1e-2",
        "reward.name=test_chess_cheap", "reward.weights={legal: 1.0, empty: 1.0}",
        f"data.train_prompts=chess:test:{model_dir}", f"data.eval_prompts=chess:test:{model_dir}",
        "eval.seeds=2", "eval.batch_size=4", "eval.grid_prompts=2", "eval.grid_seeds=2", "eval.every=0",
        "checkpoint_every=0", *overrides])


def test_first_update_is_on_policy_kl_starts_at_zero_and_eval_reports_per_tag(tiny_chess_dir, tmp_path):
    trainer = Trainer(chess_config(tiny_chess_dir, tmp_path, "train.epochs=1"))
    trainer.train()
    first = trainer.history[0]  # one minibatch: the whole epoch's 8 samples
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert first["train/clipfrac"] == 0.0
    assert first["train/approx_kl"] < 1e-12
    assert first["train/kl"] == 0.0  # LoRA starts as the identity: policy = reference
    assert first["train/entropy"] > 0
    assert first["adv/groups"] == 2.0  # the leave-one-out baseline's stats
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    before = metrics["before"]
    tags = {r[0] for r in REQUESTS}
    assert before["samples"] == len(REQUESTS) * 2
    for name in ("legal", "empty"):
        assert set(before[f"{name}_by_category"]) == tags
        assert 0.0 <= before[f"{name}_category_mean"] <= 1.0
    assert 0.0 < before["distinct"] <= 1.0 and 0.0 <= before["board_distance"] <= 1.0
    assert "latent_diversity" not in before
    assert {"before", "after", "delta"} <= set(metrics)
    assert (tmp_path / "grids" / "before_after.png").is_file()
    from PIL import Image

    grid = Image.open(tmp_path / "grids" / "before.png")
    assert grid.width >= 2 * 128 and grid.height >= 2 * 128  # 2 prompts × 2 seeds of drawn boards


def test_later_minibatches_move_off_policy_and_kl_grows(tiny_chess_dir, tmp_path):
    trainer = Trainer(chess_config(tiny_chess_dir, tmp_path, "train.train_batch_size=2"))
    trainer.train()
    assert trainer.history[1]["train/kl"] > 0
    assert trainer.history[1]["train/approx_kl"] > 1e-12


def test_resumed_run_reproduces_the_uninterrupted_run(tiny_chess_dir, tmp_path):
    common = ("train.train_batch_size=4", "train.ema_decay=0.9")
    full = Trainer(chess_config(tiny_chess_dir, tmp_path / "full", "train.epochs=4", *common))
    full.train()
    Trainer(chess_config(tiny_chess_dir, tmp_path / "cut", "train.epochs=2", *common)).train()
    resumed = Trainer(chess_config(tiny_chess_dir, tmp_path / "cut", "train.epochs=4", "resume=auto", *common))
    resumed.train()
    keys = ["train/policy_loss", "train/ratio", "train/kl", "train/entropy", "reward/mean", "train/grad_norm"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
    assert resumed.evals["after"] == {**full.evals["after"], "train_seconds": resumed.evals["after"]["train_seconds"]}


@pytest.mark.parametrize("override, match", [("method=flow_grpo", "ddpo"), ("sampling.step_mode=window", "step_mode"),
                                             ("train.per_reward_advantages=true", "per_reward_advantages")])
def test_unsupported_settings_fail_before_the_model_loads(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(chess_config(tmp_path / "no-model-here", tmp_path, override))


def test_leave_one_out_needs_group_statistics(tmp_path):
    with pytest.raises(ConfigError, match="leave_one_out"):
        chess_config(tmp_path, tmp_path, "train.per_prompt_stats=true")


def test_trained_steps_skip_the_steps_that_unmask_nothing():
    assert masked_trained_steps(16, "cosine", 73)[0] == 1  # cosine's first step unmasks round(73·(1 − cos(π/32))) = 0
    assert masked_trained_steps(4, "linear", 73) == [0, 1, 2, 3]


def test_chess_prompt_sources(tiny_chess_dir):
    test = load_prompts(f"chess:test:{tiny_chess_dir}")
    assert test[1] == {"prompt": "mate mateIn2", "themes": ["mate", "mateIn2"], "tag": "mate"}
    with pytest.raises(ValueError, match="train or test"):
        load_prompts(f"chess:all:{tiny_chess_dir}")


def test_chess_train_requests_come_from_the_training_puzzles_and_leave_out_the_held_out_ones():
    from flowalign.chess.puzzles import DEFAULT_PUZZLES

    if not DEFAULT_PUZZLES.exists():
        pytest.skip("the shared Lichess puzzles are not here")
    train, test = load_prompts("chess:train"), load_prompts("chess:test")
    assert len(test) == 16 and len(train) == 512
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(r["tag"] == r["themes"][0] and r["prompt"] == " ".join(r["themes"]) and 1 <= len(r["themes"]) <= 2
               for r in train)


def test_board_drawing_puts_pieces_where_the_fen_has_them():
    from flowalign.grids import DARK_SQUARE, LIGHT_SQUARE, chess_board

    empty, one = chess_board("8/8/8/8/8/8/8/8 w - - 0 1"), chess_board("K7/8/8/8/8/8/8/7k b - - 0 1")
    assert empty.shape == (3, 132, 128)
    light = torch.tensor(LIGHT_SQUARE) / 255
    assert torch.allclose(empty[:, 8, 8], light) and torch.allclose(empty[:, 8, 24], torch.tensor(DARK_SQUARE) / 255)
    differs = (empty != one).any(0)
    assert differs[:16, :16].any() and differs[112:128, 112:128].any()  # a8 and h1
    assert not differs[16:112].any()
    assert one[:, 130].mean() < empty[:, 130].mean()  # the side-to-move bar: black
