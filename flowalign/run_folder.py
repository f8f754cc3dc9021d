"""A run owns its output folder.

* ``check_ownership``: a folder holding a finished run (``final/``, ``metrics.json``) or a started
  one (a checkpoint) is not written again unless the new run continues it (``resume``) or says
  ``overwrite=true``, which first removes the earlier run's outputs so two runs never mix.
* ``RunLock``: ``OUTPUT_DIR/.lock`` holds the owner's pid and host, created atomically; a second run
  into the same folder stops with one line naming the owner. A lock whose process is gone (same host)
  is stale: taken over with a message.
* ``settings`` / ``changed_settings``: the settings that make a run's numbers (seed, method, model,
  LoRA shape, sampling steps, group sizes, reward) are written with every checkpoint; resuming with
  any of them changed stops and names each difference.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from flowalign.errors import ConfigError

LOCK_NAME = ".lock"
# what a run writes into its folder (overwrite=true removes these, nothing else)
RUN_OUTPUTS = ("checkpoints", "final", "grids", "eval_samples", "metrics.json", "history.jsonl", "config.json")
IDENTITY = ("train.seed", "method", "model.family", "model.path", "model.lora_rank", "model.lora_alpha",
            "model.lora_targets", "model.init_lora", "sampling.num_steps", "train.group_size",
            "train.groups_per_epoch", "reward.name")


def run_state(out: Path) -> str | None:
    """"finished" (final/ or metrics.json), "started" (a checkpoint), or None (nothing to lose)."""
    out = Path(out)
    if (out / "final").is_dir() or (out / "metrics.json").is_file():
        return "finished"
    if any((out / "checkpoints").glob("epoch-*")):
        return "started"
    return None


def check_ownership(config, where: str) -> None:
    """ConfigError when ``output_dir`` holds another run and this one neither resumes nor overwrites."""
    out = Path(config.output_dir).expanduser()
    if config.resume not in (None, "auto") and not (Path(config.resume).expanduser() / "state.json").is_file():
        raise ConfigError(f"{where}: resume: no checkpoint at {Path(config.resume).expanduser().resolve()} (a "
                          "checkpoints/epoch-N folder with state.json; resume=auto continues the newest in output_dir)")
    state = run_state(out)
    if state is None or config.resume or getattr(config, "overwrite", False):
        return
    held = "final/ and metrics.json" if state == "finished" else "checkpoints, no final/ yet"
    raise ConfigError(f"{where}: output_dir: {out} holds a {state} run ({held}); continue it with resume=auto, "
                      "start afresh there with overwrite=true (its outputs are deleted first), or name another "
                      "output_dir")


def clear_outputs(out: Path) -> None:
    """overwrite=true: the earlier run's outputs removed (nothing else in the folder is touched)."""
    for name in RUN_OUTPUTS:
        path = Path(out) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for events in Path(out).glob("events.out.tfevents.*"):
        events.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``OUTPUT_DIR/.lock`` for the life of a run (``acquire`` / ``release``)."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner.get("host") == me["host"] and owner.get("pid") == me["pid"]:
                    self.held = True  # this process's own lock (a second Trainer in one script)
                    return
                if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
                    print(f"flowalign: taking over the stale lock {self.path} (pid {owner['pid']} on {owner['host']} "
                          "is gone)", file=sys.stderr, flush=True)
                    self.path.unlink(missing_ok=True)
                    continue
                elsewhere = "" if owner.get("host") == me["host"] else " (another machine: if that run is gone, " \
                                                                        f"delete {self.path})"
                raise ConfigError(f"output_dir: {self.path.parent} is in use by another run (pid {owner.get('pid')} "
                                  f"on {owner.get('host')}, since {owner.get('started')}){elsewhere}; wait for it, or "
                                  "name another output_dir")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return

    def _owner(self) -> dict:
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.held:
            self.held = False
            if self._owner().get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)


def settings(config) -> dict:
    """The identity settings of ``config`` (IDENTITY), as written with each checkpoint."""
    from flowalign.config import to_dict

    tree = to_dict(config)
    out = {}
    for key in IDENTITY:
        value = tree
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = value
    return out


def changed_settings(saved: dict, now: dict) -> list[str]:
    """"key: checkpoint → now" for every identity setting that differs (keys the checkpoint lacks:
    not compared)."""
    return [f"{k}: {saved[k]!r} → {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
