"""A grid of generated chess puzzles, base model beside a trained one, for docs/chess.md.

    OMP_NUM_THREADS=1 python scripts/chess_puzzle_grid.py --trained runs/chess-ddpo-nt/final \\
        --out docs/img/chess_puzzles.png

Selection rule (fixed before any output was looked at; no cherry-picking):
- the draw ``--seed`` (default 40, a draw no measurement in docs/chess.md uses), in the sense of
  ``scripts/measure_chess_model.py``: request k of the R requests in ``<model>/split.json`` is
  sampled as one batch of ``--per-request`` (16) boards with the generator seed ``seed``·R + k,
  at that script's default settings (16 steps, cosine schedule, temperature 1, guidance 1, the
  joint move schedule), the same draw for both models;
- the first ``--requests`` (8) held-out requests of split.json, one row each;
- per request and model, the first ``--take`` (2) samples in batch order that are legal boards;
  when fewer are legal, the first illegal samples fill the row (drawn as illegal);
- the cells are judged by the ``chess_puzzle`` reward (Stockfish, ``--nodes`` 100,000 per search,
  its default): the engine's solution, the themes the tagger finds, legal / unique / theme match
  / yield. A yield cell has a green frame.
Each row: base sample 1, base sample 2, trained sample 1, trained sample 2. Without --trained
only the base columns are drawn; with --no-engine the cells show legality only (no solution).

``--yield-only``: what a puzzle that counts looks like. One model (the trained one, else the
base), every held-out request, drawn as above with ``--per-request`` boards (64, as the
measurements); every legal board is judged and the first ``--take`` (1) yield boards of each
request in batch order are drawn, four to a row; a request with none is named in the JSON.

    OMP_NUM_THREADS=1 python scripts/chess_puzzle_grid.py --trained runs/chess-ddpo-nt/final \
        --yield-only --per-request 64 --take 1 --out docs/img/chess_yield_puzzles.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowalign.chess.render import is_yield, save_puzzle_grid
from flowalign.chess.sampling import GeneratedPuzzle, judge
from pipelines.base import resolve_model_path
from pipelines.chess import ChessPuzzlePipeline
from pipelines.denoiser import load_trained_weights
from reward_models.chess.legality import is_legal


def held_out_requests(model: str) -> list[list[str]]:
    """The held-out requests of the model's split.json, in its order (as measure_chess_model.py reads them)."""
    return json.loads((Path(resolve_model_path(model)) / "split.json").read_text())["requests"]


def draw_batch(pipe, requests: list[list[str]], k: int, seed: int, per_request: int, num_steps: int = 16):
    """Request k's batch of draw ``seed``: ``per_request`` boards with the generator seed
    seed·len(requests) + k at measure_chess_model.py's default settings → the pipeline's output."""
    return pipe([requests[k]] * per_request, num_steps=num_steps, schedule="cosine", temperature=1.0,
                guidance_scale=1.0, move_schedule="joint",
                generator=torch.Generator().manual_seed(seed * len(requests) + k))


def pick(pipe, requests: list[list[str]], rows: int, seed: int, per_request: int, take: int,
         num_steps: int = 16) -> list[list[GeneratedPuzzle]]:
    """The selection rule (module docstring) for one model: for each of the first ``rows``
    requests, ``take`` unjudged puzzles (the first legal samples of the seeded batch, then the
    first illegal ones if too few are legal). ``GeneratedPuzzle.seed`` is the sample's index in
    its batch."""
    out = []
    for k, request in enumerate(requests[:rows]):
        batch = draw_batch(pipe, requests, k, seed, per_request, num_steps)
        legal = [i for i, fen in enumerate(batch.fens) if is_legal(fen)]
        chosen = (legal + [i for i in range(per_request) if i not in legal])[:take]
        out.append([GeneratedPuzzle(i, tuple(request), batch.fens[i], batch.moves[i]) for i in chosen])
    return out


def first_yields(pipe, requests: list[list[str]], seed: int, per_request: int, take: int, reward,
                 num_steps: int = 16) -> dict:
    """``--yield-only``'s rule for one model: per request (all of them), the batch of
    ``per_request`` drawn as ``pick`` draws it, its legal boards judged by ``reward``, the first
    ``take`` yield puzzles → {"puzzles": [GeneratedPuzzle], "rows": [(request index, batch index)],
    "legal": [count per request], "yield": [count per request]}."""
    out = {"puzzles": [], "rows": [], "legal": [], "yield": []}
    for k, request in enumerate(requests):
        batch = draw_batch(pipe, requests, k, seed, per_request, num_steps)
        legal = [GeneratedPuzzle(i, tuple(request), fen, batch.moves[i])
                 for i, fen in enumerate(batch.fens) if is_legal(fen)]
        judged = [p for p in judge(legal, reward) if is_yield(p)]
        out["legal"].append(len(legal))
        out["yield"].append(len(judged))
        out["puzzles"] += judged[:take]
        out["rows"] += [(k, p.seed) for p in judged[:take]]
    return out


