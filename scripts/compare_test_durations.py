"""The default test run, before and after a change: per-test times from two ``pytest --durations=0`` logs.

    (cd BEFORE && OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider --durations=0 > before.log) &
    (cd AFTER && OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider --durations=0 > after.log)
    python scripts/compare_test_durations.py before.log after.log --repo . --base BEFORE_COMMIT

Sums each test id's setup, call and teardown times; compares the ids both runs have, split into the
tests whose file is unchanged since ``--base`` (the same test on other code: the change's own cost)
and those whose file changed (a test that may now do more); lists the largest increases. Times are
pytest's wall-clock durations: run both sides side by side, one thread each, so load hits both alike.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import defaultdict

LINE = re.compile(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"(\d+ (?:passed|failed).*) in ([\d.]+)s")


def read(path: str) -> tuple[dict[str, float], str]:
    times, summary = defaultdict(float), ""
    for line in open(path, errors="replace"):
        if m := LINE.match(line):
            times[m.group(3)] += float(m.group(1))
        elif m := SUMMARY.search(line):
            summary = f"{m.group(1)} in {float(m.group(2)):.0f} s"
    return times, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--repo", default=".", help="the git checkout the test files are in")
    parser.add_argument("--base", help="the before side's commit: splits the common tests by changed files")
    parser.add_argument("--most", type=int, default=8)
    args = parser.parse_args()
    (a, sa), (b, sb) = read(args.before), read(args.after)
    print(f"before: {sa}; {len(a)} timed ids, {sum(a.values()):.0f} s\nafter:  {sb}; {len(b)} timed ids, "
          f"{sum(b.values()):.0f} s")
    common = set(a) & set(b)
    groups = {"common": common}
    if args.base:
        changed = set(subprocess.run(["git", "diff", "--name-only", args.base, "HEAD", "--", "tests/"],
                                     capture_output=True, text=True, cwd=args.repo, check=True).stdout.split())
        groups["in files unchanged since the base"] = {k for k in common if k.split("::")[0] not in changed}
        groups["in changed files"] = {k for k in common if k.split("::")[0] in changed}
    for name, ids in groups.items():
        before, after = sum(a[k] for k in ids), sum(b[k] for k in ids)
        print(f"{name}: {len(ids)} ids, {before:.0f} s -> {after:.0f} s ({after / before:.3f}x)")
    new = set(b) - set(a)
    print(f"only after: {len(new)} ids, {sum(b[k] for k in new):.0f} s")
    for k in sorted(common, key=lambda k: b[k] - a[k], reverse=True)[:args.most]:
        print(f"  {a[k]:7.2f} s -> {b[k]:7.2f} s  {k}")


if __name__ == "__main__":
    main()
