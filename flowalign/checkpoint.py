"""Checkpoints: every stateful component of a run written generically, ``{name}`` → one file.

``checkpoints/epoch-NNNNNN/`` holds ``trained.safetensors`` (the trained weights), one file per
registered component (a ``state_dict`` of tensors → ``{name}.safetensors``, else
``{name}.pt``, ``weights_only``; a component may say ``checkpoint_format = "json"``), one file per
shard for per-shard components (``{name}-shard{s}.*``: random streams, prompt trackers), the
counters and a manifest of every file's size and SHA-256 in ``state.json``, and ``policy/`` (the evaluated
weights in the format of ``final/``). A new method registers its state under its name and adds
no checkpoint code.

Faults (docs/distributed.md): a checkpoint is written to ``epoch-N.tmp/``, renamed when complete,
and read and checked whole before any of it is applied; a full disk is named as such and leaves
the previous checkpoint untouched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from flowalign.errors import ConfigError
from flowalign.integrity import folder_sha256, sha256_mismatch
from flowalign.logs import get_logger
from flowalign.run_folder import changed_settings

log = get_logger("checkpoint")
CHECKPOINT_NAME = re.compile(r"epoch-(\d+)")  # complete checkpoints only: not *.tmp (being written), *.old (going)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the file."""


class ResumeMismatch(ConfigError):
    """The checkpoint was written by a run with other settings (or another process layout)."""


class DiskFullError(CheckpointError):
    """The disk (or the quota) filled up while a checkpoint was written; the previous one is untouched."""


def _format(component) -> str:
    declared = getattr(component, "checkpoint_format", None)
    if declared:
        return declared
    state = component.state_dict()
    return "safetensors" if state and all(isinstance(v, torch.Tensor) for v in state.values()) else "pt"


def _write(state, path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, path)
    elif fmt == "json":
        path.write_text(json.dumps(state))
    else:
        _torch_save(state, path)


def _read(path: Path, fmt: str):
    return {"safetensors": _read_safetensors, "json": _read_json, "pt": _read_torch}[fmt](path)


