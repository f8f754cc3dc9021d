"""A reward served over HTTP, and the client reward that calls it.

Why: big reward models (VLMs, OCR engines) live on their own GPU or machine and are shared by
many training processes. The wire format is JSON with the samples as base64 strings in one of three
formats, never pickle (``np.load`` runs with ``allow_pickle=False``; the request size is bounded
before anything is parsed):

- ``uint8``: each image an NPY array uint8 [3, H, W], ``round(x · 255)``: the same pixels as PNG
  (the 8 bits an image file keeps), without PNG's compression, which costs more time than the
  bytes it saves on a local link (docs/rewards.md measures both). The default for a server on
  the same machine (127.0.0.1, localhost, ::1).
- ``png``: the same uint8 pixels, compressed: fewer bytes for a server across a network (the
  default there).
- ``npy``: any float array [B, ...] (video, audio, values outside [0, 1]), float32.

Server (``flowalign reward-server --reward NAME``): binds 127.0.0.1 unless told otherwise;
``GET /health`` answers ``{"status": "ok", "reward": NAME, "components": [...]}``;
``POST /score`` takes ``{"format": "uint8"|"png"|"npy", "samples": [...], "prompts": [...],
"metadata": [...]}`` and answers ``{"components": {name: [B floats]}}`` (NaN as null). Requests
that arrive together are merged into one reward call of at most ``max_batch`` samples (dynamic
batching), so many small clients still use the model's batch.

Bounds, so that one client cannot take the server's memory or its time from the others: the
request body (``max_payload`` bytes, checked against ``Content-Length`` before any byte is read; a
negative or missing length is refused unread), the decoded pixels of one sample and of one request
(``max_image_pixels``, ``max_request_pixels``, read from each PNG's header or NPY's shape before
decoding; 413 naming the bound), the pixels of one reward call across merged requests
(``max_batch_pixels``), the time to send the body and to score it (``timeout_s``: 408, 503), the
time for a whole request head and for a silent connection (``idle_timeout_s``: a client dribbling
its headers is cut then, by one reaper thread), and the open connections (``max_connections``: a
fixed pool of that many worker threads, started once and reused, serves them; past it 503 at once,
with an accept queue of BACKLOG). A malformed field answers 400
naming it; so does a request on which the reward raises an input error (KeyError, TypeError,
ValueError, IndexError) alone or while the requests merged with it were scored: one bad request
never fails the others. ``token``: every request needs ``Authorization: Bearer TOKEN`` (401);
``flowalign reward-server`` requires one when binding beyond loopback.

Client (reward name ``remote``): ``reward.name=remote reward.kwargs={url: http://host:port}``.
Each call has a timeout and is retried with exponential backoff; when the server stays
unreachable the batch is scored NaN, which the trainer drops and counts, so a crashed server
costs samples, not the run. The client keeps its HTTP/1.1 connections open across calls
(keep-alive: no TCP handshake and no server thread start per batch); a connection the server has
closed meanwhile (its idle timeout, a restart) is replaced at once and the request sent again on
the new one, without counting as a failed try.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import os
import queue
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import torch
from PIL import Image

from reward_models.base import Reward, register_reward

log = logging.getLogger(__name__)
DEFAULT_MAX_PAYLOAD = 64 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 2**22  # 2048 × 2048 per sample (an NPY sample: its values / 3)
DEFAULT_MAX_REQUEST_PIXELS = 2**24  # 16 samples of 1024 × 1024 per request (the client splits larger batches)
DEFAULT_MAX_CONNECTIONS = 2048  # open connections (a thread each); more are answered 503 at once and closed
BACKLOG = 1024  # connections the kernel queues before the server accepts them (socketserver's default: 5)
DEFAULT_TIMEOUT_S = 300.0  # to receive a request's body, and to score it
DEFAULT_IDLE_TIMEOUT_S = 30.0  # a connection silent this long is closed
FORMATS = ("uint8", "png", "npy")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # a server here: uint8 by default, else png


# --------------------------------------------------------------------------- encoding


def to_uint8(samples: torch.Tensor) -> torch.Tensor:
    """float [B, 3, H, W] in [0, 1] → uint8 [B, 3, H, W], round(x · 255): what an 8-bit image keeps."""
    return (samples.detach().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def encode_samples(samples: torch.Tensor, fmt: str = "png") -> list[str]:
    """samples float [B, 3, H, W] in [0, 1] (uint8, png) or any float [B, ...] (npy) → B base64
    strings (the formats: the module docstring)."""
    if fmt == "uint8":
        return [base64.b64encode(_npy_bytes(array)).decode() for array in to_uint8(samples).numpy()]
    if fmt == "png":
        out = []
        for array in to_uint8(samples).permute(0, 2, 3, 1).numpy():
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="PNG")
            out.append(base64.b64encode(buffer.getvalue()).decode())
        return out
    if fmt == "npy":
        return [base64.b64encode(_npy_bytes(array)).decode() for array in samples.detach().float().cpu().numpy()]
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


class TooLarge(ValueError):
    """A request over one of the server's bounds (answered 413, naming it)."""


