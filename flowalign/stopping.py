"""Graceful stops: SIGTERM / SIGINT end a run after the epoch in progress, with a checkpoint."""

from __future__ import annotations

import signal
import sys
import threading


class GracefulStop:
    """While active, the first SIGTERM or SIGINT only sets ``requested`` (the signal's name): the
    loop finishes its epoch, checkpoints and returns. The old handlers come back at once, so a
    second signal acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM terminates). Handlers can
    only be installed from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        self._restore()
        print(f"flowalign: {self.requested} received: stopping after this epoch with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()
