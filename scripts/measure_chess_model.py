"""Measure a chess masked-diffusion model on its held-out theme requests: the RL baseline.

    OMP_NUM_THREADS=1 python scripts/measure_chess_model.py --out pipelines/demo_models/chess-md/baseline.json

For each request in ``<model>/split.json`` (written by ``scripts/pretrain_chess.py``), sample
``--per-request`` boards (seeded: request k of R uses seed ``--seed``·R + k, so different
``--seed`` values draw disjoint random streams) and report, per request and over all of them:

- ``legal``: fraction passing ``reward_models.chess.legality``; ``move_legal``: fraction whose own
  best-move tokens are a legal move of their (legal) board (the auxiliary task's sanity);
- with the ``chess_puzzle`` reward (Stockfish; skipped with ``--no-engine`` or when no engine is
  installed): ``unique``, ``theme_match``, ``theme_score``, ``yield`` (legal ∧ unique ∧
  theme-matching), ``partial_yield`` (unique × theme_score) and ``best_move`` (the sample's own
  move tokens name the engine's first move), each the mean over samples (NaN = engine failure,
  left out and counted in ``engine_failed``); ``best_move_on_legal``: ``best_move`` over the legal
  boards only, with ``move_chance`` beside it, the rate a uniformly random legal move would
  reach on the same boards (mean of 1 / number of legal moves; 0 on a mate or stalemate);
  ``legal_count`` the number of those boards; the same on the unique boards (``best_move_on_unique``,
  ``move_chance_on_unique``, ``unique_count``), where the engine's first move is the puzzle's solution. A model pre-trained without the move task
  writes no move: its ``best_move`` is None (all NaN);
- diversity: ``distinct`` (distinct boards / samples, board = the first four FEN fields) and
  ``board_distance`` (mean over pairs of samples of one request of the fraction of the 64
  squares that differ).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import chess
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowalign.chess.diversity import board_diversity as diversity
from pipelines.base import resolve_model_path
from pipelines.chess import ChessPuzzlePipeline
from pipelines.denoiser import load_trained_weights
from reward_models.chess.legality import is_legal

REWARD_KEYS = ("unique", "theme_match", "theme_score", "yield", "partial_yield", "best_move")


def move_is_legal(fen: str, move: str | None) -> bool:
    if move is None or not is_legal(fen):
        return False
    try:
        return chess.Move.from_uci(move) in chess.Board(fen).legal_moves
    except chess.InvalidMoveError:  # e.g. a null move "e8e8" decoded from the move tokens
        return False


def chance_of_move(fen: str) -> float | None:
    """1 / number of legal moves of a legal board (0 when there is none); None for an illegal one."""
    if not is_legal(fen):
        return None
    n = chess.Board(fen).legal_moves.count()
    return 1.0 / n if n else 0.0


def nanmean(values: list[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else None


def summarise(rows: list[dict], tokens: torch.Tensor) -> dict:
    legal = [r for r in rows if r["legal"]]
    out = {"samples": len(rows), **{k: nanmean([r[k] for r in rows]) for k in ("legal", "move_legal")},
           "legal_count": len(legal), **diversity(tokens)}
    if "unique" in rows[0]:
        out.update({k: nanmean([r[k] for r in rows]) for k in REWARD_KEYS})
        out["engine_failed"] = sum(math.isnan(r["unique"]) for r in rows)
        out["best_move_on_legal"] = nanmean([r["best_move"] for r in legal])
        out["move_chance"] = nanmean([r["move_chance"] for r in legal])
        unique = [r for r in legal if r["unique"] == 1.0]
        out["unique_count"] = len(unique)
        out["best_move_on_unique"] = nanmean([r["best_move"] for r in unique])
        out["move_chance_on_unique"] = nanmean([r["move_chance"] for r in unique])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chess-md")
    parser.add_argument("--trained", default=None,
                        help="a run's final/ (or a checkpoint's policy/) to measure instead of the pre-trained model")
    parser.add_argument("--out", default=None, help="JSON file (default: <model>/baseline.json)")
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--schedule", default="cosine")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--move-schedule", default="joint", choices=("joint", "last"),
                        help="when the best move is unmasked (pipelines/chess.py): with the board, or after it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-engine", action="store_true", help="legality and diversity only")
    parser.add_argument("--nodes", type=int, default=100_000, help="Stockfish nodes per search (the reward's default)")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.trained and not args.out:
        parser.error("--trained needs --out (the default is the pre-trained model's baseline.json)")
    torch.set_num_threads(args.threads)
    start = time.time()
    folder = Path(resolve_model_path(args.model))
    requests = json.loads((folder / "split.json").read_text())["requests"]
    pipe = ChessPuzzlePipeline.from_pretrained(folder)
    if args.trained:
        load_trained_weights(pipe, args.trained, "model", pipe.model.dtype)
    pipe.set_progress_bar_config(disable=True)

    reward = None
    if not args.no_engine:
        from reward_models.chess.engine import find_stockfish
        from reward_models.chess.reward import ChessPuzzleReward

        if find_stockfish() is None:
            print("no Stockfish found: measuring legality and diversity only", flush=True)
        else:
            reward = ChessPuzzleReward(engines=args.engines, nodes=args.nodes)

    per_request, all_rows, all_tokens = [], [], []
    for k, request in enumerate(requests):
        out = pipe([request] * args.per_request, num_steps=args.num_steps, schedule=args.schedule,
                   temperature=args.temperature, guidance_scale=args.guidance_scale, move_schedule=args.move_schedule,
                   generator=torch.Generator().manual_seed(args.seed * len(requests) + k))
        rows = [{"legal": float(is_legal(fen)), "move_legal": float(move_is_legal(fen, move)),
                 "move_chance": chance_of_move(fen)} for fen, move in zip(out.fens, out.moves)]
        if reward is not None:
            scores = reward(out.tokens, [" ".join(request)] * len(rows), [{"themes": request}] * len(rows))
            for i, row in enumerate(rows):
                row.update({key: float(scores[key][i]) for key in REWARD_KEYS})
        per_request.append({"request": request, **summarise(rows, out.tokens), "examples": out.fens[:3]})
        all_rows += rows
        all_tokens.append(out.tokens)
        print(json.dumps({key: v for key, v in per_request[-1].items() if key != "examples"}), flush=True)
    if reward is not None:
        reward.close()

    overall = summarise(all_rows, torch.cat(all_tokens))
    overall["distinct"] = sum(r["distinct"] for r in per_request) / len(per_request)  # within a request
    overall["board_distance"] = sum(r["board_distance"] for r in per_request) / len(per_request)
    result = {"model": str(folder), "requests": len(requests), "settings": vars(args), "overall": overall,
              "engine": reward is not None, "minutes": (time.time() - start) / 60, "per_request": per_request}
    out_path = Path(args.out) if args.out else folder / "baseline.json"
    out_path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"overall": overall, "minutes": result["minutes"]}, indent=1))


if __name__ == "__main__":
    main()
