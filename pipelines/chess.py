"""The chess-puzzle family: a masked-diffusion pipeline of boards and its RL adapter.

State x: long [B, L] board tokens of ``pipelines.chess_tokenizer`` (L = 73; ``MASK_ID`` where
not yet generated). ``ChessPuzzlePipeline`` generates boards + best moves from theme requests,
optionally around a partial board (fixed tokens kept: inpainting). ``ChessAdapter`` is the same
model as the RL core sees it: ``prediction = "logits"``, so a trainer samples it with
``pipelines.unmasking.rollout`` and trains it with ``objectives.masked_ddpo``.

Move schedule (``move_schedule``): ``"joint"`` unmasks the three best-move positions at random
steps together with the board, as pre-training masks them, so the move is usually committed
before the board it belongs to exists. ``"last"`` unmasks the board alone (the move positions
stay ``[MASK]`` in the model's input, and the board's plan and random draws are those of a
73 − 3 = 70-position sequence, as for a model without the move task), then the move in one
more forward pass at the finished board: when the board is valid (python-chess
``Board.is_valid()``), the legal move whose three tokens are most probable together
(``choose_moves``: greedy over the legal moves), so the move is always legal; on an invalid
board each position's most probable token. The default stays ``"joint"``: every earlier
measurement and the shipped DDPO recipe used it. A trainer samples "last" with
``sampling.move_schedule: last`` (``ChessAdapter.hold_out_move`` / ``finish_move``): its steps
unmask the board, and the move written afterwards is not a trained step. A model pre-trained without the
move task (``config.move_task`` False) never samples a move: its move positions are fixed "-".

Classifier-free guidance (``guidance_scale`` g > 1) mixes log-probabilities, per position over
its allowed tokens: log π_u + g·(log π_c − log π_u), with the unconditional branch the empty theme
request on the same board (pre-training drops the themes at random, so that branch is trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import chess
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput
from torch import nn

from pipelines import chess_tokenizer as tokenizer
from pipelines.unmasking import rollout
from pipelines.base import Conditioning, load_with_hub_fallback
from pipelines.chess_model import ChessDiffusionModel
from pipelines.denoiser import DenoiserAdapter, load_trained_weights, torch_dtype

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out")


def guided_logits(model: nn.Module, tokens: torch.Tensor, themes: torch.Tensor,
                  guidance_scale: float = 1.0) -> torch.Tensor:
    """Logits [B, L, V] of ``model`` (−inf = disallowed) at tokens [B, L] with themes [B, T];
    with g > 1 the guided mixture of the module docstring (one batched forward of 2B)."""
    if guidance_scale <= 1.0:
        return model(tokens, themes)
    both = model(torch.cat([tokens, tokens]), torch.cat([torch.zeros_like(themes), themes]))
    uncond, cond = torch.log_softmax(both, dim=-1).chunk(2)
    mixed = uncond + guidance_scale * (cond - uncond)
    return torch.where(torch.isfinite(cond), mixed, torch.full_like(mixed, float("-inf")))  # −inf − −inf is NaN


def partial_tokens(fen: str, keep: Iterable[int | str], move: str | None = None) -> torch.Tensor:
    """A partial board for inpainting: long [L] with the tokens of ``fen`` (+ ``move``) at the
    positions in ``keep`` and ``MASK_ID`` elsewhere. ``keep`` holds positions (0 … 72, see the
    tokenizer's layout) or square names ("e4").

    >>> fixed = partial_tokens("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", ["g8", "f7", "g7", "h7", 64])
    >>> int((fixed != tokenizer.MASK_ID).sum())
    5
    """
    ids = torch.tensor(tokenizer.encode(fen, move))
    positions = [tokenizer.SQUARE_NAMES.index(k) if isinstance(k, str) else int(k) for k in keep]
    if any(not 0 <= p < tokenizer.SEQ_LEN for p in positions):
        raise ValueError(f"keep positions must be in 0 … {tokenizer.SEQ_LEN - 1}, got {positions}")
    out = torch.full_like(ids, tokenizer.MASK_ID)
    out[positions] = ids[positions]
    return out


MOVE_SCHEDULES = ("joint", "last")
_ABSENT_ID = tokenizer.TOKEN_ID[tokenizer.ABSENT]


def _move_tokens(move: chess.Move) -> tuple[int, int, int]:
    promo = tokenizer.ABSENT if move.promotion is None else f"promo:{chess.piece_symbol(move.promotion)}"
    return (tokenizer.TOKEN_ID[chess.square_name(move.from_square)],
            tokenizer.TOKEN_ID[chess.square_name(move.to_square)], tokenizer.TOKEN_ID[promo])


def legal_move_tokens(ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The legal moves of the board in ``ids[:70]`` (token ids, no MASK there) as (from, to,
    promotion) token triples; ``[("-", "-", "-")]`` (as ids) when it has none (mate, stalemate);
    None when python-chess does not call the board valid (then no move is legal or illegal)."""
    try:
        fen, _ = tokenizer.decode(list(ids[:tokenizer.BOARD_LEN]) + [_ABSENT_ID] * 3)
        board = chess.Board(fen)
    except (tokenizer.TokenError, ValueError):
        return None
    if not board.is_valid():
        return None
    return [_move_tokens(m) for m in board.legal_moves] or [(_ABSENT_ID,) * 3]


def choose_moves(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The "last" schedule's move: logits [B, L, V] of the finished boards x long [B, L] (the
    move positions MASK where free, a token where fixed) → x with every free move position
    filled. Each move m of ``legal_move_tokens`` that agrees with the fixed move tokens scores
    Σ log π(m's token | x, ℓ) over the free move positions ℓ (the model's per-position
    categoricals at the finished board); the best one is taken (greedy: the move is the
    model's prediction of the solution, not generated content). A row with no valid board or no
    agreeing legal move takes each free position's most likely allowed token."""
    out = x.clone()
    log_pi = torch.log_softmax(logits[:, tokenizer.BOARD_LEN:].float(), dim=-1).cpu()  # [B, 3, V]
    for row, ids in enumerate(x.tolist()):
        given = ids[tokenizer.BOARD_LEN:]
        free = [slot for slot, t in enumerate(given) if t == tokenizer.MASK_ID]
        if not free:
            continue
        moves = [m for m in legal_move_tokens(ids) or []
                 if all(m[slot] == t for slot, t in enumerate(given) if t != tokenizer.MASK_ID)]
        if moves:
            cand = torch.tensor(moves)  # [M, 3]
            score = log_pi[row, free][torch.arange(len(free))[None], cand[:, free]].sum(-1)  # [M]
            chosen = cand[int(score.argmax())].tolist()
        else:
            chosen = log_pi[row].argmax(-1).tolist()
        for slot in free:
            out[row, tokenizer.BOARD_LEN + slot] = chosen[slot]
    return out


def decode_boards(tokens: torch.Tensor) -> list[tuple[str, str | None]]:
    """Generated tokens [B, L] → B (FEN, best move or None). A half-specified move (one square
    and one "-") is dropped rather than failing the board; a leftover MASK is a ``TokenError``."""
    out = []
    for row in tokens.tolist():
        try:
            out.append(tokenizer.decode(row))
        except tokenizer.TokenError:
            no_move = row[:tokenizer.MOVE_FROM] + [tokenizer.TOKEN_ID[tokenizer.ABSENT]] * 3
            out.append((tokenizer.decode(no_move)[0], None))
    return out


@dataclass
class ChessPuzzlePipelineOutput(BaseOutput):
    """fens: B FEN strings (counters ``0 1``); moves: B UCI best moves (None where the model wrote
    none); tokens: long [B, L] the generated sequences."""

    fens: list[str]
    moves: list[str | None]
    tokens: torch.Tensor


class ChessPuzzlePipeline(DiffusionPipeline):
    """Generate chess puzzles by masked diffusion.

    >>> pipe = ChessPuzzlePipeline(ChessDiffusionModel(dim=32, layers=1, heads=2))
    >>> out = pipe(["mateIn2", "fork short"], num_steps=4, generator=torch.Generator().manual_seed(0))
    >>> len(out.fens), out.tokens.shape
    (2, torch.Size([2, 73]))
    """

    model: ChessDiffusionModel

    def __init__(self, model: ChessDiffusionModel):
        super().__init__()
        self.register_modules(model=model)

    @torch.no_grad()
    def __call__(self, themes: Sequence[str | Sequence[str]], *, partial: torch.Tensor | None = None,
                 num_steps: int = 16, schedule: str = "cosine", temperature: float = 1.0,
                 guidance_scale: float = 1.0, move_schedule: str = "joint",
                 generator: torch.Generator | None = None, return_dict: bool = True):
        """themes: B requests (space-separated keys or lists; "" = unconditional; one string = one
        sample); partial: long [B, L] or [L] (``partial_tokens``; MASK where free), its tokens
        kept as given. Schedule and temperature as in ``pipelines.unmasking``; the
        default 16 steps unmask ~4.6 positions per step on average. ``move_schedule``: "joint" or
        "last" (the module docstring; "last" adds up to three steps for the move)."""
        if move_schedule not in MOVE_SCHEDULES:
            raise ValueError(f"move_schedule must be one of {MOVE_SCHEDULES}, got {move_schedule!r}")
        themes = [themes] if isinstance(themes, str) else list(themes)  # one request, not its characters
        cond = themes_and_fixed(self.model, themes, partial)
        logits_fn = lambda x: guided_logits(self.model, x, cond.tensors["themes"], guidance_scale)  # noqa: E731
        if move_schedule == "joint":
            samples = rollout(logits_fn, cond.tensors["fixed"], num_steps, schedule=schedule,
                              temperature=temperature, generator=generator).samples
        else:
            samples = move_last(logits_fn, cond.tensors["fixed"], num_steps, schedule=schedule,
                                temperature=temperature, generator=generator)
        fens, moves = zip(*decode_boards(samples)) if len(themes) else ((), ())
        out = ChessPuzzlePipelineOutput(list(fens), list(moves), samples)
        return out if return_dict else (out.fens, out.moves, out.tokens)


def hold_out_move(fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The "last" schedule's view of a start state: fixed long [B, L] (MASK where free) →
    (held long [B, L]: the free move positions set to "-", so no unmasking plan includes them;
    move_view long [B, 3]: what the model is shown at the move positions while the board is
    unmasked, MASK where free and the fixed token elsewhere)."""
    move_view = fixed[:, tokenizer.BOARD_LEN:].clone()
    held = fixed.clone()
    held[:, tokenizer.BOARD_LEN:] = torch.where(move_view == tokenizer.MASK_ID, _ABSENT_ID, move_view)
    return held, move_view


def show_move(x: torch.Tensor, move_view: torch.Tensor) -> torch.Tensor:
    """x long [B, L] with its move positions replaced by ``move_view`` long [B, 3] (a copy)."""
    shown = x.clone()
    shown[:, tokenizer.BOARD_LEN:] = move_view
    return shown


@torch.no_grad()
def move_last(logits_fn, fixed: torch.Tensor, num_steps: int, *, schedule: str = "cosine",
              temperature: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The "last" move schedule: fixed long [B, L] (MASK where free) → samples long [B, L]. The
    board's free positions are unmasked by ``pipelines.unmasking.rollout`` in ``num_steps`` steps
    with the move positions held out of the plan (and shown to the model as MASK); then one more
    forward pass at the finished board picks the move (``choose_moves``)."""
    held, move_view = hold_out_move(fixed)
    board = rollout(lambda x: logits_fn(show_move(x, move_view)), held, num_steps, schedule=schedule,
                    temperature=temperature, generator=generator).samples
    return finish_move(logits_fn, board, move_view)


def finish_move(logits_fn, board: torch.Tensor, move_view: torch.Tensor) -> torch.Tensor:
    """The "last" schedule's final pass: board long [B, L] (a finished board; its move positions
    are ignored) → the sample with the free move positions of ``move_view`` filled by
    ``choose_moves`` (no pass when none is free)."""
    x = show_move(board, move_view)
    if not bool((move_view == tokenizer.MASK_ID).any()):
        return x
    return choose_moves(logits_fn(x), x)


def themes_and_fixed(model: ChessDiffusionModel, requests: list, partial: torch.Tensor | None) -> Conditioning:
    """B theme requests (+ optional partial boards [B, L] or one [L] for all) → Conditioning
    {"themes": float [B, T], "fixed": long [B, L] (MASK_ID where free)}."""
    b = len(requests)
    if partial is None:
        fixed = torch.full((b, tokenizer.SEQ_LEN), tokenizer.MASK_ID, dtype=torch.long)
    else:
        fixed = partial.long().expand(b, tokenizer.SEQ_LEN) if partial.ndim == 1 else partial.long()
        if fixed.shape != (b, tokenizer.SEQ_LEN):
            raise ValueError(f"partial must be [{tokenizer.SEQ_LEN}] or [{b}, {tokenizer.SEQ_LEN}], got "
                             f"{tuple(partial.shape)}")
        allowed = tokenizer.allowed_token_mask()[torch.arange(tokenizer.SEQ_LEN), fixed.cpu()]
        if not bool((allowed | (fixed.cpu() == tokenizer.MASK_ID)).all()):
            raise ValueError("partial holds a token at a position that does not accept it (see tokenizer layout)")
    if not model.config.move_task:
        # Pre-trained without the best-move task: its move positions are never sampled, "-" = no move.
        if bool((fixed[:, tokenizer.BOARD_LEN:] != tokenizer.MASK_ID).any()):
            raise ValueError("this model was pre-trained without the best-move task (config.move_task false): "
                             "a partial board cannot fix its move positions")
        fixed = fixed.clone()
        fixed[:, tokenizer.BOARD_LEN:] = _ABSENT_ID
    return Conditioning({"themes": model.encode_themes(requests), "fixed": fixed.clone().to(model.device)})


class ChessAdapter(DenoiserAdapter):
    """A ``ChessPuzzlePipeline`` as the RL core sees it.

    It shares ``DenoiserAdapter``'s training half (``add_lora``, ``enable_full_finetune``,
    ``trainable``, ``reference``, ``trained_state_dict``, ``load_trained_state_dict``), which acts
    on ``self.model``; the image half (noise latents, VAE decoding, CFG on velocities) does not
    apply and is replaced here. Prompts are theme requests: space-separated theme keys of
    ``model.config.themes`` ("" = unconditional).
    """

    prediction = "logits"
    detach_uncond_supported = False  # guided_logits mixes log-softmaxes; train.detach_uncond is not wired in
    rollout_uncond_supported = False
    family = "chess"
    pipeline_class = ChessPuzzlePipeline
    model_folder = "model"
    lora_targets = LORA_TARGETS
    supports_xformers = False  # its blocks call torch's scaled_dot_product_attention directly
    supports_gradient_checkpointing = False
    move_schedules = MOVE_SCHEDULES  # what ``sampling.move_schedule`` may be for this family
    sequence_length = tokenizer.SEQ_LEN  # pipelines.base.Unmasking

    def __init__(self, pipe: ChessPuzzlePipeline, *, device: str | torch.device = "cpu"):
        # Not DenoiserAdapter.__init__: it reads image sizes off a VAE this family does not have.
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = torch.device(device)
        self.model: ChessDiffusionModel = pipe.model
        self.denoiser: nn.Module = self.model
        self.lora = False
        self._frozen_reference: nn.Module | None = None
        self.model.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        trained: str | Path | None = None, height: int | None = None, width: int | None = None,
                        **kwargs):
        """A built-in demo name ("chess-md"), a local pipeline folder or a hub id; ``trained``: a
        ``save_trained`` folder (LoRA fused in, or its ``model/`` replacing the model).
        ``height`` / ``width`` (what a trainer passes every family) must be None: a board has no size."""
        if height is not None or width is not None:
            raise ValueError(f"the chess family has no image size (model.height={height}, model.width={width}): "
                             "leave them unset")
        pipe = load_with_hub_fallback(ChessPuzzlePipeline.from_pretrained, name_or_path, dtype=torch_dtype(dtype))
        if trained is not None:
            load_trained_weights(pipe, trained, cls.model_folder, pipe.model.dtype)
        return cls(pipe, device=device, **kwargs)

    # -- conditioning and sampling ---------------------------------------------------------
    def encode(self, prompts: list[str], partial: torch.Tensor | None = None) -> Conditioning:
        """B theme requests (+ partial boards [B, L]) → {"themes": [B, T], "fixed": long [B, L]}."""
        return themes_and_fixed(self.model, prompts, partial)

    def latent_shape(self) -> tuple[int, ...]:
        return (tokenizer.SEQ_LEN,)

    def schedule(self, num_steps: int):
        raise NotImplementedError("masked diffusion has no noise schedule: sample with "
                                  "pipelines.unmasking.rollout (its plan is the schedule)")

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """The fully masked state long [B, L] (nothing is random: the generator is unused)."""
        return torch.full((batch, tokenizer.SEQ_LEN), tokenizer.MASK_ID, dtype=torch.long, device=self.device)

    @staticmethod
    def initial_state(cond: Conditioning) -> torch.Tensor:
        """The state a rollout starts from: long [B, L], the fixed tokens and MASK elsewhere."""
        return cond.tensors["fixed"].clone()

    @staticmethod
    def hold_out_move(cond: Conditioning) -> Conditioning:
        """``cond`` for the "last" move schedule: its fixed state with the free move positions out
        of the unmasking plan, and ``tensors["move_view"]`` long [B, 3], what ``predict`` shows
        the model there (``pipelines.chess.hold_out_move``). Rollout and rescoring both read it."""
        held, move_view = hold_out_move(cond.tensors["fixed"])
        return Conditioning({**cond.tensors, "fixed": held, "move_view": move_view})

    def finish_move(self, board: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0) -> torch.Tensor:
        """The "last" schedule's move at finished boards long [B, L] (``cond`` from
        ``hold_out_move``): the sample with the move filled in (``pipelines.chess.finish_move``).
        Not a sampled step: it has no log-prob, and RL does not train it."""
        return finish_move(lambda x: self.predict(x, None, cond, guidance_scale), board, cond.tensors["move_view"])

    def begin_unmasking(self, cond: Conditioning, sampling) -> Conditioning:
        """``pipelines.base.Unmasking``: under ``sampling.move_schedule`` "last" the move is held out."""
        return self.hold_out_move(cond) if sampling.move_schedule == "last" else cond

    def finish_unmasking(self, final: torch.Tensor, cond: Conditioning, sampling) -> torch.Tensor:
        """``pipelines.base.Unmasking``: under "last" the move is written into the finished boards
        (outside every step's unmask set, so no log-prob, ratio, KL or entropy reads it)."""
        return self.finish_move(final, cond, sampling.guidance_scale) if sampling.move_schedule == "last" else final

    def predict(self, x: torch.Tensor, t, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Logits float32 [B, L, V] (−inf = disallowed) at state x long [B, L]. ``t`` is unused:
        the model reads the mask ratio off x. Under the "last" move schedule (``cond`` holds
        "move_view") the model sees that view at the move positions, not the held-out "-"."""
        if "move_view" in cond.tensors:
            x = show_move(x, cond.tensors["move_view"])
        return guided_logits(self.denoiser if model is None else model, x, cond.tensors["themes"], guidance_scale)

    def decode(self, x0: torch.Tensor) -> list[str]:
        """Final states long [B, L] → B FEN strings. (The ``chess_puzzle`` reward also takes the
        token rows themselves, which adds its ``best_move`` component.)"""
        return [fen for fen, _ in decode_boards(x0)]

    def decode_moves(self, x0: torch.Tensor) -> list[str | None]:
        return [move for _, move in decode_boards(x0)]

    # -- training ----------------------------------------------------------------------------
    def enable_gradient_checkpointing(self) -> None:
        raise NotImplementedError("the chess model is small: gradient checkpointing is not implemented")

    def enable_xformers(self) -> None:
        raise NotImplementedError("the chess model uses torch's scaled_dot_product_attention; xformers does not apply")