def npy_header(item: bytes) -> tuple[tuple[int, ...], np.dtype]:
    """An NPY file's shape and dtype, from its header alone (nothing decoded, nothing allocated)."""
    buffer = io.BytesIO(item)
    major, _ = np.lib.format.read_magic(buffer)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(buffer)
    return shape, dtype


def sample_pixels(item: bytes, fmt: str) -> int:
    """Pixels one encoded sample decodes to, read from its header only: a PNG's width × height, an
    NPY array's values / 3 (RGB). A ``uint8`` sample must be uint8 [3, H, W] (ValueError otherwise)."""
    if fmt == "png":
        width, height = Image.open(io.BytesIO(item)).size  # lazy: the header, not the pixels
        return width * height
    shape, dtype = npy_header(item)
    if fmt == "uint8" and (dtype != np.uint8 or len(shape) != 3 or shape[0] != 3):
        raise ValueError(f"format uint8 needs uint8 arrays of shape [3, H, W], got {dtype} {list(shape)}")
    return int(np.prod(shape, dtype=np.int64)) // 3


def check_pixels(items: list[bytes], fmt: str, max_image: int, max_request: int) -> None:
    """TooLarge when a sample or the request would decode to more than its bound of pixels."""
    total = 0
    for k, item in enumerate(items):
        pixels = sample_pixels(item, fmt)
        if pixels > max_image:
            raise TooLarge(f"samples[{k}] decodes to {pixels} pixels, above the server's bound of {max_image} per "
                           "sample (--max-image-pixels)")
        total += pixels
    if total > max_request:
        raise TooLarge(f"the request decodes to {total} pixels, above the server's bound of {max_request} per "
                       "request (--max-request-pixels): send fewer samples per request")


def decode_samples(items: list[str], fmt: str) -> torch.Tensor:
    """Inverse of ``encode_samples``: float [B, 3, H, W] in [0, 1] (uint8, png; exactly
    ``to_uint8(x) / 255`` of the sent x) or float [B, ...] (npy)."""
    raw = [s if isinstance(s, bytes) else base64.b64decode(s) for s in items]  # the server passes them decoded
    if fmt == "png":
        arrays = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in raw]
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255
    if fmt == "uint8":
        arrays = [np.load(io.BytesIO(b), allow_pickle=False) for b in raw]
        if any(a.dtype != np.uint8 or a.ndim != 3 or a.shape[0] != 3 for a in arrays):
            raise ValueError("format uint8 needs uint8 arrays of shape [3, H, W]")
        return torch.from_numpy(np.stack(arrays)).float() / 255
    if fmt == "npy":
        arrays = [np.load(io.BytesIO(b), allow_pickle=False) for b in raw]
        return torch.from_numpy(np.stack(arrays)).float()
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def parse_request(body: bytes, max_image: int, max_request: int) -> tuple[torch.Tensor, list[str], list[dict]]:
    """A /score body → (samples, prompts, metadata). ValueError naming the malformed field;
    TooLarge before decoding when the pixels exceed a bound."""
    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object with samples, prompts and metadata")
    fmt = request.get("format", "png")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    samples, prompts = request.get("samples"), request.get("prompts")
    metadata = request.get("metadata")
    if not isinstance(samples, list) or not all(isinstance(s, str) for s in samples):
        raise ValueError("samples must be a list of base64 strings")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of strings")
    metadata = [{} for _ in prompts] if metadata is None else metadata
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("metadata must be a list of objects (or null)")
    if not (len(samples) == len(prompts) == len(metadata)):
        raise ValueError(f"samples, prompts and metadata differ in length: {len(samples)}, {len(prompts)}, "
                         f"{len(metadata)}")
    name = {"uint8": "uint8 NPY"}.get(fmt, fmt.upper())
    try:
        raw = [base64.b64decode(s, validate=True) for s in samples]
        check_pixels(raw, fmt, max_image, max_request)
        decoded = decode_samples(raw, fmt)  # within bounds now; a truncated array fails here
    except TooLarge:
        raise
    except Exception as error:  # noqa: BLE001  (binascii, PIL and numpy each raise their own)
        raise ValueError(f"samples: not base64 {name} ({type(error).__name__}: {error})") from None
    return decoded, prompts, metadata


