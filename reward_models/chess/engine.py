"""A pool of long-lived Stockfish processes shared by threads.

Starting Stockfish costs ~0.1 s and a search of 10⁵ nodes costs ~0.2 s, so engines are started
once and reused. ``size`` engines wait in a queue; ``pool.engine()`` checks one out for a
sequence of searches (one puzzle's line: its searches share the hash table, and a fresh game id
clears it at checkout, so a line's result depends only on the line, not on what the engine saw
before). Searches are limited by nodes (deterministic with one thread) and capped in time.

Faults: a search whose engine dies, or hangs, kills and restarts that engine and runs the
search once more; when the retry fails too, ``EngineFailure`` is raised for the caller to score
the position NaN. The pool itself stays usable either way.

A hang is judged by what the engine process does, not by the wall clock alone, because on a
loaded machine a healthy engine can wait seconds for a core (``SearchWatch``): a search is hung
when the engine has used more CPU than its time cap plus ``grace``, or when for ``grace`` seconds
none of its threads ran or was waiting to run (stopped, deadlocked) while the answer did not
come; a starved but runnable engine is waited for, up to ``max_wait`` seconds. A fresh engine
gets ``startup_timeout`` seconds to load and answer ``isready`` (the readiness handshake), so
its first search starts from readiness, not from the process start.

>>> import chess
>>> with StockfishPool(size=1, limit=SearchLimit(nodes=20_000)) as pool:  # doctest: +SKIP
...     infos = pool.analyse(chess.Board(), multipv=2)
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import fcntl
import os
import queue
import shutil
import termios
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import chess
import chess.engine

DEFAULT_STOCKFISH = "/usr/games/stockfish"  # Debian/Ubuntu's package installs it off PATH
T = TypeVar("T")
R = TypeVar("R")


def find_stockfish() -> str | None:
    """$FLOWALIGN_STOCKFISH, else ``stockfish`` on PATH, else /usr/games/stockfish; None when none exists."""
    for candidate in (os.environ.get("FLOWALIGN_STOCKFISH"), shutil.which("stockfish"), DEFAULT_STOCKFISH):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass(frozen=True)
class SearchLimit:
    """One search's budget. ``nodes`` binds in normal operation (reproducible with Threads=1);
    ``time`` (seconds) is a safety cap: an engine that has used ``time + grace`` CPU seconds on
    one search counts as hung (``SearchWatch``)."""

    nodes: int | None = 200_000
    time: float = 10.0
    depth: int | None = None

    def to_engine(self) -> chess.engine.Limit:
        if not self.time or self.time <= 0:
            raise ValueError("SearchLimit.time must be > 0: it is what detects a hung engine")
        return chess.engine.Limit(nodes=self.nodes, time=self.time, depth=self.depth)


class EngineFailure(RuntimeError):
    """A search failed twice (engine crashed or hung, was restarted, and failed again)."""


# What a dead or hung engine raises through python-chess (asyncio.TimeoutError is TimeoutError since
# 3.11). A search on an engine killed between two searches is cancelled when its event loop shuts down.
_ENGINE_ERRORS = (chess.engine.EngineError, chess.engine.EngineTerminatedError, asyncio.TimeoutError,
                  TimeoutError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError,
                  asyncio.CancelledError, BrokenPipeError, ConnectionError)


def _proc_cpu_and_runnable(pid: int) -> tuple[float, bool] | None:
    """(CPU seconds used by process ``pid``, whether any of its threads is running or runnable),
    from /proc; None where /proc cannot tell (not Linux, process gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads
        runnable = False
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                runnable |= f.read().rsplit(")", 1)[1].split()[0] == "R"
        return cpu, runnable
    except (OSError, ValueError, IndexError):
        return None


def _unread_output(engine: chess.engine.SimpleEngine) -> bool:
    """The engine has written output that this process has not read yet (its answer may be waiting
    for our own starved event loop, so the engine is not hung)."""
    try:
        pipe = engine.transport.get_pipe_transport(1).get_extra_info("pipe")
        count = array.array("i", [0])
        fcntl.ioctl(pipe.fileno(), termios.FIONREAD, count)
        return count[0] > 0
    except (AttributeError, OSError, ValueError):
        return False


class SearchWatch:
    """Decides when a running search counts as hung (see the module docstring).

    ``budget`` = time cap + grace, in CPU seconds of the engine; ``idle`` = grace, in wall seconds
    with no thread of the engine runnable and no CPU used; ``max_wait`` = the wall-clock backstop.
    Without /proc it falls back to the wall clock: hung after ``budget`` seconds.
    """

    def __init__(self, pid: int, budget: float, idle: float, max_wait: float,
                 answered: Callable[[], bool] = lambda: False):
        self.pid, self.budget, self.idle, self.max_wait, self.answered = pid, budget, idle, max_wait, answered
        self.start = self.last_progress = time.monotonic()
        first = _proc_cpu_and_runnable(pid)
        self.cpu0 = self.cpu = first[0] if first else None

    def hung(self) -> str | None:
        """None while the search may still finish; else why it is hung."""
        now = time.monotonic()
        if now - self.start > self.max_wait:
            return f"no answer after {self.max_wait:.0f} s"
        sample = _proc_cpu_and_runnable(self.pid) if self.cpu0 is not None else None
        if sample is None:
            return f"no answer after {now - self.start:.1f} s" if now - self.start > self.budget else None
        cpu, runnable = sample
        if cpu > self.cpu or runnable or self.answered():
            self.cpu, self.last_progress = cpu, now
        if cpu - self.cpu0 > self.budget:
            return f"used {cpu - self.cpu0:.1f} CPU s, over its {self.budget:.1f} s"
        if now - self.last_progress > self.idle:
            return f"idle (not running, no CPU) for {now - self.last_progress:.1f} s"
        return None


class EngineHandle:
    """One checked-out engine. ``analyse`` restarts it and retries once on a crash or hang."""

    def __init__(self, pool: "StockfishPool", slot: int):
        self._pool, self.slot = pool, slot
        self._game = object()  # new game id → python-chess sends ucinewgame before the first search

    @property
    def limit(self) -> SearchLimit:
        """The pool's default search limit (``analyse(limit=...)`` overrides it per search)."""
        return self._pool.limit

    @property
    def pid(self) -> int:
        return self._pool._engines[self.slot].transport.get_pid()

    def analyse(self, board: chess.Board, multipv: int = 1, limit: SearchLimit | None = None) -> list[dict]:
        """Search ``board``. Returns python-chess InfoDicts, best line first (``len ≤ multipv``:
        fewer when there are fewer legal moves), each with "score" (PovScore) and "pv"."""
        engine_limit = (limit or self._pool.limit).to_engine()
        info = chess.engine.INFO_SCORE | chess.engine.INFO_PV
        error: BaseException | None = None
        for _ in range(2):
            engine = self._pool._engines[self.slot]
            try:
                return self._pool._watched_analyse(engine, board, engine_limit, multipv, self._game, info)
            except _ENGINE_ERRORS as exc:
                error = exc
                try:
                    self._pool._restart(self.slot)
                except Exception as restart_error:  # binary gone, pool closed, …: still a failed search
                    raise EngineFailure(f"Stockfish failed ({exc!r}) and could not be restarted: "
                                        f"{restart_error}") from restart_error
                self._game = object()
        raise EngineFailure(f"Stockfish failed twice on {board.fen()} "
                            f"({type(error).__name__}: {error or 'no message'}); engine restarted")


class StockfishPool:
    """``size`` Stockfish processes, each with ``threads`` search threads and ``hash_mb`` of hash.

    Thread-safe: any number of threads may call ``engine()`` / ``analyse()`` / ``map()``; each
    engine serves one checkout at a time. Close with ``close()`` or a ``with`` block.
    """

    def __init__(self, size: int = 1, limit: SearchLimit = SearchLimit(), path: str | None = None,
                 threads: int = 1, hash_mb: int = 16, grace: float = 5.0, startup_timeout: float = 60.0,
                 max_wait: float = 120.0):
        if size < 1:
            raise ValueError(f"StockfishPool size must be ≥ 1, got {size}")
        self.path = path or find_stockfish()
        if self.path is None:
            raise FileNotFoundError(f"no Stockfish binary: install it (apt-get install stockfish puts it at "
                                    f"{DEFAULT_STOCKFISH}) or set $FLOWALIGN_STOCKFISH")
        self.size, self.limit, self.grace = size, limit, grace
        self.startup_timeout, self.max_wait = startup_timeout, max_wait
        self.restart_reasons: list[str] = []  # why each hung search was given up (diagnostics, tests)
        self._options = {"Threads": threads, "Hash": hash_mb}
        self._lock = threading.Lock()
        self._closed = False
        self._engines: list[chess.engine.SimpleEngine] = []
        try:
            for _ in range(size):
                self._engines.append(self._start())
        except BaseException:
            self.close()
            raise
        # the engine's UCI ``id name`` ("Stockfish 15.1"): scores' units depend on the version (uniqueness.generator_units)
        self.name: str = self._engines[0].id.get("name", "?")
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(size):
            self._free.put(slot)

    def _start(self) -> chess.engine.SimpleEngine:
        # Start-up (loading the network, allocating the hash) gets its own deadline and ends with the
        # readiness handshake, so a search's deadline never includes it.
        engine = chess.engine.SimpleEngine.popen_uci(self.path, timeout=self.startup_timeout)
        try:
            engine.configure(self._options)
            engine.ping()  # isready → readyok: the engine has applied the options and is idle
        except BaseException:
            engine.close()
            raise
        return engine

    def _watched_analyse(self, engine: chess.engine.SimpleEngine, board: chess.Board, limit: chess.engine.Limit,
                         multipv: int, game: object, info: chess.engine.Info) -> list[dict]:
        """``engine.analyse`` with ``SearchWatch`` as its deadline instead of python-chess's wall clock."""
        if engine.protocol.loop.is_closed() or engine.returncode.done():
            raise chess.engine.EngineTerminatedError("engine process is gone (its event loop has closed)")
        coro = engine.protocol.analyse(board, limit, multipv=multipv, game=game, info=info)
        try:
            future = asyncio.run_coroutine_threadsafe(coro, engine.protocol.loop)
        except RuntimeError as exc:  # the loop closed between the check and the call: the engine died
            coro.close()
            raise chess.engine.EngineTerminatedError(f"engine process is gone ({exc})") from exc
        watch = SearchWatch(engine.transport.get_pid(), budget=limit.time + self.grace, idle=self.grace,
                            max_wait=max(self.max_wait, limit.time + self.grace),
                            answered=lambda: _unread_output(engine))
        poll = min(0.05, self.grace / 5)
        while True:
            try:
                return future.result(timeout=poll)
            except concurrent.futures.TimeoutError:
                if why := watch.hung():
                    future.cancel()
                    self.restart_reasons.append(why)
                    raise TimeoutError(f"Stockfish search hung: {why}") from None

    def _restart(self, slot: int) -> None:
        with self._lock:
            if self._closed:
                raise EngineFailure("StockfishPool was closed while a search was running")
            self._engines[slot].close()  # closes the transport, which kills the process (a hung one too)
            self._engines[slot] = self._start()

    def pids(self) -> list[int]:
        """Process ids of the current engines, by slot (they change when an engine is restarted)."""
        with self._lock:
            return [e.transport.get_pid() for e in self._engines]

    @contextmanager
    def engine(self) -> Iterator[EngineHandle]:
        """Check out one engine for a sequence of searches (blocks until one is free)."""
        if self._closed:
            raise RuntimeError("StockfishPool is closed")
        slot = self._free.get()
        try:
            yield EngineHandle(self, slot)
        finally:
            self._free.put(slot)

    def analyse(self, board: chess.Board, multipv: int = 1, limit: SearchLimit | None = None) -> list[dict]:
        """One search on any free engine (see ``EngineHandle.analyse``)."""
        with self.engine() as handle:
            return handle.analyse(board, multipv, limit)

    def map(self, fn: Callable[[EngineHandle, T], R], items: Iterable[T]) -> list[R]:
        """``[fn(handle, item) for item in items]``, spread over the pool's engines, in order."""
        items = list(items)

        def run(item):
            with self.engine() as handle:
                return fn(handle, item)

        if self.size == 1 or len(items) <= 1:
            return [run(item) for item in items]
        with concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="stockfish-pool") as ex:
            return list(ex.map(run, items))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for engine in self._engines:
                engine.close()

    def __enter__(self) -> "StockfishPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