def build_yield_only(model: str, trained: str | None, out: str | Path, *, seed: int, per_request: int, take: int,
                     reward, num_steps: int = 16, name: str = "trained") -> dict:
    """Draw ``first_yields`` of one model (``trained`` if given, else the base) at ``out``."""
    requests = held_out_requests(model)
    found = first_yields(load_pipe(model, trained), requests, seed, per_request, take, reward, num_steps)
    if not found["puzzles"]:
        raise SystemExit(f"no yield puzzle in {per_request} samples of any request (seed {seed}): nothing to draw")
    labels = [f"{name if trained else 'base'}, request {k}, sample {i}" for k, i in found["rows"]]
    save_puzzle_grid(found["puzzles"], out, columns=4, labels=labels)
    return {"out": str(out), "seed": seed, "per_request": per_request, "take": take, "model": trained or model,
            "legal_per_request": found["legal"], "yield_per_request": found["yield"],
            "requests_without_yield": [requests[k] for k, n in enumerate(found["yield"]) if n == 0],
            "cells": [{"request": list(p.requested), "sample": p.seed, "fen": p.fen, "solution": p.solution,
                       "themes": sorted(p.themes)} for p in found["puzzles"]]}


def load_pipe(model: str, trained: str | None) -> ChessPuzzlePipeline:
    pipe = ChessPuzzlePipeline.from_pretrained(resolve_model_path(model))
    if trained:
        load_trained_weights(pipe, trained, "model", pipe.model.dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build(model: str, trained: str | None, out: str | Path, *, seed: int = 40, rows: int = 8, per_request: int = 16,
          take: int = 2, num_steps: int = 16, reward=None, names: tuple[str, str] = ("base", "trained")) -> dict:
    """Pick, judge (``reward``: a ``ChessPuzzleReward``, or None for legality only) and draw the
    grid at ``out``; returns a summary (the cells' FENs and verdicts, yield counts per model)."""
    requests = held_out_requests(model)
    if rows > len(requests):
        raise ValueError(f"--requests {rows}: split.json has only {len(requests)} held-out requests")
    arms = {names[0]: None} | ({names[1]: trained} if trained else {})
    picked = {name: pick(load_pipe(model, weights), requests, rows, seed, per_request, take, num_steps)
              for name, weights in arms.items()}
    for cells in picked.values():
        judge([p for row in cells for p in row], reward)
    puzzles, labels = [], []
    for r in range(rows):
        for name, cells in picked.items():
            puzzles += cells[r]
            labels += [f"{name}, request {r}, sample {p.seed}" for p in cells[r]]
    columns = take * len(arms)
    column_labels = [f"{name} ({k + 1}{'st' if k == 0 else 'nd' if k == 1 else 'th'} legal)"
                     for name in arms for k in range(take)]
    save_puzzle_grid(puzzles, out, columns=columns, labels=labels, column_labels=column_labels)
    return {"out": str(out), "seed": seed, "rows": rows, "per_request": per_request, "take": take,
            "engine": reward is not None,
            "yield_cells": {name: sum(is_yield(p) for row in cells for p in row) for name, cells in picked.items()},
            "legal_cells": {name: sum(p.legal for row in cells for p in row) for name, cells in picked.items()},
            "cells": {name: [[{"sample": p.seed, "request": list(p.requested), "fen": p.fen, "legal": p.legal,
                               "unique": p.unique, "solution": p.solution, "themes": sorted(p.themes),
                               "yield": is_yield(p)} for p in row] for row in cells]
                      for name, cells in picked.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chess-md", help="the pre-trained model (its split.json: the requests)")
    parser.add_argument("--trained", default=None, help="a run's final/ (or a checkpoint's policy/)")
    parser.add_argument("--name", default="DDPO", help="the trained model's column title")
    parser.add_argument("--out", default="docs/img/chess_puzzles.png")
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--requests", type=int, default=8, help="rows: the first N held-out requests")
    parser.add_argument("--per-request", type=int, default=16, help="the batch each request is drawn as")
    parser.add_argument("--take", type=int, default=2, help="cells per request and model")
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=100_000, help="Stockfish nodes per search")
    parser.add_argument("--no-engine", action="store_true", help="legality only: no solution, themes or uniqueness")
    parser.add_argument("--yield-only", action="store_true",
                        help="one model, every request: the first --take yield puzzles of --per-request samples")
    args = parser.parse_args()
    if args.yield_only and args.no_engine:
        parser.error("--yield-only needs the engine (yield is legal ∧ unique ∧ theme match)")
    if args.trained and not Path(args.trained).exists():
        parser.error(f"--trained: {args.trained} does not exist")
    torch.set_num_threads(1)
    start = time.time()
    reward = None
    if not args.no_engine:
        from reward_models.chess.reward import ChessPuzzleReward

        reward = ChessPuzzleReward(nodes=args.nodes)
    try:
        if args.yield_only:
            summary = build_yield_only(args.model, args.trained, args.out, seed=args.seed, per_request=args.per_request,
                                       take=args.take, reward=reward, num_steps=args.num_steps, name=args.name)
        else:
            summary = build(args.model, args.trained, args.out, seed=args.seed, rows=args.requests,
                            per_request=args.per_request, take=args.take, num_steps=args.num_steps, reward=reward,
                            names=("base", args.name))
    finally:
        if reward is not None:
            reward.close()
    summary["minutes"] = (time.time() - start) / 60
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("cells",)}))


if __name__ == "__main__":
    main()
