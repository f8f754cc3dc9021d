"""Upload a finished run's ``final/`` to a Hugging Face hub repository: ``flowalign push`` and
``flowalign.push(...)``. One commit (huggingface_hub's ``create_commit``; large files such as
``.safetensors`` go through the hub's LFS upload as ``upload_folder`` sends them). The model
card is rewritten for the repository on the way: its snippet loads the weights from the repo
instead of the local folder, and a ``base_model`` that names no hub repository (a built-in demo
model) is left out of its front matter, which the hub would refuse.

``endpoint`` (default: huggingface_hub's, ``HF_ENDPOINT``) and ``token`` (default: ``HF_TOKEN`` or
``hf auth login``'s) are huggingface_hub's own settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from flowalign.errors import ConfigError


@dataclass
class HubConfig:
    """``hub:``: push the run to a Hugging Face hub repository while and after it trains."""

    repo: Optional[str] = None  # owner/name; None: no push (`flowalign push RUN --repo ...` still can, later)
    strategy: str = "end"  # end: final/ when the run finishes | checkpoint: also each checkpoint's policy/
    private: bool = False  # create the repository private


class PushError(ConfigError):
    """A push that cannot go: no finished run, no token, the hub unreachable or refusing."""


def _final(run) -> Path:
    folder = Path(run) / "final"
    if not (folder / "README.md").is_file():
        raise PushError(f"{folder}: no final/README.md; push a finished run's folder (one that "
                        "`flowalign train` ran to the end)")
    return folder


def card_for_repo(folder: Path, repo_id: str) -> str:
    """``folder/README.md`` with the snippet's weights location set to ``repo_id``."""
    from flowalign.model_card import CONFIG_FILE, base_kind, retarget

    config = yaml.safe_load((folder / CONFIG_FILE).read_text()) if (folder / CONFIG_FILE).is_file() else {}
    local = str(Path(config.get("output_dir", ".")) / "final")
    base = (config.get("model") or {}).get("path", "")
    return retarget(folder / "README.md", local, repo_id, keep_base_model=base_kind(base) == "hub")


def push(run, repo_id: str, *, private: bool = False, endpoint: str | None = None, token: str | None = None,
         message: str | None = None):
    """Upload ``run``/final (weights, model card, grid, run config) to ``repo_id``, creating the
    repository if needed. Returns huggingface_hub's CommitInfo; raises PushError (one line) when
    there is no token, the hub cannot be reached or it refuses."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    folder = _final(run)
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT"), token=token)  # HF_ENDPOINT read now, not at import
    if (token or get_token()) is None:
        raise PushError("no hub token: log in with `hf auth login` or set HF_TOKEN (a token with write access)")
    operations = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card_for_repo(folder, repo_id).encode())]
    operations += [CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
                   for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / "README.md"]
    where = api.endpoint
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.create_commit(repo_id, operations, commit_message=message or f"flowalign: {Path(run).resolve().name}")
    except HfHubHTTPError as error:  # no rights, a refused card, the hub down
        raise PushError(f"pushing {folder} to {repo_id} failed: {str(error).splitlines()[0]}") from None
    except (*_transport_errors(), OSError) as error:
        raise PushError(f"pushing {folder} to {repo_id} failed: the hub at {where} cannot be reached "
                        f"({type(error).__name__}); check the network or HF_ENDPOINT") from None


def _transport_errors() -> tuple[type, ...]:
    """The connection errors of the HTTP clients huggingface_hub may use (by version)."""
    import importlib

    found = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


# -- during training: hub.repo / hub.strategy ---------------------------------------------------
def check_hub(config) -> None:
    """``hub.repo`` is owner/name and a token is there, before any model loads (a run that could not
    push at its end would say so only after training)."""
    import re

    from huggingface_hub import get_token

    from flowalign.config import source_of

    repo = config.hub.repo
    if repo is None:
        return
    where = source_of(config, "hub.repo")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise ConfigError(f"{where}: hub.repo must be owner/name, got {repo!r}")
    if get_token() is None:
        raise ConfigError(f"{where}: hub.repo is {repo!r} but there is no hub token: log in with `hf auth login` "
                          "or set HF_TOKEN (a token with write access), or remove hub.repo")


def push_folder(folder: Path, repo_id: str, path_in_repo: str, message: str, private: bool = False):
    """Upload ``folder``'s files under ``path_in_repo`` of ``repo_id`` in one commit (PushError)."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    operations = [CommitOperationAdd(path_in_repo=f"{path_in_repo}/{p.relative_to(folder).as_posix()}".lstrip("/"),
                                     path_or_fileobj=str(p)) for p in sorted(folder.rglob("*")) if p.is_file()]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.create_commit(repo_id, operations, commit_message=message)
    except HfHubHTTPError as error:
        raise PushError(f"pushing {folder} to {repo_id} failed: {str(error).splitlines()[0]}") from None
    except (*_transport_errors(), OSError) as error:
        raise PushError(f"pushing {folder} to {repo_id} failed: the hub at {api.endpoint} cannot be reached "
                        f"({type(error).__name__})") from None


def push_during_training(config, out: Path, checkpoint: Path | None, log) -> None:
    """What ``hub.strategy`` pushes now: a checkpoint's ``policy/`` (strategy checkpoint) under
    ``checkpoint-<epoch>/``, or (``checkpoint`` None: the run finished) ``final/`` as
    ``flowalign push`` does. A failure is one warning line: the run and its files are kept."""
    h = config.hub
    if h.repo is None or (checkpoint is not None and h.strategy != "checkpoint"):
        return
    try:
        if checkpoint is None:
            push(out, h.repo, private=h.private)
            log.info("pushed %s/final to the hub repository %s", out, h.repo)
        elif (checkpoint / "policy").is_dir():
            push_folder(checkpoint / "policy", h.repo, checkpoint.name, f"flowalign: {checkpoint.name}", h.private)
            log.info("pushed %s to the hub repository %s", checkpoint.name, h.repo)
    except PushError as error:
        log.warning("%s; the run goes on (push later: flowalign push %s --repo %s)", error, out, h.repo)
