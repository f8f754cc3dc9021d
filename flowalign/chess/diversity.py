"""Diversity of generated boards (METHODS §4: "diversity (distinct boards)"; a policy that
collapses to one template drives both numbers down).

- ``distinct``: distinct boards / samples, a board being the first ``BOARD_LEN`` tokens (the
  first four FEN fields: placement, side to move, castling, en passant; the best move is not
  part of it);
- ``board_distance``: mean over pairs of samples of the fraction of the 64 squares that differ.

Both are computed within one request's samples and averaged over requests, as
``scripts/measure_chess_model.py`` (and ``baseline.json``) report them.
"""

from __future__ import annotations

import itertools

import torch

from pipelines import chess_tokenizer as tokenizer


def board_diversity(tokens: torch.Tensor) -> dict[str, float]:
    """tokens long [N, L] (one request's samples) → {"distinct", "board_distance"}."""
    boards = {tuple(row[:tokenizer.BOARD_LEN]) for row in tokens.tolist()}
    squares = tokens[:, tokenizer.SQUARES]
    pairs = list(itertools.combinations(range(len(tokens)), 2))
    distance = sum((squares[i] != squares[j]).float().mean().item() for i, j in pairs) / max(len(pairs), 1)
    return {"distinct": len(boards) / len(tokens), "board_distance": distance}


def grouped_board_diversity(tokens: torch.Tensor, group_size: int) -> dict[str, float]:
    """tokens long [G·group_size, L], consecutive ``group_size`` rows per request → the mean over
    requests of ``board_diversity``."""
    if len(tokens) % group_size:
        raise ValueError(f"{len(tokens)} samples are not whole groups of {group_size}")
    parts = [board_diversity(tokens[lo:lo + group_size]) for lo in range(0, len(tokens), group_size)]
    return {key: sum(p[key] for p in parts) / len(parts) for key in ("distinct", "board_distance")}
