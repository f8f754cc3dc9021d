"""Pre-train the chess-puzzle masked-diffusion model on the shared Lichess puzzles.

    OMP_NUM_THREADS=1 python scripts/pretrain_chess.py --out pipelines/demo_models/chess-md   # ≈ 58 min on one core

Data (``../shared/data/SOURCES.md``): each row's puzzle is the position after the setup move
``Moves[0]`` (the solver to move), its best move ``Moves[1]``, its themes the ``Themes`` keys that
the model's theme list knows (``pipelines.chess_model.THEMES``). A seeded ``--test-fraction`` of
the puzzles is held out; from them ``--requests`` theme requests (1–2 of a held-out puzzle's
themes, phases excluded) are drawn for ``scripts/measure_chess_model.py``. Both go to
``<out>/split.json``.

Loss: per sample a mask ratio t ~ U(0, 1) (stratified over the batch), every position masked
independently with probability t (at least one), cross-entropy of the clean token at the masked
positions, averaged over all masked tokens of the batch. This is the plain (unweighted) loss,
not MD4's ELBO weighting 1/t: the 1/t weight puts most of the loss on nearly clean samples and
is much noisier at this batch size; both have the same minimiser (the true posteriors). Themes
are dropped for conditioning at random (each kept with probability ``--theme-keep``, all of them
dropped with probability ``--uncond``) so partial and empty requests are trained too.

``--init-from DIR`` continues from a saved model (its weights and architecture; ``--dim``,
``--layers``, ``--heads`` and ``--no-move-task`` are then taken from it) with a fresh warm-up and
cosine schedule over ``--steps``: a warm restart, not an exact resume, since the first run kept
no optimizer state. The split stays the one ``--seed`` draws; the batch and mask stream is seeded
with ``--data-seed`` so the continuation does not replay the first run's batches in order.

``--no-move-task`` is the ablation of the auxiliary best-move task (METHODS §4): the same run in
every other respect (seed, data, split, steps, schedule, the same random draws for the masks and
themes), but the move positions are always ``[MASK]`` in the model's input and never in the
loss. The saved model's config says ``move_task: false``, so the pipeline writes "-" there
instead of sampling a move (its ``best_move`` reward is NaN).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch

from pipelines import chess_tokenizer as tokenizer
from flowalign.chess.puzzles import DEFAULT_PUZZLES, Puzzle, read_puzzles
from pipelines.chess import ChessPuzzlePipeline
from pipelines.chess_model import THEMES, ChessDiffusionModel

PHASES = ("opening", "middlegame", "endgame")


def encode_puzzle(p: Puzzle) -> list[int]:
    """The solver's position (after ``Moves[0]``) and its best move ``Moves[1]`` as tokens [L]."""
    return tokenizer.encode(p.solver_board().fen(), p.moves[1])


def split_puzzles(puzzles: list[Puzzle], test_fraction: float, seed: int) -> tuple[list[Puzzle], list[Puzzle]]:
    order = sorted(puzzles, key=lambda p: p.puzzle_id)
    random.Random(seed).shuffle(order)
    n_test = round(len(order) * test_fraction)
    return order[n_test:], order[:n_test]


def heldout_requests(test: list[Puzzle], n: int, seed: int) -> list[list[str]]:
    """``n`` distinct requests, each 1 or 2 themes of one held-out puzzle (so frequent themes are
    requested more often, as the data asks for them); phases are never requested on their own."""
    rng, out = random.Random(seed), []
    for p in rng.sample(test, len(test)):
        themes = sorted(t for t in p.themes if t in THEMES and t not in PHASES)
        if not themes:
            continue
        request = sorted(rng.sample(themes, min(len(themes), rng.choice((1, 2)))))
        if request not in out:
            out.append(request)
        if len(out) == n:
            break
    return out


def theme_matrix(puzzles: list[Puzzle]) -> torch.Tensor:
    index = {t: i for i, t in enumerate(THEMES)}
    out = torch.zeros(len(puzzles), len(THEMES))
    for row, p in enumerate(puzzles):
        out[row, [index[t] for t in p.themes if t in index]] = 1.0
    return out


def mask_batch(tokens: torch.Tensor, generator: torch.Generator,
               move_task: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L] → (noisy tokens [B, L], trained bool [B, L]): ratio t stratified over the
    batch, each position masked with probability t, at least one trained position per sample.
    Without the move task the move positions are always masked and never trained; the random
    draws are the same either way (same count and shapes), so both arms mask the board alike."""
    b, length = tokens.shape
    t = (torch.rand((), generator=generator) + torch.arange(b) / b) % 1.0
    masked = torch.rand(b, length, generator=generator) < t[:, None]
    trainable = length if move_task else tokenizer.BOARD_LEN
    forced = torch.randint(trainable, (b,), generator=generator)
    trained = masked.clone()
    trained[:, trainable:] = False
    trained[torch.arange(b), forced] |= ~trained.any(1)  # at least one trained position per sample
    noisy = tokens.masked_fill(trained, tokenizer.MASK_ID)
    if not move_task:
        noisy[:, tokenizer.BOARD_LEN:] = tokenizer.MASK_ID
    return noisy, trained


def drop_themes(themes: torch.Tensor, keep: float, uncond: float, generator: torch.Generator) -> torch.Tensor:
    kept = themes * (torch.rand(themes.shape, generator=generator) < keep)
    return kept * (torch.rand(themes.shape[0], 1, generator=generator) >= uncond)


def masked_loss(model: ChessDiffusionModel, tokens: torch.Tensor, themes: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean CE over trained masked tokens, per-token CE [B, L], trained [B, L]); the model's
    ``config.move_task`` says whether the move positions are trained."""
    noisy, masked = mask_batch(tokens, generator, model.config.move_task)
    logits = model(noisy, themes)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
    ce = torch.where(masked, ce, torch.zeros_like(ce))
    return ce.sum() / masked.sum(), ce, masked