class Checkpointer:
    """Writes, finds, reads and applies checkpoints of the components registered with it.

    ``policy``: the trained weights (``trained_state_dict`` / ``load_trained_state_dict`` /
    ``save_trained``, i.e. the adapter); ``components``: name → object with ``state_dict`` /
    ``load_state_dict`` written by the main process (``per_process=True``: by every process, as
    ``{name}-rank{r}``: a sharded optimizer); ``shard_components``: name → object with
    ``shard_state(k)`` / ``load_shard_state(k, state)`` for this process's k-th shard."""

    def __init__(self, out: Path, dist, policy, model, keep: int):
        self.folder, self.dist, self.policy, self.model, self.keep = Path(out) / "checkpoints", dist, policy, model, keep
        self.settings: dict = {}  # the run's identity settings (flowalign/run_folder.py), checked on resume
        self.components: dict[str, tuple[object, bool]] = {}
        self.shard_components: dict[str, tuple[object, str]] = {}
        self.weights_swap = contextlib.nullcontext  # what policy/ is saved under (the EMA when on)

    def register(self, name: str, component, per_process: bool = False) -> None:
        self.components[name] = (component, per_process)

    def register_shards(self, name: str, component, fmt: str = "safetensors") -> None:
        self.shard_components[name] = (component, fmt)

    def _file(self, name: str, component, per_process: bool) -> str:
        suffix = f"-rank{self.dist.accelerator.process_index}" if per_process else ""
        return f"{name}{suffix}.{_format(component)}"

    # -- writing --------------------------------------------------------------------------
    def save(self, epoch: int, counters: dict) -> Path:
        """Write ``epoch-NNNNNN/`` atomically; refuses non-finite weights; a full disk raises
        DiskFullError and leaves the previous checkpoints as they were."""
        acc = self.dist.accelerator
        states = [self.policy.trained_state_dict()] + [c.state_dict() for c, _ in self.components.values()
                                                       if _format(c) == "safetensors"]
        bad = any(not torch.isfinite(v).all() for s in states for v in s.values() if v.is_floating_point())
        if self.dist.any(bad):
            raise CheckpointError(f"refusing to write checkpoint epoch-{epoch:06d}: the trained weights hold "
                                  "NaN/Inf (the non-finite guards should have skipped that step; please report it)")
        final = self.folder / f"epoch-{epoch:06d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            self._write_process_state(tmp)
            acc.wait_for_everyone()  # every process's files are in place before the manifest lists them
            with self.dist.full_params(self.model):
                if acc.is_main_process:
                    self._write_main_state(tmp, counters)
                acc.wait_for_everyone()
        except Exception as error:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            if _is_disk_full(error):
                previous = checkpoint_folders(self.folder)
                raise DiskFullError(
                    f"disk full while writing checkpoint {tmp} (free: {_free_mb(self.folder)} MB; {error}). The "
                    f"partial folder was removed; the previous checkpoint ({previous[-1] if previous else 'none'}) "
                    "is untouched. Free some space (or lower checkpoints_kept) and continue with resume=auto"
                ) from error
            raise
        if acc.is_main_process:
            _replace_folder(tmp, final)
            _fsync([final.parent])  # the rename itself
            self._prune()
        acc.wait_for_everyone()
        return final

    def _write_process_state(self, folder: Path) -> None:
        """What each process owns: its shards' states; per-process components (a sharded optimizer)."""
        for name, (component, fmt) in self.shard_components.items():
            for k, shard in enumerate(self.dist.shards):
                _write(component.shard_state(k), folder / f"{name}-shard{shard}.{fmt}", fmt)
        for name, (component, per_process) in self.components.items():
            if per_process:
                _write(component.state_dict(), folder / self._file(name, component, True), _format(component))

    def _write_main_state(self, folder: Path, counters: dict) -> None:
        acc = self.dist.accelerator
        _write(self.policy.trained_state_dict(), folder / "trained.safetensors", "safetensors")
        for name, (component, per_process) in self.components.items():
            if not per_process:
                _write(component.state_dict(), folder / self._file(name, component, False), _format(component))
        with self.weights_swap():
            self.policy.save_trained(folder / "policy")  # what grid/eval load, like final/
        state = {**counters, "num_processes": acc.num_processes, "rng_shards": self.dist.total_shards,
                 "settings": self.settings,
                 "files": {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                           if p.is_file()}, "sha256": folder_sha256(folder)}
        (folder / "state.json").write_text(json.dumps(state))
        _fsync([*sorted(p for p in folder.rglob("*") if p.is_file()), folder])  # data on disk before the rename

    def _prune(self) -> None:
        """Keep the newest ``keep``; remove what killed runs left behind (*.tmp, *.old)."""
        for old in checkpoint_folders(self.folder)[:-self.keep] if self.keep > 0 else []:
            _remove_folder(old)
        for stale in self.folder.glob("epoch-*"):
            if stale.suffix in (".tmp", ".old"):
                shutil.rmtree(stale, ignore_errors=True)

    # -- reading --------------------------------------------------------------------------
    def resume(self, resume: str) -> dict | None:
        """Continue from ``resume``: a checkpoint folder, or "auto": the newest checkpoint that every
        process reads completely; applies it and returns its counters (None: nothing to resume).
        With "auto", a newer checkpoint that cannot be read is reported and skipped (never
        deleted); if checkpoints exist but none can be read, CheckpointError."""
        if resume == "auto":
            candidates = checkpoint_folders(self.folder)[::-1]
            if not candidates:
                return None
        else:
            path = Path(resume)
            if not (path / "state.json").is_file():
                raise FileNotFoundError(f"no checkpoint at {path.resolve()} (expected state.json inside)")
            candidates = [path]
        reasons = []
        for path in candidates:
            try:
                loaded, error = self.read(path), None
            except CheckpointError as e:
                loaded, error = None, e
            if not self.dist.any(error is not None):  # all processes agree on one checkpoint
                counters = self.apply(loaded)
                log.info("resuming from %s (epoch %d)", path, counters["epoch"])  # main process only (logs.py)
                return counters
            if error is not None:
                print(f"flowalign: resume: skipping {path}: {error}", file=sys.stderr, flush=True)
            if resume != "auto":
                raise error or CheckpointError(f"{path}: another process could not read its part (see its message)")
            reasons.append(f"{path.name}: {error or 'another process could not read its part'}")
        raise CheckpointError(f"no readable checkpoint in {self.folder} ({'; '.join(reasons)}). Nothing "
                              "was deleted: move the broken folders away to start afresh, or set resume= to one")

    def read(self, path: Path) -> dict:
        """Everything this process needs from ``path``, read and checked before any of it is applied:
        the manifest's sizes and hashes, every safetensors header, every ``.pt`` (``weights_only``: tensors and
        plain containers, no pickled code), finite weights. Raises CheckpointError naming the file;
        ValueError when the checkpoint is fine but was written by another process layout."""
        path, acc = Path(path), self.dist.accelerator
        state = _read_json(path / "state.json")
        if not isinstance(state, dict) or not {"epoch", "history", "evals", "num_processes"} <= set(state):
            raise CheckpointError(f"{path / 'state.json'}: not a flowalign checkpoint state (epoch, history, evals, "
                                  "num_processes)")
        if (changed := changed_settings(state.get("settings") or _run_config(path), self.settings)):
            raise ResumeMismatch(f"resume: {path} was written with other settings ({'; '.join(changed)}); resume with "
                                 "the checkpoint's, or start a new run from its weights (model.init_lora="
                                 f"{path / 'policy'}) in another output_dir")
        if state["num_processes"] != acc.num_processes:
            raise ResumeMismatch(f"{path} was written by {state['num_processes']} processes; resume with the same "
                             f"number (got {acc.num_processes}) so every random stream continues")
        if state.get("rng_shards", state["num_processes"]) != self.dist.total_shards:
            raise ResumeMismatch(f"{path} was written with train.rng_shards={state.get('rng_shards')}; resume with the "
                             f"same (got {self.dist.total_shards}) so every random stream continues")
        for name, size in state.get("files", {}).items():  # checkpoints before the manifest have none
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)")
            if file.stat().st_size != size:
                raise CheckpointError(f"{file}: {file.stat().st_size} bytes, {size} when written (truncated or "
                                      "overwritten)")
        if (changed := sha256_mismatch(path, state.get("sha256", {}))) is not None:  # same size, other bytes
            raise CheckpointError(changed)
        # all on the CPU ("cpu:0", a multi-CPU run's device, is no map location): loading copies into place
        trained = _read_safetensors(path / "trained.safetensors")
        if not all(torch.isfinite(v).all() for v in trained.values()):
            raise CheckpointError(f"{path / 'trained.safetensors'}: holds NaN/Inf weights")
        expected = {} if self.dist.fsdp else {k: tuple(v.shape) for k, v in self.policy.trained_state_dict().items()}
        if expected and expected != {k: tuple(v.shape) for k, v in trained.items()}:
            raise CheckpointError(f"{path / 'trained.safetensors'}: its tensors do not fit this model (another "
                                  "model.lora_rank, lora_targets or model?)")
        components = {name: _read(path / self._file(name, c, per_process), _format(c))
                      for name, (c, per_process) in self.components.items()}
        shards = {name: [_read(_first_file(path / f"{name}-shard{s}.{fmt}", path / f"{name}-rank{s}.{fmt}"), fmt)
                         for s in self.dist.shards] for name, (_, fmt) in self.shard_components.items()}
        return {"state": state, "trained": trained, "components": components, "shards": shards}

    def apply(self, loaded: dict) -> dict:
        """Put a ``read`` checkpoint in place; returns its counters (epoch, history, evals)."""
        with self.dist.full_params(self.model, writeback=True):
            self.policy.load_trained_state_dict(loaded["trained"])
        for name, (component, _) in self.components.items():
            component.load_state_dict(loaded["components"][name])
        for name, (component, _) in self.shard_components.items():
            for k, state in enumerate(loaded["shards"][name]):
                component.load_shard_state(k, state)
        return loaded["state"]