# --------------------------------------------------------------------------- server


def _pixels(job: dict) -> int:
    samples = job["samples"]
    return int(samples[0].numel() // 3) * len(samples) if len(samples) else 0


# a reward call raising one of these on a request alone is that request's fault (400, not retried); any
# other exception (a CUDA error, a RuntimeError) is the server's (500, retried by the client)
INPUT_ERRORS = (KeyError, TypeError, ValueError, IndexError)


class RequestFailed(ValueError):
    """The reward raised on this request alone (scored apart from the others of its batch): answered 422."""


class _Batcher:
    """One worker thread that merges queued requests into reward calls of ≤ max_batch samples."""

    def __init__(self, reward: Reward, max_batch: int, max_batch_pixels: int | None = None):
        self.reward, self.max_batch, self.max_batch_pixels = reward, max_batch, max_batch_pixels
        self.requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict],
              timeout: float | None = None) -> dict:
        """The scores of one request; TimeoutError when not done within ``timeout`` seconds (a job
        not yet started by then is dropped, never scored for a client that is gone)."""
        done = threading.Event()
        job = {"samples": samples, "prompts": prompts, "metadata": metadata, "done": done}
        self.requests.put(job)
        if not done.wait(timeout):
            job["abandoned"] = True
            raise TimeoutError(f"not scored within {timeout:g} s (--timeout-s)")
        if "error" in job:
            raise job["error"]
        return job["result"]

    def _work(self) -> None:
        while True:
            jobs = [self.requests.get()]
            if jobs[0].get("abandoned"):
                continue
            size, pixels = len(jobs[0]["prompts"]), _pixels(jobs[0])
            while size < self.max_batch:
                try:
                    job = self.requests.get_nowait()
                except queue.Empty:
                    break
                if job.get("abandoned"):
                    continue
                if size + len(job["prompts"]) > self.max_batch or self.max_batch_pixels is not None \
                        and pixels + _pixels(job) > self.max_batch_pixels:
                    self.requests.put(job)  # goes into the next call
                    break
                jobs.append(job)
                size, pixels = size + len(job["prompts"]), pixels + _pixels(job)
            self._run(jobs)

    def _run(self, jobs: list[dict]) -> None:
        if len({tuple(j["samples"].shape[1:]) for j in jobs}) > 1:  # sizes differ: one tensor cannot hold them
            for job in jobs:
                self._run([job])
            return
        try:
            result = self.reward(torch.cat([j["samples"] for j in jobs]),
                                 [p for j in jobs for p in j["prompts"]], [m for j in jobs for m in j["metadata"]])
            lo = 0
            for job in jobs:
                n = len(job["prompts"])
                job["result"] = {k: torch.as_tensor(v, dtype=torch.float32)[lo:lo + n].tolist()
                                 for k, v in result.items()}
                lo += n
        except Exception as error:  # noqa: BLE001
            if len(jobs) > 1:  # one request's content may be what failed: score each alone, so only it fails
                for job in jobs:
                    job.pop("result", None)
                    self._run([job])
                if any("result" in job for job in jobs):  # the others scored: the failed ones' content is at fault
                    for job in jobs:
                        if "error" in job:
                            e = job["error"]
                            job["error"] = RequestFailed(f"the reward failed on this request's samples or metadata "
                                                         f"(the requests batched with it were scored): "
                                                         f"{type(e).__name__}: {e}")
                return
            jobs[0]["error"] = error
        for job in jobs:
            job["done"].set()


