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

import contextlib
import errno
import math
import sys
import threading

import torch


SLOW_BATCH_S = 30.0  # a reward batch still running this long is said to be slow (once per batch)
INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class RunStopped(RuntimeError):
    """A fault that ends the run; the message is one line and names the cause."""


class RewardGuard:
    """``reward`` behind a deadline and an error policy; any other attribute (``components``,
    ``modality``) is the wrapped reward's. ``components``: the names a NaN batch gets when the
    reward declares none (the configured weights)."""

    def __init__(self, reward, name: str, timeout_s: float | None, on_error: str, components=(), inline=False):
        # inline: called in the caller's thread (torch's thread settings are per thread, so the numbers of
        # an evaluation reward stay those of a direct call), with the same result checks and error policy
        self.reward, self.name, self.timeout_s, self.on_error, self.inline = reward, name, timeout_s, on_error, inline
        self.nan_components = tuple(getattr(reward, "components", ()) or components)
        self.needed = tuple(components)  # the weighted components: every result must hold them
        self.warn_after_s = SLOW_BATCH_S if timeout_s is None else min(SLOW_BATCH_S, timeout_s / 4)
        self.calls = 0
        self._late: threading.Thread | None = None  # a call that outlived its deadline

    def describe(self) -> str:
        deadline = "no deadline" if self.timeout_s is None else f"{self.timeout_s:g} s per batch"
        return (f"reward {self.name!r}: {deadline} (reward.timeout_s), a warning after {self.warn_after_s:g} s; a "
                f"batch past it scores NaN")

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
                    outcome["result"] = checked_result(self.reward(samples, prompts, metadata), len(prompts),
                                                       self.needed)
            except BaseException as error:  # noqa: BLE001  (SystemExit, KeyboardInterrupt of a plug-in too: by policy)
                outcome["error"] = error

        if self.inline:
            call()
            return self._outcome(outcome, batch, len(prompts))
        worker = threading.Thread(target=call, name=f"reward-{self.name}", daemon=True)
        worker.start()
        worker.join(self.warn_after_s if self.timeout_s is None else min(self.warn_after_s, self.timeout_s))
        if worker.is_alive():
            deadline = "no deadline" if self.timeout_s is None else f"scored NaN at {self.timeout_s:g} s"
            print(f"flowalign: warning: reward {self.name!r} is still scoring {batch} after {self.warn_after_s:g} s "
                  f"({deadline}: reward.timeout_s)", file=sys.stderr, flush=True)
            worker.join(None if self.timeout_s is None else max(self.timeout_s - self.warn_after_s, 0))
        if worker.is_alive():
            self._late = worker
            return self._nan(len(prompts), f"reward {self.name!r} did not score {batch} within reward.timeout_s="
                                           f"{self.timeout_s:g} s; scored NaN (dropped and counted)")
        return self._outcome(outcome, batch, len(prompts))

    def _outcome(self, outcome: dict, batch: str, n: int) -> dict:
        if "error" in outcome:
            error = outcome["error"]
            what = f"returned a wrong result on {batch}: {error}" if isinstance(error, RewardFault) else \
                f"raised on {batch}: {type(error).__name__}: {_first_line(error) or repr(error)}"
            text = f"reward {self.name!r} {what}"
            if self.on_error == "raise":
                raise RunStopped(f"{text} (reward.on_error=nan scores such a batch NaN and goes on)") from error
            return self._nan(n, f"{text}; scored NaN (reward.on_error=nan)")
        return outcome["result"]

    def _nan(self, n: int, message: str) -> dict[str, torch.Tensor]:
        print(f"flowalign: {message}", file=sys.stderr, flush=True)
        return {name: torch.full((n,), float("nan")) for name in self.nan_components}


class RewardFault(ValueError):
    """A reward call's result that is not one finite-or-NaN score per sample for each component."""


