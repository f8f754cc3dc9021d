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

from pathlib import Path

import yaml

from flowalign.errors import ConfigError


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
    api = HfApi(endpoint=endpoint, token=token)
    if (token or get_token()) is None:
        raise PushError("no hub token: log in with `hf auth login` or set HF_TOKEN (a token with write access)")
    operations = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card_for_repo(folder, repo_id).encode())]
    operations += [CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
                   for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / "README.md"]
    where = endpoint or api.endpoint
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
