"""The denoiser of the chess-puzzle world: a small bidirectional transformer over board tokens.

Input: token ids [B, L] (L = ``tokenizer.SEQ_LEN`` = 73: 64 squares, side to move, castling,
en passant, then the best move as from-square, to-square, promotion), some of them ``MASK_ID``;
a multi-hot theme vector [B, T] over ``config.themes``. Output: logits [B, L, V] (V =
``tokenizer.VOCAB_SIZE``) for the clean token at every position, −inf where the position does not
accept the token (``tokenizer.allowed_token_mask``), so neither sampling nor the loss can put a
piece on the promotion slot or a MASK anywhere. The best-move positions are predicted jointly
with the board (the auxiliary task of METHODS §4).

Conditioning enters as one extra token in front of the sequence, the sum of

* a linear embedding of the theme vector (an all-zero vector is "no theme request": pre-training
  drops themes at random so that unconditional and partial requests are in distribution);
* an embedding of the mask ratio (masked positions / L, read off the input by default), the
  discrete-diffusion analogue of the time embedding.

Attention projections are plain ``nn.Linear`` layers named ``to_q``, ``to_k``, ``to_v``,
``to_out`` (and the MLP ``ff_in``, ``ff_out``) so peft can put a LoRA on them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from pipelines import chess_tokenizer as tokenizer

# The themes the chess_puzzle reward's tagger could produce when the demo model was trained (a
# subset of reward_models.chess.themes.SUPPORTED_THEMES now; a test checks it stays one). A
# model stores its own list in its config, so a later change here does not shift a saved model's
# multi-hot layout.
THEMES: tuple[str, ...] = (
    "oneMove", "short", "long", "veryLong", "mate", "mateIn1", "mateIn2", "mateIn3", "mateIn4", "mateIn5",
    "backRankMate", "smotheredMate", "arabianMate", "hookMate", "dovetailMate", "doubleBishopMate", "fork",
    "pin", "skewer", "discoveredAttack", "discoveredCheck", "doubleCheck", "hangingPiece", "promotion",
    "underPromotion", "enPassant", "castling", "advancedPawn", "attackingF2F7", "kingsideAttack",
    "queensideAttack", "sacrifice", "opening", "middlegame", "endgame", "pawnEndgame", "rookEndgame",
    "bishopEndgame", "knightEndgame", "queenEndgame", "queenRookEndgame")


def sinusoidal_embedding(value: torch.Tensor, dim: int) -> torch.Tensor:
    """value float [B] in [0, 1] → [B, dim] (sin/cos at geometric frequencies, scaled by 1000)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=value.device, dtype=torch.float32) / half)
    angles = 1000.0 * value.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block, bidirectional (no attention mask)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.ff_in, self.ff_out = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [B, N, D] → [B, N, D]."""
        b, n, d = h.shape
        x = self.norm1(h)
        q, k, v = (proj(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        h = h + self.to_out(attn)
        return h + self.ff_out(F.gelu(self.ff_in(self.norm2(h))))


class ChessDiffusionModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Masked-diffusion denoiser of chess puzzles (see the module docstring).

    Config: ``themes`` the conditioning vocabulary (order = multi-hot layout); ``dim``, ``layers``,
    ``heads``, ``mlp_ratio`` the transformer's size. ``seq_len`` and ``vocab_size`` are the
    tokenizer's and checked against it at construction. ``move_task`` False marks a model
    pre-trained without the auxiliary best-move task (``scripts/pretrain_chess.py
    --no-move-task``, the ablation): it always sees ``[MASK]`` at the three move positions,
    whatever it is given, and the pipeline writes "-" there instead of sampling them.
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, themes: tuple[str, ...] | list[str] = THEMES, dim: int = 128, layers: int = 4,
                 heads: int = 4, mlp_ratio: int = 4, seq_len: int = tokenizer.SEQ_LEN,
                 vocab_size: int = tokenizer.VOCAB_SIZE, move_task: bool = True):
        super().__init__()
        if (seq_len, vocab_size) != (tokenizer.SEQ_LEN, tokenizer.VOCAB_SIZE):
            raise ValueError(f"model built for seq_len={seq_len}, vocab_size={vocab_size}; the tokenizer has "
                             f"{tokenizer.SEQ_LEN}, {tokenizer.VOCAB_SIZE}: retrain the model for this tokenizer")
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.randn(seq_len + 1, dim) * 0.02)  # + the conditioning token
        self.theme_embed = nn.Linear(len(themes), dim)  # its bias alone is the "no theme" embedding
        self.ratio_embed = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.register_buffer("allowed", tokenizer.allowed_token_mask(), persistent=False)

    def forward(self, tokens: torch.Tensor, themes: torch.Tensor,
                mask_ratio: torch.Tensor | None = None) -> torch.Tensor:
        """tokens long [B, L]; themes float [B, T] multi-hot; mask_ratio float [B] (default: the
        fraction of ``MASK_ID`` in ``tokens``). Returns logits float32 [B, L, V], −inf where
        ``allowed_token_mask`` is False."""
        if tokens.shape[1:] != (self.config.seq_len,):
            raise ValueError(f"tokens must be [B, {self.config.seq_len}], got {tuple(tokens.shape)}")
        if themes.shape != (tokens.shape[0], len(self.config.themes)):
            raise ValueError(f"themes must be [B, {len(self.config.themes)}] multi-hot over config.themes, "
                             f"got {tuple(themes.shape)}")
        if not self.config.move_task:
            # Trained with the move always masked: showing it one now would be out of distribution.
            tokens = tokens.clone()
            tokens[:, tokenizer.BOARD_LEN:] = tokenizer.MASK_ID
        if mask_ratio is None:
            mask_ratio = (tokens == tokenizer.MASK_ID).float().mean(1)
        dim = self.config.dim
        cond = self.theme_embed(themes.to(self.dtype)) + self.ratio_embed(
            sinusoidal_embedding(mask_ratio, dim).to(self.dtype))
        h = torch.cat([cond[:, None], self.token_embed(tokens)], dim=1) + self.pos_embed
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h[:, 1:])).float()
        return logits.masked_fill(~self.allowed, float("-inf"))

    def encode_themes(self, requests: list[list[str] | tuple[str, ...] | str]) -> torch.Tensor:
        """B theme requests (lists of keys, or space-separated strings; empty = unconditional) →
        float [B, T] multi-hot over ``config.themes``. An unknown theme is an error."""
        index = {t: i for i, t in enumerate(self.config.themes)}
        out = torch.zeros(len(requests), len(index), device=self.device)
        for row, request in enumerate(requests):
            keys = request.split() if isinstance(request, str) else list(request)
            unknown = sorted(set(keys) - set(index))
            if unknown:
                raise ValueError(f"unknown theme(s) {unknown}; this model knows: {', '.join(self.config.themes)}")
            out[row, [index[k] for k in keys]] = 1.0
        return out
