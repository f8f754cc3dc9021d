"""What a run does when its reward fails, and the NaNs it must not write as JSON.

* ``RewardGuard`` wraps the reward the trainer builds: each call (a batch) runs in a worker thread
  with a deadline (``reward.timeout_s``). A call past it scores its batch NaN, which the trainer
  drops and counts (``reward/dropped_nan``), as with a remote server that is down; the late call
  is left to finish in its thread, and while it runs later batches score NaN at once instead of
  calling the reward a second time concurrently. A call that raises stops the run with one line
  naming the reward and the batch (``reward.on_error: raise``), or scores its batch NaN and goes
  on (``nan``).
* ``NanEpochStreak`` stops the run after ``train.max_nan_epochs`` consecutive epochs in which every
  reward was NaN: a broken reward, which would otherwise "complete" a run that learned nothing.
* ``finite_json`` writes an undefined metric as ``null``: strict JSON has no NaN.

``RunStopped`` ends ``flowalign train`` with its one line and exit code 1; nothing written so far is
deleted, so the last checkpoint is there to continue from (docs/faults.md).
"""

from __future__ import annotations

import math
import sys
import threading

import torch


class RunStopped(RuntimeError):
    """A fault that ends the run; the message is one line and names the cause."""


class RewardGuard:
    """``reward`` behind a deadline and an error policy; any other attribute (``components``,
    ``modality``) is the wrapped reward's. ``components``: the names a NaN batch gets when the
    reward declares none (the configured weights)."""

    def __init__(self, reward, name: str, timeout_s: float | None, on_error: str, components=()):
        self.reward, self.name, self.timeout_s, self.on_error = reward, name, timeout_s, on_error
        self.nan_components = tuple(getattr(reward, "components", ()) or components)
        self.calls = 0
        self._late: threading.Thread | None = None  # a call that outlived its deadline

    def __getattr__(self, attribute):  # only for what the guard itself lacks
        if "reward" not in self.__dict__:  # not yet initialised (a copy being made): no recursion
            raise AttributeError(attribute)
        return getattr(self.reward, attribute)

    def __call__(self, samples, prompts, metadata) -> dict:
        self.calls += 1
        batch = f"batch {self.calls} ({len(prompts)} samples; first prompt {str(prompts[0])[:60]!r})" if len(prompts) \
            else f"batch {self.calls} (empty)"
        if self._late is not None and self._late.is_alive():
            return self._nan(len(prompts), f"reward {self.name!r} is still running an earlier batch past its "
                                           f"deadline; {batch} scored NaN")
        outcome: dict = {}
        grad = torch.is_grad_enabled()  # grad mode and the CUDA device are per thread: carried over
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def call():
            if device is not None:
                torch.cuda.set_device(device)
            try:
                with torch.set_grad_enabled(grad):
                    outcome["result"] = self.reward(samples, prompts, metadata)
            except Exception as error:  # noqa: BLE001  (reported below, by policy)
                outcome["error"] = error

        worker = threading.Thread(target=call, name=f"reward-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self._late = worker
            return self._nan(len(prompts), f"reward {self.name!r} did not score {batch} within reward.timeout_s="
                                           f"{self.timeout_s:g} s; scored NaN (dropped and counted)")
        if "error" in outcome:
            error = outcome["error"]
            text = f"reward {self.name!r} raised on {batch}: {type(error).__name__}: {_first_line(error)}"
            if self.on_error == "raise":
                raise RunStopped(f"{text} (reward.on_error=nan scores such a batch NaN and goes on)") from error
            return self._nan(len(prompts), f"{text}; scored NaN (reward.on_error=nan)")
        return outcome["result"]

    def _nan(self, n: int, message: str) -> dict[str, torch.Tensor]:
        print(f"flowalign: {message}", file=sys.stderr, flush=True)
        return {name: torch.full((n,), float("nan")) for name in self.nan_components}


class NanEpochStreak:
    """Counts consecutive epochs whose every reward was NaN (``reward/mean`` NaN); ``limit`` of them
    raise RunStopped (0: never)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def observe(self, stats: dict, epoch: int) -> None:
        self.count = self.count + 1 if math.isnan(stats["reward/mean"]) else 0
        if self.limit and self.count >= self.limit:
            raise RunStopped(f"every reward was NaN for {self.count} consecutive epochs (the last: epoch {epoch}; "
                             f"train.max_nan_epochs={self.limit}): the reward is failing, see its messages above")


def finite_json(value):
    """``value`` with every NaN / ±Inf float (at any depth) replaced by None, for ``json.dumps``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]