def checkpoint_folders(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first (by epoch number, not by name)."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("epoch-*") if (m := CHECKPOINT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _replace_folder(src: Path, dst: Path) -> None:
    """Rename ``src`` onto ``dst``. An existing ``dst`` is first renamed aside to ``*.old``, so a
    crash at any moment leaves each folder either complete under its name or ignored."""
    if dst.exists():
        _remove_folder(dst, then=lambda: os.replace(src, dst))
    else:
        os.replace(src, dst)


def _remove_folder(path: Path, then=None) -> None:
    """Rename aside (``*.old``, atomic), run ``then``, delete: never a half-deleted checkpoint under its name."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    if then is not None:
        then()
    shutil.rmtree(old, ignore_errors=True)


def _fsync(paths: list[Path]) -> None:
    """Flush files and folders to disk, so that after a power loss a renamed checkpoint holds its
    data rather than empty files (which the manifest would catch, falling back one checkpoint)."""
    for path in paths:
        # a file's error counts (fsync may be where a full disk shows); a folder's is ignored, since
        # some systems cannot open or sync folders
        with contextlib.suppress(OSError) if path.is_dir() else contextlib.nullcontext():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122", "File too large",
                  "os error 27", "Read-only file system", "os error 30")


def _is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception chain, also where a writer reports it only in its
    message (safetensors' Rust writer: "... (os error 28)")."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS) \
                or any(text in str(error) for text in DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def _free_mb(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f}"
    except OSError:
        return "?"


@contextlib.contextmanager
def outputs_disk_full(out: Path):
    """A full disk while the run's outputs (final/, metrics.json, grids) are written raises
    DiskFullError, which says that the last checkpoint holds the run and resume=auto writes them."""
    try:
        yield
    except Exception as error:
        if not _is_disk_full(error):
            raise
        previous = checkpoint_folders(out / "checkpoints")
        raise DiskFullError(
            f"disk full while writing the run's outputs in {out} (final/, metrics.json, grids; free: {_free_mb(out)} "
            f"MB; {error}). The last checkpoint ({previous[-1] if previous else 'none'}) is complete: free some space "
            "and continue with resume=auto to write them") from error


def _torch_save(obj, path: Path) -> None:
    # through a Python file: a full disk then surfaces as OSError(ENOSPC) in the exception chain,
    # where torch.save(obj, path) reports only "unexpected pos"
    with open(path, "wb") as f:
        torch.save(obj, f)


def _run_config(checkpoint: Path) -> dict:
    """The identity settings of the run that wrote ``checkpoint`` (checkpoints/epoch-N/), from its
    config.json, for checkpoints written before state.json held them; {} when unknown."""
    from flowalign.run_folder import IDENTITY

    try:
        tree = json.loads((Path(checkpoint).parent.parent / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key in IDENTITY:
        value = tree
        for part in key.split("."):
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        if value is not KeyError:
            out[key] = value
    return out


def _first_file(*paths: Path) -> Path:
    return next((p for p in paths if p.is_file()), paths[0])


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)") from None
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: unreadable, not JSON ({error}); the file is corrupt") from error


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable safetensors file ({error}); it is truncated or corrupt") from error


def _read_torch(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: unreadable ({first_line}); it is truncated or corrupt, or holds more than "
                              "tensors and plain containers") from error


# for modules that save side files with the same guarantees (evaluation's per-sample rewards)
torch_save, read_torch = _torch_save, _read_torch
