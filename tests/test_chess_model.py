"""Chess masked diffusion: the unmasking sampler's log-probs, inpainting, the masked-DDPO
objective, the leave-one-out baseline, and the model / pipeline / adapter round trips."""

import math

import chess
import pytest
import torch

from pipelines import chess_tokenizer as tok
from flowalign.advantages import leave_one_out_advantages
from flowalign.objectives.masked_ddpo import (categorical_entropy, categorical_kl,
                                              masked_ddpo_loss)
from pipelines.unmasking import rollout, score_step, unmask_counts, unmask_step, unmasking_plan
from pipelines import adapter_class
from pipelines.base import DEMO_MODELS_DIR
from pipelines.chess import ChessAdapter, ChessPuzzlePipeline, decode_boards, guided_logits, partial_tokens
from pipelines.chess_model import THEMES, ChessDiffusionModel

BACK_RANK = "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1"
ALLOWED = tok.allowed_token_mask()


def tiny_model(seed: int = 0) -> ChessDiffusionModel:
    torch.manual_seed(seed)
    return ChessDiffusionModel(dim=32, layers=1, heads=2).eval()


def random_logits(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, tok.SEQ_LEN, tok.VOCAB_SIZE, generator=g)
    return logits.masked_fill(~ALLOWED, float("-inf"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chess-md")
    ChessPuzzlePipeline(tiny_model()).save_pretrained(path)
    return path


# -- sampler ------------------------------------------------------------------------------
def test_unmask_counts_by_hand():
    assert unmask_counts(torch.tensor([10]), 4, "linear").tolist() == [[0, 2, 5, 8, 10]]  # 10 − round(10·(1 − s/4))
    assert unmask_counts(torch.tensor([10]), 2, "cosine").tolist() == [[0, 3, 10]]  # 10 − round(10·cos(π/4)) = 3
    with pytest.raises(ValueError, match="linear"):
        unmask_counts(torch.tensor([10]), 2, "square")


def test_plan_unmasks_every_free_position_once_and_no_fixed_one():
    free = torch.rand(5, tok.SEQ_LEN, generator=torch.Generator().manual_seed(1)) < 0.7
    plan = unmasking_plan(free, 6, schedule="cosine", generator=torch.Generator().manual_seed(2))
    assert plan.shape == (5, 6, tok.SEQ_LEN)
    assert torch.equal(plan.sum(1), free.long())
    assert torch.equal(plan.sum(2), torch.diff(unmask_counts(free.sum(1), 6, "cosine"), dim=1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_step_log_prob_equals_log_softmax_gathered_and_summed(temperature):
    logits = random_logits(3)
    x = torch.full((3, tok.SEQ_LEN), tok.MASK_ID)
    unmask = torch.zeros_like(x, dtype=torch.bool)
    unmask[0, [0, 5, 70]] = True
    unmask[1, [64, 72]] = True  # sample 2 unmasks nothing: log-prob 0
    step = unmask_step(logits, x, unmask, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(step.tokens[~unmask], x[~unmask])
    for b in range(3):
        expected = sum(torch.log_softmax(logits[b, pos] / temperature, -1)[step.tokens[b, pos]].item()
                       for pos in unmask[b].nonzero().flatten().tolist())
        assert step.log_prob[b].item() == pytest.approx(expected, abs=1e-5)
        assert step.token_log_probs[b, ~unmask[b]].abs().sum() == 0


def test_step_refuses_unmasking_a_fixed_position_and_a_zero_temperature():
    x = torch.tensor([tok.encode(BACK_RANK)])
    with pytest.raises(ValueError, match="not masked"):
        unmask_step(random_logits(1), x, torch.ones_like(x, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        score_step(random_logits(1), x, torch.ones_like(x, dtype=torch.bool), temperature=0.0)


def test_partial_board_is_kept_and_only_allowed_tokens_appear():
    model = tiny_model()
    keep = ["g8", "f7", "g7", "h7", "a1", "g1", tok.TURN]
    fixed = partial_tokens(BACK_RANK, keep).expand(4, -1)
    is_fixed = fixed != tok.MASK_ID
    cond_themes = model.encode_themes(["backRankMate mateIn1"] * 4)
    traj = rollout(lambda x: model(x, cond_themes), fixed.clone(), 5, generator=torch.Generator().manual_seed(0))
    assert traj.states.shape == (4, 6, tok.SEQ_LEN) and traj.log_probs.shape == (4, 5)
    for s in range(traj.states.shape[1]):
        state = traj.states[:, s]
        assert torch.equal(state[is_fixed], fixed[is_fixed])  # fixed squares in every intermediate state
        filled = state != tok.MASK_ID
        assert ALLOWED[torch.arange(tok.SEQ_LEN).expand(4, -1)[filled], state[filled]].all()
    assert not (traj.unmask & is_fixed[:, None]).any()  # never unmasked, so never scored
    assert (traj.samples != tok.MASK_ID).all()
    for s in range(5):  # a token once written never changes
        before, after = traj.states[:, s], traj.states[:, s + 1]
        assert torch.equal(after[before != tok.MASK_ID], before[before != tok.MASK_ID])
    source = chess.Board(BACK_RANK)
    for fen, _ in decode_boards(traj.samples):
        board = chess.Board(fen)
        assert board.turn == chess.WHITE
        squares = [chess.parse_square(sq) for sq in keep[:-1]]
        assert [board.piece_at(sq) for sq in squares] == [source.piece_at(sq) for sq in squares]


def test_rescoring_recorded_steps_with_the_same_model_gives_ratio_exactly_one(tiny_dir):
    adapter = ChessAdapter.from_pretrained(str(tiny_dir))
    cond = adapter.encode(["fork short", "mateIn2", "", "pin"])
    traj = rollout(lambda x: adapter.predict(x, None, cond), adapter.initial_state(cond), 4,
                   generator=torch.Generator().manual_seed(3))
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    for s in range(traj.num_steps):
        logits = adapter.predict(traj.states[:, s], None, cond, model=adapter.trainable())
        rescored = score_step(logits, traj.states[:, s + 1], traj.unmask[:, s])
        assert torch.equal(rescored.log_prob, traj.log_probs[:, s])
        _, stats = masked_ddpo_loss(logits, traj.states[:, s + 1], traj.unmask[:, s], traj.log_probs[:, s],
                                    advantages, clip_range=0.2)
        assert stats["ratio"].item() == 1.0 and stats["clipfrac"].item() == 0.0


# -- objective ------------------------------------------------------------------------------
def test_kl_is_zero_for_equal_policies_and_matches_torch_distributions_otherwise():
    p, q = random_logits(2, seed=0), random_logits(2, seed=1)
    assert torch.equal(categorical_kl(p, p), torch.zeros(2, tok.SEQ_LEN))
    kl = categorical_kl(p, q)
    assert (kl > 0).all()
    allowed = ALLOWED[10]  # a square: 13 tokens
    expected = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=p[0, 10, allowed]),
                                                 torch.distributions.Categorical(logits=q[0, 10, allowed]))
    assert kl[0, 10].item() == pytest.approx(expected.item(), rel=1e-5)


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0], [math.log(3), 0.0, float("-inf")]]])
    expected = [math.log(2), math.log(3), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    assert categorical_entropy(logits)[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert categorical_entropy(logits * 1e3, temperature=1e3)[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_loss_with_kl_and_entropy_adds_them_over_the_unmasked_positions():
    logits, ref = random_logits(2, seed=0), random_logits(2, seed=1)
    tokens = torch.tensor([tok.encode(BACK_RANK)] * 2)
    unmask = torch.zeros_like(tokens, dtype=torch.bool)
    unmask[:, :3] = True
    old = score_step(logits, tokens, unmask).log_prob
    loss, stats = masked_ddpo_loss(logits, tokens, unmask, old, torch.zeros(2), clip_range=0.2, ref_logits=ref,
                                   beta=0.1, entropy_coef=0.2)
    kl = categorical_kl(logits, ref)[:, :3].sum(1).mean()
    entropy = categorical_entropy(logits)[:, :3].sum(1).mean()
    assert stats["kl"].item() == pytest.approx(kl.item(), rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * kl.item() - 0.2 * entropy.item(), rel=1e-5)
    with pytest.raises(ValueError, match="ref_logits"):
        masked_ddpo_loss(logits, tokens, unmask, old, torch.zeros(2), clip_range=0.2, beta=0.1)


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, float("nan"), 4.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    raw, stats = leave_one_out_advantages(rewards, groups, scale_by_std=False)
    # group 0: baselines (2+3+6)/3, (1+3+6)/3, (1+2+6)/3, (1+2+3)/3; group 1 has one valid sample
    assert raw.tolist() == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0])
    assert stats == {"groups": 3.0, "zero_spread_groups": pytest.approx(2 / 3)}  # the singleton and group 2
    scaled, _ = leave_one_out_advantages(rewards, groups, eps=0.0)
    assert scaled[:4].tolist() == pytest.approx([(1 - 11 / 3) / math.sqrt(3.5), (2 - 10 / 3) / math.sqrt(3.5), 0.0,
                                                 4.0 / math.sqrt(3.5)])
    assert scaled[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_gradient_step_raises_the_log_prob_of_a_positive_advantage_sample():
    logits = random_logits(2).requires_grad_(True)
    tokens = torch.tensor([tok.encode(BACK_RANK, "a1a8")] * 2)
    unmask = torch.zeros_like(tokens, dtype=torch.bool)
    unmask[:, [6, 62, 70, 71]] = True
    with torch.no_grad():
        old = score_step(logits, tokens, unmask).log_prob
    loss, _ = masked_ddpo_loss(logits, tokens, unmask, old, torch.tensor([1.0, -1.0]), clip_range=0.2)
    loss.backward()
    with torch.no_grad():
        assert not logits.grad.isnan().any()
        new = score_step(logits - 0.1 * logits.grad, tokens, unmask).log_prob
    assert new[0] > old[0] and new[1] < old[1]


# -- model, pipeline, adapter -----------------------------------------------------------------
def test_theme_list_is_the_reward_taggers():
    from reward_models.chess.themes import SUPPORTED_THEMES

    # the shipped model's 41 themes are all still produced by the tagger (which now knows more: a model
    # conditioned on those needs retraining with its own list, stored in its config)
    assert set(THEMES) <= set(SUPPORTED_THEMES) and len(THEMES) == 41
    with pytest.raises(ValueError, match="unknown theme"):
        tiny_model().encode_themes(["fork notATheme"])


def test_logits_are_restricted_to_allowed_tokens_and_guidance_keeps_that():
    model = tiny_model()
    x = torch.full((2, tok.SEQ_LEN), tok.MASK_ID)
    themes = model.encode_themes(["mateIn1", "fork"])
    for g in (1.0, 3.0):
        logits = guided_logits(model, x, themes, g)
        assert torch.equal(torch.isfinite(logits), ALLOWED.expand(2, -1, -1))


def test_model_and_pipeline_save_load_round_trip(tiny_dir, tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    loaded = ChessDiffusionModel.from_pretrained(tmp_path / "m")
    assert tuple(loaded.config.themes) == THEMES and loaded.config.dim == 32
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    pipe = ChessPuzzlePipeline.from_pretrained(tiny_dir)
    first = pipe(["mateIn2", "fork"], num_steps=3, generator=torch.Generator().manual_seed(0))
    pipe.save_pretrained(tmp_path / "p")
    again = ChessPuzzlePipeline.from_pretrained(tmp_path / "p")(["mateIn2", "fork"], num_steps=3,
                                                                 generator=torch.Generator().manual_seed(0))
    assert torch.equal(first.tokens, again.tokens) and first.fens == again.fens


def test_adapter_lora_reference_and_save_trained_round_trip(tiny_dir, tmp_path):
    assert adapter_class("chess") is ChessAdapter
    base = ChessAdapter.from_pretrained(str(tiny_dir))
    adapter = ChessAdapter.from_pretrained(str(tiny_dir))
    adapter.add_lora(4, init=False)  # random A and B: the LoRA changes the output
    x = adapter.initial_noise(2)
    cond = adapter.encode(["mateIn1", ""])
    finite = torch.isfinite(base.predict(x, None, cond))
    lora_out = adapter.predict(x, None, cond)
    assert not torch.allclose(lora_out[finite], base.predict(x, None, cond)[finite])
    with adapter.reference():
        assert torch.equal(adapter.predict(x, None, cond), base.predict(x, None, cond))
    adapter.save_trained(tmp_path / "lora")
    fused = ChessAdapter.from_pretrained(str(tiny_dir), trained=tmp_path / "lora")
    assert torch.allclose(fused.predict(x, None, cond)[finite], lora_out[finite], atol=1e-5)
    full = ChessAdapter.from_pretrained(str(tiny_dir))
    full.enable_full_finetune(keep_reference=True)
    full.save_trained(tmp_path / "full")
    reloaded = ChessAdapter.from_pretrained(str(tiny_dir), trained=tmp_path / "full")
    assert torch.equal(reloaded.predict(x, None, cond), base.predict(x, None, cond))


def test_decode_drops_a_half_written_move():
    ids = tok.encode(BACK_RANK, "a1a8")
    ids[tok.MOVE_TO] = tok.TOKEN_ID[tok.ABSENT]
    assert decode_boards(torch.tensor([ids])) == [(BACK_RANK, None)]


@pytest.mark.skipif(not (DEMO_MODELS_DIR / "chess-md" / "model_index.json").is_file(), reason="demo model not built")
def test_shipped_demo_model_loads_and_is_small():
    folder = DEMO_MODELS_DIR / "chess-md"
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) <= 20 * 2**20
    out = ChessPuzzlePipeline.from_pretrained(folder)(["mateIn1"], num_steps=4,
                                                      generator=torch.Generator().manual_seed(0))
    assert len(out.fens) == 1 and out.tokens.shape == (1, tok.SEQ_LEN)
