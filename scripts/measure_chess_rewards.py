"""Measure the chess theme tagger and the uniqueness checker against Lichess's own puzzle labels.

    python scripts/measure_chess_rewards.py --out docs/chess_rewards.json

Tagger: on a seeded sample of puzzles (default 2,000, seed 0), tag each solution (the position
after the setup move, the solver's line) and compare with Lichess's themes: precision, recall,
F1 and support per theme, for every supported theme and every Lichess label with at least
``--min-support`` examples in the sample (except the labels of the source game: master,
masterVsMaster, superGM); macro-F1 over the latter (a label we cannot produce counts F1 = 0).
Twice: with the setup move given to the tagger (as Lichess tags) and without it (what a generated
board offers). The evaluation labels need the engine's score of the last solver move
(``--eval-nodes``, deeper, ``--eval-deep-nodes``, within 100 cp of a threshold; 0 turns them off).
The rules were written on a different seeded sample that excludes these puzzles (``--tuning``:
seed 12345, the measuring sample excluded); run with ``--tuning`` to see that sample instead.

Uniqueness: on another seeded sample (seed 1), in order, until ``--unique-puzzles`` or
``--unique-seconds`` run out: ``check_line`` on Lichess's solution (is every solver move the
engine's unique best?) and ``check_position`` (the reward's view: no solution given). Lichess
puzzles are unique by construction (deeper searches than ours), so the fraction we call unique
is an agreement rate; the failure kinds say why the rest disagree.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chess

from flowalign.chess.puzzles import DEFAULT_PUZZLES, Puzzle, read_puzzles, sample_puzzles
from reward_models.chess.engine import SearchLimit, StockfishPool
from reward_models.chess.themes import EVAL_SCALE, SUPPORTED_THEMES, tag_themes
from reward_models.chess.uniqueness import (DEFAULT_RULE, LICHESS, LineScore, Rule, _judge, _step,
                                             ends_in_mate, ends_line, lichess_generator)


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


EXCLUDED_LABELS = ("master", "masterVsMaster", "superGM")  # they describe the source game, not the puzzle


def last_move_eval(pool: StockfishPool, p: Puzzle, nodes: int, deep_nodes: int) -> int | None:
    """The engine's score (cp, solver's view) of the position before the puzzle's last solver move;
    None for a mating line. Re-searched at ``deep_nodes`` within 100 cp of Lichess's 200/600."""
    board = p.solver_board()
    for move in p.solution[:-1]:
        board.push_uci(move)
    if board.copy(stack=False).is_checkmate():
        return None
    after = board.copy(stack=False)
    after.push_uci(p.solution[-1])
    if after.is_checkmate():
        return None
    cp = None
    for n in (nodes, deep_nodes):
        with pool.engine() as engine:
            score = engine.analyse(board, multipv=1, limit=SearchLimit(nodes=n, time=60.0))[0]["score"].pov(board.turn)
        cp = score.score(mate_score=100_000)
        if not deep_nodes or deep_nodes <= nodes or min(abs(cp - 200), abs(cp - 600)) > 100:
            break
    return cp


def measure_tagger(puzzles: list[Puzzle], evals: dict[str, int | None], setup: bool, min_support: int,
                   eval_scale: float) -> dict:
    """Per theme (supported, or a Lichess label with ≥ ``min_support`` in the sample): support
    (Lichess positives), tagged, tp, precision, recall, F1; and macro-F1 over the labels."""
    support = collections.Counter(t for p in puzzles for t in p.themes)
    labels = [t for t, n in support.most_common() if n >= min_support and t not in EXCLUDED_LABELS]
    counts = {t: collections.Counter() for t in dict.fromkeys([*SUPPORTED_THEMES, *labels])}
    for p in puzzles:
        tags = tag_themes(p.solver_board(), p.solution, setup=(chess.Board(p.fen), p.moves[0]) if setup else None,
                          eval_cp=evals.get(p.puzzle_id), eval_scale=eval_scale)
        for theme, c in counts.items():
            ours, theirs = theme in tags, theme in p.themes
            c["tp"] += ours and theirs
            c["tagged"] += ours
            c["support"] += theirs
    themes = {t: {"support": c["support"], "tagged": c["tagged"], "tp": c["tp"],
                  "precision": _ratio(c["tp"], c["tagged"]), "recall": _ratio(c["tp"], c["support"]),
                  "f1": _ratio(2 * c["tp"], c["tagged"] + c["support"]), "in_macro": t in labels}
              for t, c in counts.items()}
    f1 = [themes[t]["f1"] or 0.0 for t in labels]
    return {"labels_in_macro": labels, "macro_f1": round(sum(f1) / len(f1), 4), "themes": themes}


