"""flowalign's run messages go through the standard ``logging`` module, under the logger
``flowalign`` (``flowalign.trainer``, ``flowalign.evaluator``, ``flowalign.checkpoint``), at INFO.

When a run starts and no handler would receive them (neither the ``flowalign`` logger nor the root
logger has one: a plain script or notebook), one is added to the ``flowalign`` logger that writes
each message through ``tqdm.write`` to stdout (progress bars stay whole), on Accelerate's main
process only. An application that configures logging (``logging.basicConfig(level=logging.INFO)``,
or a handler on ``flowalign``) gets the messages through its own handlers instead. To silence them:
``logging.getLogger("flowalign").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging

ROOT = "flowalign"


class TqdmHandler(logging.Handler):
    """Writes a record's message with ``tqdm.write``, so it never breaks a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record))
        except Exception:  # noqa: BLE001  (logging's own convention: report, never raise)
            self.handleError(record)


class MainProcessOnly(logging.Filter):
    """Passes records on Accelerate's main process only (every record where no run was set up)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from accelerate.state import PartialState

        return not PartialState._shared_state or PartialState().is_main_process


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}")


def add_default_handler() -> None:
    """The stdout handler described above, unless some handler already receives the messages."""
    logger = logging.getLogger(ROOT)
    if logger.hasHandlers():  # ours from an earlier run, the user's, or the root logger's
        return
    handler = TqdmHandler()
    handler.addFilter(MainProcessOnly())
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
