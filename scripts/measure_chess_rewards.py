"""Measure the chess theme tagger and the uniqueness checker against Lichess's own puzzle labels.

    python scripts/measure_chess_rewards.py --out docs/chess_rewards.json

Tagger: on a seeded sample of puzzles (default 2,000, seed 0), tag each solution (the position
after the setup move, the solver's line) and compare with Lichess's themes: precision, recall
and support per supported theme. The rules were tuned on a different seeded sample that
excludes these puzzles (seed 12345, ``--tagger-puzzles 2000 --tagger-seed 0`` excluded).

Uniqueness: on another seeded sample (seed 1), in order, until ``--unique-puzzles`` or
``--unique-seconds`` run out: ``check_line`` on Lichess's solution (is every solver move the
engine's unique best?) and ``check_position`` (the reward's view: no solution given). Lichess
puzzles are unique by construction (deeper searches than ours), so the fraction we call unique
is an agreement rate; the failure kinds say why the rest disagree.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowalign.chess.puzzles import DEFAULT_PUZZLES, Puzzle, read_puzzles, sample_puzzles  # noqa: E402
from reward_models.chess.engine import SearchLimit, StockfishPool  # noqa: E402
from reward_models.chess.themes import SUPPORTED_THEMES, tag_themes  # noqa: E402
from reward_models.chess.uniqueness import check_line, check_position  # noqa: E402


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def measure_tagger(puzzles: list[Puzzle]) -> dict:
    """Per supported theme: support (Lichess positives), tagged, tp, precision, recall."""
    counts = {t: collections.Counter() for t in SUPPORTED_THEMES}
    for p in puzzles:
        tags = tag_themes(p.solver_board(), p.solution)
        for theme, c in counts.items():
            ours, theirs = theme in tags, theme in p.themes
            c["tp"] += ours and theirs
            c["tagged"] += ours
            c["support"] += theirs
    return {t: {"support": c["support"], "tagged": c["tagged"], "tp": c["tp"],
                "precision": _ratio(c["tp"], c["tagged"]), "recall": _ratio(c["tp"], c["support"])}
            for t, c in counts.items()}


def measure_uniqueness(puzzles: list[Puzzle], pool: StockfishPool, max_puzzles: int, seconds: float,
                       max_solver_moves: int) -> dict:
    """Agreement of ``check_line`` / ``check_position`` with Lichess's (unique) puzzles."""
    rows, start = [], time.perf_counter()
    for p in puzzles[:max_puzzles]:
        if time.perf_counter() - start > seconds:
            break
        board = p.solver_board()
        with pool.engine() as engine:
            line = check_line(board, p.solution, engine)
        with pool.engine() as engine:
            pv = check_position(board, engine, max_solver_moves=max_solver_moves)
        rows.append({"id": p.puzzle_id, "mate": "mate" in p.themes, "solver_moves": p.solver_moves,
                     "line_kind": line.kind, "line_reason": line.reason, "pv_kind": pv.kind,
                     "pv_first_is_lichess": pv.first is not None and pv.first.move == p.solution[0],
                     "pv_line": pv.line})
    elapsed = time.perf_counter() - start

    def summary(subset: list[dict]) -> dict:
        n = len(subset)
        return {"puzzles": n,
                "line_unique": _ratio(sum(r["line_kind"] == "unique" for r in subset), n),
                "pv_unique": _ratio(sum(r["pv_kind"] == "unique" for r in subset), n),
                "pv_first_move_is_lichess": _ratio(sum(r["pv_first_is_lichess"] for r in subset), n),
                "line_kinds": dict(collections.Counter(r["line_kind"] for r in subset).most_common()),
                "pv_kinds": dict(collections.Counter(r["pv_kind"] for r in subset).most_common())}

    return {"seconds": round(elapsed, 1), "seconds_per_puzzle": round(elapsed / max(1, len(rows)), 3),
            "all": summary(rows), "mate": summary([r for r in rows if r["mate"]]),
            "not_mate": summary([r for r in rows if not r["mate"]]), "rows": rows}


def _stockfish_version(path: str) -> str:
    out = subprocess.run([path], input="uci\nquit\n", capture_output=True, text=True, timeout=10).stdout
    return next((line[len("id name "):] for line in out.splitlines() if line.startswith("id name ")), "?")


def markdown_tables(result: dict) -> str:
    lines = ["| theme | support | tagged | precision | recall |", "|---|---|---|---|---|"]
    for theme, r in result["tagger"]["themes"].items():
        fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| `{theme}` | {r['support']} | {r['tagged']} | {fmt(r['precision'])} | {fmt(r['recall'])} |")
    u = result["uniqueness"]
    lines += ["", "| puzzles | n | Lichess line unique | position unique (reward) | engine's first move = Lichess's |",
              "|---|---|---|---|---|"]
    for key in ("all", "mate", "not_mate"):
        s = u[key]
        lines.append(f"| {key} | {s['puzzles']} | {s['line_unique']} | {s['pv_unique']} | "
                     f"{s['pv_first_move_is_lichess']} |")
    lines += ["", f"line kinds: {u['all']['line_kinds']}", f"position kinds: {u['all']['pv_kinds']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puzzles", default=str(DEFAULT_PUZZLES), help="Lichess puzzle CSV")
    ap.add_argument("--tagger-puzzles", type=int, default=2000)
    ap.add_argument("--tagger-seed", type=int, default=0)
    ap.add_argument("--unique-puzzles", type=int, default=200)
    ap.add_argument("--unique-seconds", type=float, default=300.0, help="stop the uniqueness loop after this")
    ap.add_argument("--unique-seed", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=100_000, help="Stockfish nodes per search (multipv 2)")
    ap.add_argument("--max-solver-moves", type=int, default=5)
    ap.add_argument("--stockfish", default=None)
    ap.add_argument("--out", default="docs/chess_rewards.json")
    args = ap.parse_args()

    puzzles = read_puzzles(args.puzzles)
    settings = {**vars(args), "command": " ".join(["python", *sys.argv]), "engines": 1, "threads": 1,
                "hash_mb": 16, "multipv": 2, "gap": 0.5, "min_first_cp": 200, "python": platform.python_version(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    t0 = time.perf_counter()
    tagger_sample = sample_puzzles(puzzles, args.tagger_puzzles, args.tagger_seed)
    tagger = {"puzzles": len(tagger_sample), "themes": measure_tagger(tagger_sample),
              "seconds": round(time.perf_counter() - t0, 1)}
    print(f"tagger: {len(tagger_sample)} puzzles in {tagger['seconds']} s", flush=True)

    unique_sample = sample_puzzles(puzzles, args.unique_puzzles, args.unique_seed)
    limit = SearchLimit(nodes=args.nodes, time=10.0)
    with StockfishPool(size=1, limit=limit, path=args.stockfish, threads=1, hash_mb=16) as pool:
        settings["stockfish"] = f"{pool.path} ({_stockfish_version(pool.path)})"
        print("settings:", json.dumps({k: v for k, v in settings.items() if k != "command"}), flush=True)
        uniqueness = measure_uniqueness(unique_sample, pool, args.unique_puzzles, args.unique_seconds,
                                        args.max_solver_moves)
    result = {"settings": settings, "tagger": tagger, "uniqueness": uniqueness}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown_tables(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