def _verdict(p: Puzzle, steps: dict[str, list[dict]], rule: Rule, deep: bool) -> str:
    """Offline verdict on Lichess's line from recorded searches: "unique" or the first failure kind.
    ``deep``: use the deeper search of a step where one was made (the adaptive rule)."""
    board, first = p.solver_board(), None
    mating = ends_in_mate(board, p.solution)
    for i in range(0, len(p.solution), 2):
        records = steps[board.fen()]
        rec = records[-1] if deep else records[0]
        best = LineScore(**rec["best"])
        second = LineScore(**rec["second"]) if rec["second"] else None
        non_mating = LineScore(**rec["non_mating"]) if rec.get("non_mating") else None  # absent in older files
        problem, _ = _judge(best, second, rule, i == 0, non_mating, expect_mate=i > 0 and mating and first.mates)
        first = first or best
        if ends_line(problem, i // 2, first):
            return "unique"
        if problem:
            return problem[0]
        board.push_uci(p.solution[i])
        if best.move != p.solution[i] and not (best.mate == 1 and board.is_checkmate()):
            return "engine_disagrees"
        if i + 1 < len(p.solution):
            board.push_uci(p.solution[i + 1])
    return "unique"


def deep_rules(engine_name: str) -> dict[str, Rule]:
    """The rules a run can use to decide where to search deeper (--deep-rule), for the engine named
    ``engine_name`` (the generator's thresholds are in Stockfish 12–15's cp: ``uniqueness.generator_units``;
    without "lichess_generator" for an engine whose cp has no known factor, e.g. Stockfish 17)."""
    rules = {"lichess": LICHESS, "lichess_scaled": dataclasses.replace(LICHESS, cp_scale=EVAL_SCALE)}
    try:
        rules["lichess_generator"] = lichess_generator(engine_name)
    except ValueError:
        pass
    return rules


def uniqueness_rules(engine_name: str) -> dict[str, tuple[Rule, bool]]:
    """The rules judged offline from one set of searches by the engine named ``engine_name``:
    name → (rule, use the deeper searches where the run made them)."""
    rules = deep_rules(engine_name)
    judged = {"default_base": (DEFAULT_RULE, False), "lichess_base": (LICHESS, False),
              "lichess_adaptive": (LICHESS, True), "lichess_scaled_base": (rules["lichess_scaled"], False),
              "lichess_scaled_adaptive": (rules["lichess_scaled"], True)}
    if "lichess_generator" in rules:  # the generator of 2020–22: Stockfish 12–15's cp and win chance
        judged |= {"generator_base": (rules["lichess_generator"], False),
                   "generator_adaptive": (rules["lichess_generator"], True)}
    return judged


def summarise_uniqueness(rows: list[dict], rules: dict, seconds: float, rule: Rule) -> dict:
    def summary(subset: list[dict]) -> dict:
        n = len(subset)
        out = {"puzzles": n}
        for name in rules:
            out[name] = _ratio(sum(r[name] == "unique" for r in subset), n)
            out[name + "_kinds"] = dict(collections.Counter(r[name] for r in subset).most_common())
        out["nodes_per_puzzle"] = round(sum(r["nodes"] for r in subset) / max(1, n))
        out["base_nodes_per_puzzle"] = round(sum(r["base_nodes"] for r in subset) / max(1, n))
        out["deep_searches_per_puzzle"] = round(sum(r["deep_searches"] for r in subset) / max(1, n), 3)
        out["seconds_per_puzzle"] = round(sum(r["seconds"] for r in subset) / max(1, n), 2)
        return out

    return {"seconds": round(seconds, 1), "seconds_per_puzzle": round(seconds / max(1, len(rows)), 3),
            "rule": dataclasses.asdict(rule), "all": summary(rows), "mate": summary([r for r in rows if r["mate"]]),
            "not_mate": summary([r for r in rows if not r["mate"]]), "rows": rows}


def add_verdicts(rows: list[dict], puzzles: dict[str, Puzzle], rules: dict) -> None:
    for row in rows:
        steps: dict[str, list[dict]] = collections.defaultdict(list)
        for r in row["steps"]:
            steps[r["fen"]].append(r)
        for name, (rule, deep) in rules.items():
            row[name] = _verdict(puzzles[row["id"]], steps, rule, deep)


def measure_uniqueness(puzzles: list[Puzzle], pool: StockfishPool, max_puzzles: int, seconds: float,
                       rule: Rule) -> dict:
    """Agreement with Lichess's (unique) puzzles of the per-move rule along Lichess's line.

    Every solver move of the line is searched at the base nodes (all of them, even after a
    failure, so that every rule of ``uniqueness_rules`` can be judged offline from the same
    searches) and again at ``rule.deep_nodes`` when ``rule`` finds it within ``rule.margin`` of a
    threshold. Verdicts: the old default rule and Lichess's thresholds on the base searches
    alone; Lichess's thresholds with the deeper searches where made; both again with our cp
    scaled to Lichess's (``themes.EVAL_SCALE``)."""
    rows, start = [], time.perf_counter()
    for p in puzzles[:max_puzzles]:
        if time.perf_counter() - start > seconds:
            break
        t = time.perf_counter()
        board, records = p.solver_board(), []
        with pool.engine() as engine:
            first, mating = None, ends_in_mate(board, p.solution)
            for i in range(0, len(p.solution), 2):
                best = _step(engine, board, rule, i == 0, records, expect_mate=i > 0 and mating and first.mates)[0]
                first = first or best
                board.push_uci(p.solution[i])
                if i + 1 < len(p.solution):
                    board.push_uci(p.solution[i + 1])
        rows.append({"id": p.puzzle_id, "mate": "mate" in p.themes, "solver_moves": p.solver_moves,
                     "seconds": round(time.perf_counter() - t, 2), "nodes": sum(r["nodes"] for r in records),
                     "base_nodes": sum(r["nodes"] for r in records if r["nodes"] == pool.limit.nodes),
                     "deep_searches": sum(r["nodes"] != pool.limit.nodes for r in records), "steps": records})
    rules = uniqueness_rules(pool.name)
    add_verdicts(rows, {p.puzzle_id: p for p in puzzles}, rules)
    return summarise_uniqueness(rows, rules, time.perf_counter() - start, rule)


MEASURING_PUZZLES = 400  # the measuring sample's size: the first 400 of --unique-seed (docs/chess.md)


def uniqueness_sample(puzzles: list[Puzzle], n: int, seed: int, tuning: int | None = None,
                      only: str | None = None) -> list[Puzzle]:
    """The uniqueness sample: ``n`` puzzles of seed ``seed`` (the measuring sample); or, with
    ``tuning``, of that seed with the measuring sample's 400 puzzles excluded; ``only`` "mate" /
    "not_mate" keeps those puzzles (n of them, drawn in order from a sample of all puzzles)."""
    exclude = set() if tuning is None else {p.puzzle_id for p in sample_puzzles(puzzles, MEASURING_PUZZLES, seed)}
    drawn = sample_puzzles(puzzles, len(puzzles) if only else n, seed if tuning is None else tuning, exclude)
    if only:
        drawn = [p for p in drawn if ("mate" in p.themes) == (only == "mate")]
    return drawn[:n]


def markdown_tables(result: dict) -> str:
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    if result.get("tagger") is None:
        lines = []
    else:
        lines = _tagger_table(result["tagger"], fmt)
    if "uniqueness" not in result:
        return "\n".join(lines)
    return "\n".join(lines + _uniqueness_table(result["uniqueness"]))


def _tagger_table(tagger: dict, fmt) -> list[str]:
    with_setup, without = tagger["with_setup"], tagger["without_setup"]
    lines = [f"macro-F1 over {len(with_setup['labels_in_macro'])} labels: {with_setup['macro_f1']} with the setup "
             f"move, {without['macro_f1']} without", "",
             "| theme | in macro | support | tagged | precision | recall | F1 | F1 without setup |",
             "|---|---|---|---|---|---|---|---|"]
    for theme, r in sorted(with_setup["themes"].items(), key=lambda kv: -kv[1]["support"]):
        lines.append(f"| `{theme}` | {'yes' if r['in_macro'] else ''} | {r['support']} | {r['tagged']} | "
                     f"{fmt(r['precision'])} | {fmt(r['recall'])} | {fmt(r['f1'])} | "
                     f"{fmt(without['themes'][theme]['f1'])} |")
    return lines


def _uniqueness_table(u: dict) -> list[str]:
    names = [n for n in ("default_base", "lichess_base", "lichess_adaptive", "lichess_scaled_base",
                         "lichess_scaled_adaptive", "generator_base", "generator_adaptive") if n in u["all"]]
    lines = ["", "| puzzles | n | " + " | ".join(names)
             + " | nodes per puzzle | deep searches per puzzle | s per puzzle |",
             "|---|---|" + "---|" * (len(names) + 3)]
    for key in ("all", "mate", "not_mate"):
        x = u[key]
        lines.append(f"| {key} | {x['puzzles']} | " + " | ".join(str(x[n]) for n in names)
                     + f" | {x['nodes_per_puzzle']} | {x['deep_searches_per_puzzle']} | "
                       f"{x.get('seconds_per_puzzle')} |")
    lines += [""] + [f"kinds ({n}): {u['all'][n + '_kinds']}" for n in names]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puzzles", default=str(DEFAULT_PUZZLES), help="Lichess puzzle CSV")
    ap.add_argument("--tagger-puzzles", type=int, default=2000)
    ap.add_argument("--tagger-seed", type=int, default=0)
    ap.add_argument("--tuning", action="store_true",
                    help="tag the tuning sample (seed 12345, 2,000 puzzles, the measuring sample excluded) instead")
    ap.add_argument("--min-support", type=int, default=50, help="labels with this many examples enter macro-F1")
    ap.add_argument("--eval-nodes", type=int, default=100_000, help="nodes for the evaluation labels (0: off)")
    ap.add_argument("--eval-deep-nodes", type=int, default=1_000_000, help="near a threshold, search this deep")
    ap.add_argument("--eval-scale", type=float, default=EVAL_SCALE, help="our cp → Lichess's cp (themes.EVAL_SCALE)")
    ap.add_argument("--skip-uniqueness", action="store_true")
    ap.add_argument("--skip-tagger", action="store_true")
    ap.add_argument("--deep-nodes", type=int, default=1_000_000,
                    help="uniqueness: re-search a step this deep when within --margin of a threshold")
    ap.add_argument("--margin", type=float, default=0.15)
    ap.add_argument("--deep-rule", choices=("lichess", "lichess_generator", "lichess_scaled"), default="lichess",
                    help="the rule whose slack (< --margin) decides which steps are searched again at --deep-nodes")
    ap.add_argument("--rescore", default=None, metavar="JSON",
                    help="recompute the uniqueness verdicts of an earlier --out from its recorded searches")
    ap.add_argument("--unique-puzzles", type=int, default=200)
    ap.add_argument("--unique-seconds", type=float, default=300.0, help="stop the uniqueness loop after this")
    ap.add_argument("--unique-seed", type=int, default=1)
    ap.add_argument("--unique-tuning", type=int, default=None, metavar="SEED",
                    help="uniqueness on a tuning sample instead: this seed, the measuring sample (--unique-seed, "
                         "the first 400 puzzles) excluded")
    ap.add_argument("--unique-skip", type=int, default=0, metavar="K",
                    help="skip the sample's first K puzzles (to finish a run that stopped at --unique-seconds)")
    ap.add_argument("--unique-only", choices=("mate", "not_mate"), default=None,
                    help="keep only the mate (or the non-mate) puzzles of the uniqueness sample")
    ap.add_argument("--nodes", type=int, default=100_000, help="Stockfish nodes per search (multipv 2)")
    ap.add_argument("--max-solver-moves", type=int, default=5)
    ap.add_argument("--stockfish", default=None)
    ap.add_argument("--out", default="docs/chess_rewards.json")
    args = ap.parse_args()

    puzzles = read_puzzles(args.puzzles)
    if args.rescore:
        result = json.loads(Path(args.rescore).read_text())
        u = result["uniqueness"]
        rule = Rule(**u["rule"])
        rules = uniqueness_rules(result["settings"]["stockfish"].rsplit(" (", 1)[1].rstrip(")"))  # "path (name)"
        add_verdicts(u["rows"], {p.puzzle_id: p for p in puzzles}, rules)
        result["uniqueness"] = summarise_uniqueness(u["rows"], rules, u["seconds"], rule)
        Path(args.rescore).write_text(json.dumps(result, indent=1) + "\n")
        print("\n".join(_uniqueness_table(result["uniqueness"])))
        return
    settings = {**vars(args), "command": " ".join(["python", *sys.argv]), "engines": 1, "threads": 1,
                "hash_mb": 16, "multipv": 2, "gap": 0.5, "min_first_cp": 200, "python": platform.python_version(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    t0 = time.perf_counter()
    tagger = None
    tagger_sample = [] if args.skip_tagger else sample_puzzles(puzzles, args.tagger_puzzles, args.tagger_seed)
    if args.tuning:
        measured = {p.puzzle_id for p in tagger_sample}
        tagger_sample = sample_puzzles(puzzles, 2000, 12345, exclude=measured)
    evals: dict[str, int | None] = {}
    if args.eval_nodes and tagger_sample:
        with StockfishPool(size=1, limit=SearchLimit(nodes=args.eval_nodes, time=60.0), path=args.stockfish) as pool:
            evals = {p.puzzle_id: last_move_eval(pool, p, args.eval_nodes, args.eval_deep_nodes)
                     for p in tagger_sample}
    eval_seconds = time.perf_counter() - t0
    tagger = None if args.skip_tagger else {
              "puzzles": len(tagger_sample), "tuning_sample": args.tuning, "eval_seconds": round(eval_seconds, 1),
              "with_setup": measure_tagger(tagger_sample, evals, True, args.min_support, args.eval_scale),
              "without_setup": measure_tagger(tagger_sample, evals, False, args.min_support, args.eval_scale),
              "evals": evals,
              "seconds": round(time.perf_counter() - t0, 1)}
    if tagger:
        print(f"tagger: {len(tagger_sample)} puzzles in {tagger['seconds']} s (engine evaluations {eval_seconds:.0f} s); "
              f"macro-F1 {tagger['with_setup']['macro_f1']} with setup, {tagger['without_setup']['macro_f1']} without",
              flush=True)
    if args.skip_uniqueness:
        result = {"settings": settings, "tagger": tagger}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(markdown_tables(result))
        print(f"wrote {args.out}")
        return

    unique_sample = uniqueness_sample(puzzles, args.unique_puzzles, args.unique_seed, args.unique_tuning,
                                      args.unique_only)[args.unique_skip:]
    limit = SearchLimit(nodes=args.nodes, time=10.0)
    with StockfishPool(size=1, limit=limit, path=args.stockfish, threads=1, hash_mb=16) as pool:
        settings["stockfish"] = f"{pool.path} ({pool.name})"
        print("settings:", json.dumps({k: v for k, v in settings.items() if k != "command"}), flush=True)
        rules = deep_rules(pool.name)
        if args.deep_rule not in rules:
            raise SystemExit(f"--deep-rule {args.deep_rule}: the cp of {pool.name} has no known factor to "
                             f"Stockfish 12–15's (uniqueness.generator_units); use --deep-rule lichess")
        rule = dataclasses.replace(rules[args.deep_rule], deep_nodes=args.deep_nodes, margin=args.margin)
        uniqueness = measure_uniqueness(unique_sample, pool, args.unique_puzzles, args.unique_seconds, rule)
    result = {"settings": settings, "tagger": tagger, "uniqueness": uniqueness}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown_tables(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
