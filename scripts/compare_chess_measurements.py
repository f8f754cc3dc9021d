"""Pool ``scripts/measure_chess_model.py`` results of two arms over the same draws and compare them.

    python scripts/compare_chess_measurements.py --a "without=runs/ablation/nomove-*.json" \
        --b "with=runs/ablation/with-last-*.json" --out docs/chess_move_ablation.json

Each arm is ``name=glob`` (the draws: one JSON per ``--seed``; both arms must hold the same
seeds). Pooled over the draws: counts and rates of ``legal``, ``unique``, ``theme_match`` and
``yield`` (a rate × the samples the engine scored), ``distinct`` and ``board_distance`` (the
mean over draws of the per-request means), the best-move rates on legal and on unique boards
with their chance rates. For each count, B against A: the difference in points and the ratio
B / A with a 95 % interval for a ratio of two Poisson counts, exp(log(b/a) ± 1.96·√(1/a + 1/b))
(log-normal approximation; the two arms' samples are independent given the draws).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

COUNTED = ("legal", "unique", "theme_match", "yield")


def pool(paths: list[str]) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in sorted(paths)]
    seeds = sorted(r["settings"]["seed"] for r in runs)
    out = {"files": sorted(paths), "seeds": seeds, "samples": 0, "yield_per_draw": []}
    counts = dict.fromkeys(COUNTED, 0.0)
    legal_n = unique_n = 0
    move = {"best_move_on_legal": 0.0, "move_chance": 0.0, "best_move_on_unique": 0.0, "move_chance_on_unique": 0.0}
    for r in sorted(runs, key=lambda r: r["settings"]["seed"]):
        o = r["overall"]
        scored = o["samples"] - o.get("engine_failed", 0)
        out["samples"] += o["samples"]
        counts["legal"] += o["legal"] * o["samples"]
        for key in ("unique", "theme_match", "yield"):
            counts[key] += o[key] * scored
        out["yield_per_draw"].append(round(o["yield"] * scored))
        legal_n += o["legal_count"]
        unique_n += o.get("unique_count", 0)
        for key in move:
            weight = o.get("unique_count", 0) if key.endswith("unique") else o["legal_count"]
            if o.get(key) is not None:
                move[key] += o[key] * weight
    out["counts"] = {k: round(v) for k, v in counts.items()}
    out["rates"] = {k: v / out["samples"] for k, v in counts.items()}
    for key in ("distinct", "board_distance"):
        out[key] = sum(r["overall"][key] for r in runs) / len(runs)
    out["legal_boards"], out["unique_boards"] = legal_n, unique_n
    has_move = any(r["overall"].get("best_move_on_legal") is not None for r in runs)
    out["move"] = ({k: v / n if (n := unique_n if k.endswith("unique") else legal_n) else None
                    for k, v in move.items()} if has_move else None)
    return out


def ratio(a: float, b: float) -> dict:
    if a <= 0 or b <= 0:
        return {"ratio": None, "ci95": None}
    r, se = b / a, math.sqrt(1 / a + 1 / b)
    return {"ratio": r, "ci95": [r * math.exp(-1.96 * se), r * math.exp(1.96 * se)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="the reference arm, name=glob")
    parser.add_argument("--b", required=True, help="the compared arm, name=glob")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    arms = {}
    for spec in (args.a, args.b):
        name, _, pattern = spec.partition("=")
        paths = glob.glob(pattern)
        if not name or not paths:
            parser.error(f"{spec!r}: expected name=glob matching measure_chess_model.py JSON files")
        arms[name] = pool(paths)
    (na, a), (nb, b) = arms.items()
    if a["seeds"] != b["seeds"]:
        parser.error(f"the arms were measured on different draws: {na} {a['seeds']}, {nb} {b['seeds']}")
    compare = {k: {"points": 100 * (b["rates"][k] - a["rates"][k]), **ratio(a["counts"][k], b["counts"][k])}
               for k in COUNTED}
    result = {"a": na, "b": nb, "arms": arms, f"{nb}_vs_{na}": compare}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
