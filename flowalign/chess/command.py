"""``flowalign sample`` for the chess family: its options (an argument group of their own in
``flowalign sample --help``) and the command that writes puzzles with their solutions. Imports
nothing heavy at the top: the CLI reads the options before torch loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign import arguments as A

FAMILY = "chess"
OPTIONS = ("partial_fen", "grid", "boards")  # refused for other families when given


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chess family (--model chess-md)", "the prompt is a theme request (\"fork short\"), one "
                             "puzzle per seed; --out puzzles.pgn / .csv gets each board with Stockfish's solution")
    g.add_argument("--partial-fen", default=None, metavar="FEN",
                   help="a board whose --fixed squares every puzzle keeps (the rest is generated)")
    g.add_argument("--fixed", default="pieces",
                   help="what of --partial-fen to keep, a comma list of 'pieces' (its occupied squares), square names, "
                        "'turn', 'castling', 'ep' or 'all' (default: pieces)")
    g.add_argument("--nodes", type=A.integer(1), default=100_000, help="Stockfish nodes per search")
    g.add_argument("--move-schedule", default="joint", choices=("joint", "last"),
                   help="unmask the model's own best move with the board (joint) or after it, as the most probable "
                        "legal move (last; docs/chess.md)")
    g.add_argument("--no-engine", action="store_true", help="boards only (legality, no solution)")
    g.add_argument("--boards", default=None, metavar="DIR", help="also write an SVG diagram per legal puzzle")
    g.add_argument("--grid", default=None, metavar="PNG",
                   help="also draw every puzzle (board, solution, themes asked and found, verdicts) into one PNG, "
                        "four to a row")


def refuse_options(args, model: str, family: str) -> None:
    """ConfigError when a chess-only option is given for a model of another family."""
    from flowalign.config import ConfigError

    for name in OPTIONS:
        if getattr(args, name) is not None:
            raise ConfigError(f"--{name.replace('_', '-')} is for the chess family; model {model!r} is of family "
                              f"{family!r}")


def sample(args, model: str, loading: dict, seeds: list[int]) -> int:
    """Chess puzzles for the theme request ``args.prompt`` around ``--partial-fen``, judged by
    Stockfish (unless --no-engine), written as PGN or CSV (+ SVG diagrams with --boards, one PNG of them all with --grid)."""
    from flowalign.chess import sampling
    from flowalign.config import ConfigError
    from pipelines.chess import ChessAdapter

    out = Path(args.out)
    if out.suffix not in (".pgn", ".csv"):
        raise ConfigError(f"chess: --out must end in .pgn or .csv (puzzles with their solutions), got {args.out!r}")
    if args.grid and not args.grid.endswith(".png"):
        raise ConfigError(f"chess: --grid must end in .png, got {args.grid!r}")
    reward = None
    if not args.no_engine:
        from reward_models.chess.reward import ChessPuzzleReward, _requested_themes

        _requested_themes({"themes": args.prompt})  # an unknown theme fails here, before the model loads
        reward = ChessPuzzleReward(nodes=args.nodes)
    adapter = ChessAdapter.from_pretrained(model, dtype=loading["dtype"], trained=args.weights)
    steps = args.steps if args.steps is not None else 16
    try:
        puzzles = sampling.generate(adapter.pipe, args.prompt, seeds, partial_fen=args.partial_fen, fixed=args.fixed,
                                    num_steps=steps, guidance_scale=args.guidance, reward=reward,
                                    move_schedule=args.move_schedule)
    finally:
        if reward is not None:
            reward.close()
    (sampling.write_pgn if out.suffix == ".pgn" else sampling.write_csv)(puzzles, out)
    print(sampling.summary(puzzles))
    print(f"wrote {out}")
    if args.boards:
        print(f"wrote {len(sampling.write_boards(puzzles, args.boards))} diagrams to {args.boards}")
    if args.grid:
        from flowalign.chess.render import save_puzzle_grid

        print(f"wrote {save_puzzle_grid(puzzles, args.grid)}")
    return 0