def make_server(reward: Reward, name: str, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                max_payload: int = DEFAULT_MAX_PAYLOAD, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS, timeout_s: float = DEFAULT_TIMEOUT_S,
                idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, token: str | None = None,
                max_connections: int = DEFAULT_MAX_CONNECTIONS,
                max_batch_pixels: int | None = None) -> HTTPServer:
    """A ready-to-serve HTTP server (``server.serve_forever()``); port 0 picks a free port
    (``server.server_address``). The bounds: the module docstring. ``token``: every request must
    carry ``Authorization: Bearer TOKEN`` (401 otherwise). ``max_batch_pixels``: the pixels one
    reward call may hold across merged requests (default: ``max_request_pixels``)."""
    batcher = _Batcher(reward, max_batch, max_batch_pixels or max_request_pixels)
    components = list(getattr(reward, "components", ()))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # an answer goes out as two writes (headers, body): with Nagle's algorithm on, the second waits
        # for the client's delayed ACK of the first (~40 ms) on a kept-alive connection
        disable_nagle_algorithm = True
        timeout = idle_timeout_s  # per socket read: an idle or stalled connection is closed, its thread ends

        def log_message(self, fmt, *args):  # quiet by default; errors are answered, not printed
            log.debug(fmt, *args)

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:  # the body was left unread: tell a keep-alive client not to reuse this one
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def parse_request(self):  # the request line and headers are in: the head deadline is met
            ok = super().parse_request()
            server.reaper.cancel(self.connection)
            return ok

        def handle_one_request(self):
            # the whole head (request line and headers) within idle_timeout_s, not each read: a client that
            # dribbles a byte now and then is closed at the deadline (one reaper thread for every connection)
            server.reaper.watch(self.connection, idle_timeout_s)
            try:
                super().handle_one_request()
            finally:
                server.reaper.cancel(self.connection)

        def _authorized(self) -> bool:
            if token is None or self.headers.get("Authorization", "") == f"Bearer {token}":
                return True
            self.close_connection = True
            self._answer(401, {"error": "unauthorized: this server needs Authorization: Bearer TOKEN "
                                        "(RemoteReward(token=...), reward.kwargs.token)"})
            return False

        def do_GET(self):
            if not self._authorized():
                return
            if self.path == "/health":
                self._answer(200, {"status": "ok", "reward": name, "components": components,
                                   "max_request_pixels": max_request_pixels, "max_payload": max_payload})
            else:
                self._answer(404, {"error": f"unknown path {self.path}; use GET /health or POST /score"})

        def do_POST(self):
            if not self._authorized():
                return
            if self.path != "/score":
                return self._answer(404, {"error": f"unknown path {self.path}; use POST /score"})
            text = self.headers.get("Content-Length")
            length = int(text) if text is not None and text.strip().isdigit() else None
            if length is None or length > max_payload:  # refused before a byte of the body is read
                self.close_connection = True
                if text is None:
                    return self._answer(411, {"error": "bad request: a Content-Length header is required"})
                if length is None:
                    return self._answer(400, {"error": f"bad request: Content-Length must be a byte count ≥ 0, "
                                                       f"got {text!r}"})
                return self._answer(413, {"error": f"payload of {length} bytes exceeds the limit of {max_payload}"})
            try:
                body = self._read_body(length)
            except TimeoutError as error:
                self.close_connection = True
                return self._answer(408, {"error": str(error)})
            try:
                samples, prompts, metadata = parse_request(body, max_image_pixels, max_request_pixels)
            except TooLarge as error:
                return self._answer(413, {"error": str(error)})
            except Exception as error:  # noqa: BLE001  (a bad request, answered as such)
                return self._answer(400, {"error": f"bad request: {type(error).__name__}: {error}"})
            try:
                result = batcher.score(samples, prompts, metadata, timeout_s)
            except TimeoutError as error:
                return self._answer(503, {"error": f"reward busy: {error}"})
            except RequestFailed as error:  # the others of its batch were scored: this request is at fault
                return self._answer(400, {"error": f"bad request: {error}"})
            except INPUT_ERRORS as error:  # what a reward raises on input it cannot read (a missing metadata key)
                return self._answer(400, {"error": f"bad request: the reward could not read this request's samples or metadata: "
                                                   f"{type(error).__name__}: {error}"})
            except Exception as error:  # noqa: BLE001  (the reward itself failed: the client retries)
                return self._answer(500, {"error": f"reward failed: {type(error).__name__}: {error}"})
            self._answer(200, {"components": {k: [None if math.isnan(x) else x for x in v]
                                              for k, v in result.items()}})

        def _read_body(self, length: int) -> bytes:
            """The body, in chunks, within timeout_s in all (a client sending a byte now and then
            never trips the per-read idle timeout)."""
            deadline, chunks, left = time.monotonic() + timeout_s, [], length
            while left > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"request body not received within {timeout_s:g} s (--timeout-s)")
                chunk = self.rfile.read1(min(left, 2**20))
                if not chunk:
                    break  # the client closed early: the JSON parse names what is missing
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)

    server = _BoundedServer((host, port), Handler, max_connections)
    return server  # the handlers reach server.reaper through this name


