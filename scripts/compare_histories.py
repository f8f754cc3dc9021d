"""Compare two sets of runs to the last digit: a refactor's before / after check.

    python scripts/compare_histories.py BEFORE_ROOT AFTER_ROOT [RUN ...]

Each root holds one folder per run (``output_dir`` of ``flowalign train``). For every run found in
both (or the ones named), every line of ``history.jsonl`` and the evaluations in ``metrics.json``
must be equal value for value, ``time/*`` keys and ``train_minutes`` excepted (wall-clock). Floats
are compared as JSON text, so "equal" means the same 17 significant digits. Prints one line per
run and, for a difference, its first few keys; exits 1 if any run differs or is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WALL_CLOCK = ("time/",)


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def _history(run: Path) -> list[dict]:
    return [_strip(json.loads(line)) for line in (run / "history.jsonl").read_text().splitlines() if line]


def _evals(run: Path) -> dict:
    path = run / "metrics.json"
    if not path.exists():
        return {}
    evals = json.loads(path.read_text()).get("evals", {})
    return {label: _strip({k: v for k, v in ev.items() if k not in ("train_minutes", "train_seconds")})
            for label, ev in evals.items()}


def differences(before: Path, after: Path) -> list[str]:
    """Human-readable differences between two runs' histories and evaluations (empty: equal)."""
    out: list[str] = []
    hb, ha = _history(before), _history(after)
    if len(hb) != len(ha):
        out.append(f"history: {len(hb)} epochs before, {len(ha)} after")
    for epoch, (b, a) in enumerate(zip(hb, ha), start=1):
        for key in sorted(set(b) | set(a)):
            if json.dumps(b.get(key)) != json.dumps(a.get(key)):
                out.append(f"epoch {epoch} {key}: {b.get(key)!r} -> {a.get(key)!r}")
    eb, ea = _evals(before), _evals(after)
    for label in sorted(set(eb) | set(ea)):
        b, a = eb.get(label, {}), ea.get(label, {})
        for key in sorted(set(b) | set(a)):
            if json.dumps(b.get(key)) != json.dumps(a.get(key)):
                out.append(f"eval {label} {key}: {b.get(key)!r} -> {a.get(key)!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("runs", nargs="*", help="run folder names (default: every run with a history.jsonl in BEFORE)")
    args = parser.parse_args(argv)
    runs = args.runs or sorted(p.parent.name for p in args.before.glob("*/history.jsonl"))
    failed = False
    for name in runs:
        b, a = args.before / name, args.after / name
        if not (b / "history.jsonl").exists() or not (a / "history.jsonl").exists():
            print(f"{name}: MISSING ({'before' if not (b / 'history.jsonl').exists() else 'after'})")
            failed = True
            continue
        diff = differences(b, a)
        epochs = len(_history(b))
        if diff:
            failed = True
            print(f"{name}: DIFFERENT ({len(diff)} values), first: " + "; ".join(diff[:4]))
        else:
            keys = len(_history(b)[0]) if epochs else 0
            print(f"{name}: equal ({epochs} epochs x {keys} values, evaluations included)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
