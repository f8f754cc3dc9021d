"""Content hashes of a checkpoint's files.

The manifest in ``state.json`` lists every file's size, which catches a truncated or half-written
file; a flipped byte inside tensor data keeps the size and the safetensors header, so it is caught
only by the content: ``state.json`` also holds each file's SHA-256 (``"sha256": {name: hex}``),
written with the checkpoint and checked before any of it is applied on resume. Checkpoints written
before the hashes have none and are checked by size only. Cost: docs/faults.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_sha256(folder: Path) -> dict[str, str]:
    """{path relative to ``folder``: SHA-256} of every file under ``folder``, sorted."""
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def sha256_mismatch(folder: Path, expected: dict[str, str]) -> str | None:
    """The first file of ``expected`` whose content no longer hashes as written (a message naming
    it), or None when all match. Missing files are the size check's to report."""
    for name, digest in expected.items():
        path = folder / name
        if path.is_file() and file_sha256(path) != digest:
            return (f"{path}: content differs from when it was written (SHA-256 {file_sha256(path)[:12]}…, "
                    f"{digest[:12]}… in the manifest): the file is corrupt")
    return None
