"""The wheel installs three top-level packages side by side: ``flowalign``, ``pipelines`` (model
adapters) and ``reward_models``. The last two are common names: another installed package, or a
folder in the working directory (first on ``sys.path`` under ``python -m`` and in notebooks), can
hide ours, and the failure would surface far away (an ImportError or AttributeError deep inside a
run). ``import flowalign`` therefore checks, without importing them, that both resolve to the
folder that holds ``flowalign`` and says which file hides ours when not (docs/install.md). Every
command and the Python API import flowalign first; ``pipelines`` and ``reward_models`` import
nothing of flowalign (the layering rule), so importing one of them alone is not checked.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SIBLINGS = ("pipelines", "reward_models")


class ShadowedPackageError(ImportError):
    """``pipelines`` or ``reward_models`` resolves to another package than flowalign's own."""


def _origin(name: str) -> str | None:
    """The file ``import name`` loads (or has loaded), without importing it; None when not found."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations or []),
                                                                          None)


def check_siblings(home: Path) -> None:
    """Raise ShadowedPackageError when ``pipelines`` or ``reward_models`` is not the package in
    ``home`` (the folder that holds flowalign). A name that is not found at all is left to the
    import that needs it."""
    for name in SIBLINGS:
        ours = home / name
        origin = _origin(name)
        if origin is None or Path(origin).resolve().is_relative_to(ours.resolve()):
            continue
        raise ShadowedPackageError(
            f"another {name!r} hides flowalign's: `import {name}` loads {origin}, but flowalign's is {ours}. "
            f"flowalign installs three top-level packages (flowalign, pipelines, reward_models); a package or "
            f"a folder named {name} earlier on sys.path (the working directory comes first under python -m and "
            f"in notebooks) takes the name. Rename or move the other one, or start Python elsewhere "
            f"(docs/install.md, 'Top-level names').")