class _Reaper:
    """One thread that cuts connections whose request head is not in by their deadline."""

    def __init__(self):
        self.deadlines: dict = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="head-deadlines").start()

    def watch(self, sock, seconds: float) -> None:
        with self.lock:
            self.deadlines[sock] = time.monotonic() + seconds

    def cancel(self, sock) -> None:
        with self.lock:
            self.deadlines.pop(sock, None)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self.lock:
                due = [sock for sock, deadline in self.deadlines.items() if deadline <= now]
                for sock in due:
                    del self.deadlines[sock]
            for sock in due:
                try:
                    sock.shutdown(2)  # its handler's read ends; the thread closes the connection
                except OSError:
                    pass


class _BoundedServer(HTTPServer):
    """A bounded worker pool: ``max_connections`` threads, reused, each serving one connection at a
    time (keep-alive included); a connection past the limit is answered 503 at once and closed
    without taking a worker; the kernel's accept queue holds BACKLOG."""

    request_queue_size = BACKLOG

    def __init__(self, address, handler, max_connections: int):
        self.max_connections, self.open_connections = max_connections, 0
        self._count = threading.Lock()
        self.reaper = _Reaper()
        self.serving: set = set()  # the connections the workers hold, cut on server_close
        self.workers = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="reward-connection")
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._count:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:
            body = b'{"error": "server busy: too many open connections; retry"}'
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.workers.submit(self._serve, request, client_address)  # a free worker: the count is below the pool size

    def _serve(self, request, client_address):
        with self._count:
            self.serving.add(request)
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001  (what socketserver does per connection: one client never ends the server)
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._count:
                self.open_connections -= 1
                self.serving.discard(request)

    def handle_error(self, request, client_address):  # a client gone or cut at its deadline: not worth a traceback
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def server_close(self):
        """Stop accepting, then cut the connections in service (a keep-alive client would otherwise
        hold its worker, and the interpreter's exit joins the pool, until the idle timeout)."""
        super().server_close()
        with self._count:
            serving = list(self.serving)
        for request in serving:
            try:
                request.shutdown(2)
            except OSError:
                pass
        self.workers.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- client


class ServerRefused(RuntimeError):
    """A 4xx answer: the request is wrong, so retrying cannot help."""


class ServerError(ConnectionError):
    """A 5xx answer: the server failed this time; retried."""


