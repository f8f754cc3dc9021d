"""How well a chess model's best-move head names the solution of real puzzles it never saw.

    OMP_NUM_THREADS=1 python scripts/measure_chess_move_head.py --out docs/chess_move_head.json

For each held-out puzzle of ``<model>/split.json`` (the solver's position, the move positions
masked, conditioned on the puzzle's own themes that the model knows, or on none with
``--no-themes``), one forward pass scores every legal move by the sum of its three tokens'
log-probabilities (``pipelines.chess.choose_moves``, what the "last" move schedule does) and
reports, against Lichess's solution move ``Moves[1]``:

- ``top1``: the best-scoring legal move is the solution (the "last" schedule's choice);
- ``sampled``: a move drawn from the softmax of those scores (seeded) is the solution;
- ``chance``: the mean of 1 / number of legal moves (a uniformly random legal move);
- ``rank``: the mean rank of the solution among the legal moves (1 = best).

No engine: the solution is Lichess's. Generated boards (where the engine's first move is the
reference) are measured by ``scripts/measure_chess_model.py --move-schedule last``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowalign.chess.puzzles import DEFAULT_PUZZLES, read_puzzles
from pipelines import chess_tokenizer as tokenizer
from pipelines.base import resolve_model_path
from pipelines.chess import ChessPuzzlePipeline, legal_move_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chess-md")
    parser.add_argument("--data", default=str(DEFAULT_PUZZLES))
    parser.add_argument("--no-themes", action="store_true", help="condition on no theme instead of the puzzle's own")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="for the sampled move")
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    folder = Path(resolve_model_path(args.model))
    pipe = ChessPuzzlePipeline.from_pretrained(folder)
    model = pipe.model.eval()
    if not model.config.move_task:
        sys.exit(f"{folder}: pre-trained without the best-move task (config.move_task false): it has no move head")
    held = set(json.loads((folder / "split.json").read_text())["test_puzzle_ids"])
    puzzles = [p for p in read_puzzles(args.data) if p.puzzle_id in held]
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for lo in range(0, len(puzzles), args.batch):
        batch = puzzles[lo:lo + args.batch]
        x = torch.tensor([tokenizer.encode(p.solver_board().fen()) for p in batch])
        x[:, tokenizer.BOARD_LEN:] = tokenizer.MASK_ID
        requests = [[] if args.no_themes else [t for t in p.themes if t in model.config.themes] for p in batch]
        with torch.no_grad():
            log_pi = torch.log_softmax(model(x, model.encode_themes(requests))[:, tokenizer.BOARD_LEN:], -1)
        for i, p in enumerate(batch):
            moves = legal_move_tokens(x[i].tolist())
            target = tuple(tokenizer.encode(p.solver_board().fen(), p.moves[1])[tokenizer.BOARD_LEN:])
            cand = torch.tensor(moves)  # [M, 3]
            score = log_pi[i][torch.arange(3)[None], cand].sum(-1)  # [M]
            k = moves.index(target)
            drawn = int(torch.multinomial(torch.softmax(score, 0), 1, generator=g))
            rows.append({"top1": float(int(score.argmax()) == k), "sampled": float(drawn == k),
                         "chance": 1.0 / len(moves), "rank": 1 + int((score > score[k]).sum())})
    summary = {key: sum(r[key] for r in rows) / len(rows) for key in ("top1", "sampled", "chance", "rank")}
    result = {"model": str(folder), "puzzles": len(rows), "themes": not args.no_themes, **summary,
              "settings": vars(args), "minutes": (time.time() - start) / 60}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
