"""Install every dependency at the floor pyproject.toml declares, in a new empty venv, and run tests.

A floor (``name>=X``) is only worth writing if ``name==X`` works with everything else at its own
floor. This script checks that the way a user's resolver could hit it: a venv made from nothing
(no ``--system-site-packages``), torch and torchvision pinned first (``--torch``, the versions this
machine's package index holds), then every other ``>=`` floor of ``[project].dependencies`` (and
of the extras named with ``--extras``) pinned with ``==``, then flowalign itself installed from a
wheel built here (``--no-deps``: nothing else may move), then the given test files run from the
work tree against the installed wheel. ``--pin name==version`` replaces one floor, to show that a
version below it fails (peft 0.17, diffusers 0.39: docs/install.md)::

    nice -n 19 python scripts/check_dependency_floors.py --extras clip,datasets --out docs/dependency_floors.json
    nice -n 19 python scripts/check_dependency_floors.py --pin peft==0.17.1 --out /tmp/peft017.json

It writes one JSON: the pins asked for, ``pip freeze`` of the venv, each test file's pytest
summary line and exit code, and the installed ``flowalign`` command run from outside the work tree
(``recipes``, the dry runs of two built-in recipes by name: the wheel's recipes and prompt files). The venv is deleted afterwards unless ``--keep`` (several GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/test_packaging.py", "tests/test_sd3_adapter.py", "tests/test_neural_rewards.py",
                 "tests/test_python_api.py", "tests/test_shapes_world.py", "tests/test_chess_tokenizer.py",
                 "tests/test_prompt_sources.py", "tests/test_trackers.py", "tests/test_evaluation.py"]
FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*(;.*)?$")


def floors(requirements: list[str]) -> dict[str, str]:
    """``{"peft": "0.18.0", ...}`` from ``name>=X`` requirements (others: no floor, skipped).

    >>> floors(["peft>=0.18", "pyyaml>=6.0.1", "xformers", "torch>=2.4"])
    {'peft': '0.18', 'pyyaml': '6.0.1', 'torch': '2.4'}
    """
    found = {}
    for text in requirements:
        match = FLOOR.match(text.split("#")[0])
        if match:
            found[match.group(1).lower()] = match.group(3)
    return found


def run(command: list[str], log, **kwargs) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    log.write(done.stdout)
    log.flush()
    return done


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default="/tmp/flowalign-floors", help="where to make the venv (deleted first)")
    parser.add_argument("--torch", default="torch==2.14.1,torchvision==0.29.1",
                        help="comma-separated torch pins installed first")
    parser.add_argument("--extras", default="", help="comma-separated extras whose floors are pinned too")
    parser.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                        help="replace one floor (repeatable)")
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="test files run in the venv")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--log", default="/tmp/flowalign-floors.log", help="pip and pytest output")
    parser.add_argument("--keep", action="store_true", help="keep the venv")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse a kept venv's torch (quicker; the result then says reused: true)")
    args = parser.parse_args(argv)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in filter(None, args.extras.split(",")):
        requirements += project["optional-dependencies"][extra]
    pins = {name: version for name, version in floors(requirements).items() if name not in ("torch", "torchvision")}
    for text in args.pin:
        name, version = text.split("==")
        pins[name.lower()] = version
    venv, started = Path(args.venv), time.time()
    reuse = args.reuse and (venv / "bin" / "python").is_file()
    if not reuse:
        shutil.rmtree(venv, ignore_errors=True)
    result = {"torch": args.torch.split(","), "pins": pins, "extras": args.extras, "reused": reuse, "tests": {}}
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' stale build/lib would end up in the wheel
    with open(args.log, "w") as log:
        if not reuse:
            run([sys.executable, "-m", "venv", str(venv)], log, check=True)  # empty: no system site-packages
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        steps = [("torch", pip + args.torch.split(",")),
                 ("floors", pip + [f"{n}=={v}" for n, v in pins.items()] + ["pytest>=8"])]
        for name, command in steps:
            done = run(command, log)
            if done.returncode:
                result["failed_step"] = name
                result["error_tail"] = done.stdout[-3000:]
                break
        else:
            wheels = venv / "wheel"
            run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)], log,
                check=True)
            wheel = next(wheels.glob("flowalign-*.whl"))
            run(pip + ["--no-deps", str(wheel)], log, check=True)
            freeze = run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], log).stdout.split()
            result["freeze"] = [line for line in freeze if not line.startswith("flowalign")]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
            for test in args.tests:
                # from a folder outside the work tree, so that `import flowalign` finds the installed wheel
                done = run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(ROOT / test)], log,
                           env=env, cwd="/tmp")
                summary = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
                result["tests"][test] = {"exit_code": done.returncode, "summary": summary[-1] if summary else
                                         done.stdout[-1500:]}
            # the installed wheel's recipes and their prompt files, from a folder outside the work tree
            result["commands"] = {}
            for command in (["recipes"], ["train", "shapes_nft", "--dry-run"],
                            ["train", "sd35m_flow_grpo_pickscore", "--dry-run"]):
                done = run([str(venv / "bin" / "flowalign"), *command], log, env={**env, "HF_HUB_OFFLINE": "1"},
                           cwd="/tmp")
                result["commands"]["flowalign " + " ".join(command)] = {
                    "exit_code": done.returncode, "tail": done.stdout.strip().splitlines()[-3:]}
    result["minutes"] = round((time.time() - started) / 60, 1)
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