# a reused keep-alive connection the server has closed fails with one of these before any answer:
# resent once at once on a new connection (scoring is idempotent), not counted as a failed try
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@register_reward("remote")
class RemoteReward(Reward):
    """A reward computed by a ``flowalign reward-server`` (see the module docstring). ``format``:
    uint8 | png | npy; None: uint8 for a server on this machine, png for one elsewhere."""

    max_idle = 4  # idle keep-alive connections kept open (one per thread calling at once)

    def __init__(self, url: str = "http://127.0.0.1:8765", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, format: str | None = None, components: list[str] | None = None,
                 token: str | None = None):
        parsed = urllib.parse.urlsplit(url.rstrip("/"))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url must look like http://HOST:PORT, got {url!r}")
        if format is None:
            format = "uint8" if parsed.hostname in LOCAL_HOSTS else "png"
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.url, self.timeout, self.retries, self.backoff, self.format = url.rstrip("/"), timeout, retries, backoff, format
        self._parsed = parsed
        self.token = token or os.environ.get("FLOWALIGN_REWARD_TOKEN")
        self._idle: list[http.client.HTTPConnection] = []  # keep-alive connections not in use
        self._lock = threading.Lock()
        health = {} if components else self.health()
        self.components = tuple(components) if components else tuple(health["components"])
        self.max_request_pixels = health.get("max_request_pixels")  # larger batches go as several requests

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle pooled connection (True: it served a request before and may have gone stale), or a
        new one (False). Pooled, not per thread: the trainer calls its reward from a new thread per
        batch (flowalign/faults.py), and a connection serves one request at a time."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        return cls(self._parsed.hostname, self._parsed.port, timeout=self.timeout), False

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (a later call opens a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _request(self, path: str, body: bytes | None = None) -> dict:
        """One request on a keep-alive connection; ServerRefused (4xx), ServerError (5xx)."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.token}"} if self.token else {})}
        while True:
            conn, reused = self._connection()
            try:
                conn.request("POST" if body is not None else "GET", self._parsed.path + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except STALE_CONNECTION:
                conn.close()
                if reused:
                    continue  # closed by the server while idle (or a restart): once more on a new connection
                raise
            except BaseException:
                conn.close()  # a timeout or a broken answer: this connection's state is unknown
                raise
            if response.will_close:
                conn.close()
            else:
                self._release(conn)
            if response.status >= 500:
                raise ServerError(f"HTTP {response.status}: {data.decode(errors='replace')}")
            if response.status >= 400:
                raise ServerRefused(f"reward server {self.url} refused the request: {data.decode(errors='replace')}")
            return json.loads(data)

    def health(self) -> dict:
        return self._with_retries(lambda: self._request("/health"))

    def _with_retries(self, call):
        for attempt in range(self.retries + 1):
            try:
                return call()
            except ServerRefused:
                raise  # our request is wrong: retrying cannot help
            except (OSError, http.client.HTTPException, json.JSONDecodeError) as error:  # ServerError included
                last = error
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"reward server {self.url} failed {self.retries + 1} times: {last}")

    def __call__(self, samples, prompts, metadata):
        per = int(samples[0].numel() // 3) if isinstance(samples, torch.Tensor) and len(samples) else 0
        step = max(1, self.max_request_pixels // per) if self.max_request_pixels and per else len(prompts)
        if step < len(prompts):  # the server's bound per request: the batch in parts, scored in order
            parts = [self(samples[i:i + step], prompts[i:i + step], metadata[i:i + step])
                     for i in range(0, len(prompts), step)]
            return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
        body = json.dumps({"format": self.format, "samples": encode_samples(samples, self.format),
                           "prompts": list(prompts), "metadata": list(metadata)}).encode()
        try:
            result = self._with_retries(lambda: self._request("/score", body))["components"]
        except ConnectionError as error:
            log.warning("%s; scoring this batch of %d as NaN (dropped by the trainer)", error, len(prompts))
            return {c: torch.full((len(prompts),), float("nan")) for c in self.components}
        return {k: torch.tensor([float("nan") if x is None else x for x in v], dtype=torch.float32)
                for k, v in result.items()}
