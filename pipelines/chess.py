"""The chess-puzzle family: a masked-diffusion pipeline of boards and its RL adapter.

State x: long [B, L] board tokens of ``pipelines.chess_tokenizer`` (L = 73; ``MASK_ID`` where
not yet generated). ``ChessPuzzlePipeline`` generates boards + best moves from theme requests,
optionally around a partial board (fixed tokens kept: inpainting). ``ChessAdapter`` is the same
model as the RL core sees it: ``prediction = "logits"``, so a trainer samples it with
``pipelines.unmasking.rollout`` and trains it with ``objectives.masked_ddpo``.

Classifier-free guidance (``guidance_scale`` g > 1) mixes log-probabilities, per position over
its allowed tokens: log π_u + g·(log π_c − log π_u), with the unconditional branch the empty theme
request on the same board (pre-training drops the themes at random, so that branch is trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

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
                 guidance_scale: float = 1.0, generator: torch.Generator | None = None,
                 return_dict: bool = True):
        """themes: B requests (space-separated keys or lists; "" = unconditional; one string = one
        sample); partial: long [B, L] or [L] (``partial_tokens``; MASK where free), its tokens
        kept as given. Schedule and temperature as in ``pipelines.unmasking``; the
        default 16 steps unmask ~4.6 positions per step on average."""
        themes = [themes] if isinstance(themes, str) else list(themes)  # one request, not its characters
        cond = themes_and_fixed(self.model, themes, partial)
        traj = rollout(lambda x: guided_logits(self.model, x, cond.tensors["themes"], guidance_scale),
                       cond.tensors["fixed"], num_steps, schedule=schedule, temperature=temperature,
                       generator=generator)
        fens, moves = zip(*decode_boards(traj.samples)) if len(themes) else ((), ())
        out = ChessPuzzlePipelineOutput(list(fens), list(moves), traj.samples)
        return out if return_dict else (out.fens, out.moves, out.tokens)


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
    family = "chess"
    pipeline_class = ChessPuzzlePipeline
    model_folder = "model"
    lora_targets = LORA_TARGETS
    supports_xformers = False  # its blocks call torch's scaled_dot_product_attention directly
    supports_gradient_checkpointing = False

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

    def predict(self, x: torch.Tensor, t, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Logits float32 [B, L, V] (−inf = disallowed) at state x long [B, L]. ``t`` is unused:
        the model reads the mask ratio off x."""
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