@torch.no_grad()
def heldout_loss(model: ChessDiffusionModel, tokens: torch.Tensor, themes: torch.Tensor, seed: int,
                 batch: int = 256) -> dict[str, float]:
    """Masked CE on the held-out puzzles (same masks every call), overall / board / best move
    (None without the move task: no move token is ever predicted)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    sums = Counter()
    for lo in range(0, len(tokens), batch):
        _, ce, masked = masked_loss(model, tokens[lo:lo + batch], themes[lo:lo + batch], g)
        for name, cols in (("all", slice(None)), ("board", slice(0, tokenizer.BOARD_LEN)),
                           ("move", slice(tokenizer.BOARD_LEN, None))):
            sums[name] += ce[:, cols].sum().item()
            sums[name + "_n"] += masked[:, cols].sum().item()
    model.train()
    return {name: sums[name] / sums[name + "_n"] if sums[name + "_n"] else None for name in ("all", "board", "move")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pipelines/demo_models/chess-md")
    parser.add_argument("--data", default=str(DEFAULT_PUZZLES))
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--theme-keep", type=float, default=0.5)
    parser.add_argument("--uncond", type=float, default=0.1)
    parser.add_argument("--test-fraction", type=float, default=0.02)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--init-from", default=None,
                        help="a saved chess model folder to continue from (warm restart; see the docstring)")
    parser.add_argument("--data-seed", type=int, default=None,
                        help="seed of the batch/mask stream (default: --seed); change it when continuing a run")
    parser.add_argument("--no-move-task", dest="move_task", action="store_false",
                        help="ablation: never show or train the best-move positions (see the docstring)")
    args = parser.parse_args()
    if args.init_from:  # before the data and the model load: a different split would leak the held-out set
        prior = json.loads((Path(args.init_from) / "split.json").read_text())
        if prior["seed"] != args.seed or prior["test_fraction"] != args.test_fraction:
            parser.error(f"--init-from {args.init_from}: its split (seed {prior['seed']}, test fraction "
                         f"{prior['test_fraction']}) differs from --seed/--test-fraction; the held-out set would leak")
        if json.loads((Path(args.init_from) / "model" / "config.json").read_text())["themes"] != list(THEMES):
            parser.error(f"--init-from {args.init_from}: its theme list differs from pipelines.chess_model.THEMES "
                         "(extending a model's themes is not supported)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    start = time.time()

    train, test = split_puzzles(read_puzzles(args.data), args.test_fraction, args.seed)
    requests = heldout_requests(test, args.requests, args.seed)
    x_train, x_test = (torch.tensor([encode_puzzle(p) for p in s]) for s in (train, test))
    th_train, th_test = theme_matrix(train), theme_matrix(test)
    print(f"{len(train)} train / {len(test)} held-out puzzles, data ready in {time.time() - start:.0f} s", flush=True)

    continued_from = None
    if args.init_from:
        model = ChessDiffusionModel.from_pretrained(Path(args.init_from) / "model").train()
        args.dim, args.layers, args.heads = model.config.dim, model.config.layers, model.config.heads
        args.move_task = model.config.move_task
        previous = Path(args.init_from) / "pretraining.json"
        if previous.exists():
            record = json.loads(previous.read_text())
            continued_from = {k: record.get(k) for k in ("out", "steps", "lr", "data_seed", "continued_from",
                                                           "final_heldout_loss")}
    else:
        model = ChessDiffusionModel(themes=THEMES, dim=args.dim, layers=args.layers, heads=args.heads,
                                    move_task=args.move_task).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def decay(s: int) -> float:  # linear warm-up, then cosine to 0.1
        return min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    g = torch.Generator().manual_seed(args.seed if args.data_seed is None else args.data_seed)
    history, recent = [], []
    pipe = ChessPuzzlePipeline(model)

    def evaluate_and_save(step: int) -> dict:
        held = heldout_loss(model, x_test, th_test, args.seed + 1)
        history.append({"step": step, "train_loss": sum(recent) / max(len(recent), 1), "heldout": held,
                        "minutes": (time.time() - start) / 60})
        print(json.dumps(history[-1]), flush=True)
        pipe.save_pretrained(out)
        return held

    for step in range(args.steps):
        idx = torch.randint(len(x_train), (args.batch,), generator=g)
        loss, _, _ = masked_loss(model, x_train[idx], drop_themes(th_train[idx], args.theme_keep, args.uncond, g), g)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = (recent + [loss.item()])[-100:]
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            evaluate_and_save(step + 1)
    held = evaluate_and_save(args.steps)

    (out / "split.json").write_text(json.dumps({
        "seed": args.seed, "test_fraction": args.test_fraction, "requests": requests,
        "test_puzzle_ids": [p.puzzle_id for p in test]}, indent=1))
    (out / "pretraining.json").write_text(json.dumps({
        **vars(args), "train_puzzles": len(train), "heldout_puzzles": len(test),
        "parameters": sum(p.numel() for p in model.parameters()),
        "continued_from": continued_from,
        "final_train_loss": history[-1]["train_loss"], "final_heldout_loss": held,
        "loss": "plain masked CE (token mean), mask ratio ~ U(0,1) stratified", "minutes": (time.time() - start) / 60,
        "cpu_minutes": time.process_time() / 60,  # what the run would take alone on its threads
        "history": history}, indent=1))
    print(f"saved {out} in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