def checked_result(result, n: int, needed=()) -> dict:
    """``result`` as ``{component: Tensor [n]}``: a dict of 1-D numeric tensors (or lists) of length
    ``n``, no ±inf (NaN marks a sample the reward could not score), holding every ``needed``
    component. Integer and bool scores become float32; float tensors are kept as they are.
    RewardFault naming the component otherwise."""
    if not isinstance(result, dict) or not result:
        raise RewardFault(f"{type(result).__name__} {str(result)[:40]}, not a dict of scores per component")
    out = {}
    for name, value in result.items():
        try:
            scores = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise RewardFault(f"component {name!r} is {type(value).__name__}, not numbers") from None
        if scores.dtype.is_complex or not (scores.dtype.is_floating_point or scores.dtype in INTEGER_DTYPES):
            raise RewardFault(f"component {name!r} has dtype {scores.dtype}, not real numbers")
        if tuple(scores.shape) != (n,):
            raise RewardFault(f"component {name!r} has shape {list(scores.shape)}, expected [{n}]: one score per "
                              "sample")
        scores = scores if scores.dtype.is_floating_point else scores.float()
        if bool(torch.isinf(scores).any()):
            raise RewardFault(f"component {name!r} holds ±inf for {int(torch.isinf(scores).sum())} of {n} samples "
                              "(NaN marks a sample it cannot score)")
        out[name] = scores
    missing = [c for c in needed if c not in out]
    if missing:
        raise RewardFault(f"components {list(out)}, without {missing}, which reward.weights weights")
    return out


class NanEpochStreak:
    """Counts consecutive epochs whose every reward was NaN (``reward/mean`` NaN); ``limit`` of them
    raise RunStopped (0: never). ``finish`` raises when every epoch of the session was NaN: a run
    that trained on nothing does not end as if it had trained."""

    def __init__(self, limit: int, name: str = "?"):
        self.limit, self.count, self.name, self.epochs = limit, 0, name, 0

    def observe(self, stats: dict, epoch: int) -> None:
        self.epochs += 1
        self.count = self.count + 1 if math.isnan(stats["reward/mean"]) else 0
        if self.limit and self.count >= self.limit:
            raise RunStopped(f"every reward was NaN for {self.count} consecutive epochs (the last: epoch {epoch}; "
                             f"train.max_nan_epochs={self.limit}): reward {self.name!r} is failing, see its messages "
                             "above")

    def finish(self) -> None:
        if self.limit and self.epochs and self.count == self.epochs:  # limit 0: the user said never stop
            raise RunStopped(f"every reward was NaN in all {self.epochs} epoch(s) of this run: reward {self.name!r} "
                             "scored no sample, so nothing was trained and no final/ was written; see its messages "
                             "above")


def built_reward(name: str, kwargs: dict):
    """``build_reward(name, **kwargs)``, a failure of the reward's own constructor (a model it cannot
    open, a server it cannot reach) as one line naming the reward (ConfigError)."""
    from flowalign.errors import ConfigError
    from reward_models.base import MissingRewardPackage, build_reward

    try:
        return build_reward(name, **kwargs)
    except (ConfigError, MissingRewardPackage):
        raise
    except Exception as error:  # noqa: BLE001  (a plug-in's constructor raises whatever it raises)
        given = f" with reward.kwargs {kwargs}" if kwargs else ""
        raise ConfigError(f"reward {name!r} could not be built{given}: {type(error).__name__}: "
                          f"{_first_line(error)}") from None


WRITE_FAULTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EFBIG: "the file size limit is reached (ulimit -f)", errno.EROFS: "the file system is read-only",
                errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def describe_os_error(error: OSError) -> str:
    """One line: what failed, on which path (or address), and what it means."""
    where = error.filename or ""
    meaning = WRITE_FAULTS.get(error.errno) or error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        meaning = "the address (host:port) is in use by another process"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"{where}: {meaning} ({first})" if where else f"{meaning} ({first})"


@contextlib.contextmanager
def write_fault_at(path):
    """An OSError, or a writer's error whose chain holds one (safetensors reports ENOSPC in its
    message), re-raised as an OSError naming ``path``; other errors pass."""
    from flowalign.checkpoint import CheckpointError, _is_disk_full

    try:
        yield
    except OSError as error:
        if error.filename or error.errno not in WRITE_FAULTS:  # named already, or not a write fault
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from error
    except Exception as error:
        if not _is_disk_full(error) or isinstance(error, CheckpointError):  # it names its path and what is kept
            raise
        raise OSError(errno.ENOSPC, f"no space left while writing ({str(error).splitlines()[0]})", str(path)) from error


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
