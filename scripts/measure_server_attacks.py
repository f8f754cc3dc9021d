"""The reward server's memory, threads and latency under hostile requests, on 127.0.0.1 only.

    python scripts/measure_server_attacks.py --out docs/server_attacks.json
    python scripts/measure_server_attacks.py --repo /path/to/an/older/checkout   # the same attacks on other code

Each attack gets a fresh ``flowalign reward-server`` subprocess (started from ``--repo``, this
checkout by default); its peak resident memory (``VmHWM`` of /proc/PID/status, the kernel's high
-water mark, reset through ``clear_refs`` after the warm-up request) and thread count are read from
/proc. Every request is bounded (sizes below, a client timeout of ``--wait`` seconds), and the
server is killed after each attack. Attacks (docs/faults.md gives the numbers):

* ``bomb``: one 4000×4000 PNG (62 KB as sent, 16 Mpx), with a shapes spec as metadata;
  ``--meanwhile-after`` seconds later a normal request (4 small images) is timed: is it blocked?
* ``bomb_at_bound``: the same at 2048×2048, the largest sample the default bound accepts (not in
  the default ``--only``: it is scored, which takes a while);
* ``negative_length``: ``Content-Length: -1`` followed by a 200 MB body;
* ``bad_prompts``, ``bad_metadata``: a string for ``prompts``, numbers for ``metadata``;
* ``idle``: 50 connections that send nothing; the server's threads after 2 s and after
  ``--idle-wait`` seconds.
* ``flood``: 900 connections that send half a request head and then nothing, held ``--flood-hold`` s;
* ``pixel_request``: one request of 64 PNGs at 1024² (the issue's 269 KB request: 67 Mpx);
* ``batched_bad``: requests whose metadata the reward cannot read, sent while the legitimate clients
  loop (their requests are merged into the same reward calls).

During every attack two legitimate clients loop (4 small images a request, one at a time each);
their worst latency, their failed requests and how many they sent are reported with the server's
peak memory.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from reward_models.worlds.shapes import prompt_split, render_scene

HOST = "127.0.0.1"


def png(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def normal_body(n: int = 4) -> bytes:
    specs = prompt_split("test")[:n]
    rng = random.Random(0)
    return json.dumps({"format": "png", "samples": [png(np.asarray(render_scene(s, rng))) for s in specs],
                       "prompts": [s["prompt"] for s in specs], "metadata": specs}).encode()


def proc_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            fields[key] = int(value.split()[0])
    return {"rss_mb": round(fields["VmRSS"] / 1024, 1), "peak_rss_mb": round(fields["VmHWM"] / 1024, 1),
            "threads": fields["Threads"]}


def post(port: int, body: bytes, timeout: float, headers: dict | None = None) -> dict:
    """One POST /score: status, the answer's first 200 characters, seconds (status None: no answer)."""
    began = time.perf_counter()
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request("POST", "/score", body=body, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
        response = connection.getresponse()
        status, text = response.status, response.read().decode(errors="replace")[:200]
    except (OSError, http.client.HTTPException) as error:
        status, text = None, f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return {"status": status, "answer": text, "seconds": round(time.perf_counter() - began, 2)}


class Server:
    def __init__(self, repo: Path, reward: str, extra: list[str]):
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flowalign.cli", "reward-server", "--reward", reward,
                                      "--port", "0", *extra], cwd=repo, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "serving reward ... on http://127.0.0.1:PORT ..."
        self.port = int(line.split(f"http://{HOST}:")[1].split()[0])
        post(self.port, normal_body(), 120)  # warm-up: the reward's first call
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        self.baseline = proc_status(self.proc.pid)

    def status(self) -> dict:
        return proc_status(self.proc.pid)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def bomb(server: Server, wait: float, after: float, side: int = 4000) -> dict:
    spec = prompt_split("test")[0]
    big = np.zeros((side, side, 3), dtype=np.uint8)
    body = json.dumps({"format": "png", "samples": [png(big)], "prompts": [spec["prompt"]],
                       "metadata": [spec]}).encode()
    result: dict = {"body_bytes": len(body)}
    thread = threading.Thread(target=lambda: result.update(attack=post(server.port, body, wait)))
    thread.start()
    time.sleep(after)  # the big one is decoded and being scored (if it was accepted); now a normal client
    result["normal_request_meanwhile"] = post(server.port, normal_body(), wait)
    thread.join()
    return result


def negative_length(server: Server, wait: float, megabytes: int = 200) -> dict:
    began = time.perf_counter()
    sent, answer = 0, b""
    with socket.create_connection((HOST, server.port), timeout=wait) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -1\r\n\r\n")
        chunk = b"x" * 2**20
        try:
            for _ in range(megabytes):
                sock.sendall(chunk)
                sent += 1
            sock.shutdown(socket.SHUT_WR)  # end of body: a server reading "to the end" stops here
        except OSError:
            pass  # the server closed the connection before reading the body: the point
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
    head = answer.decode(errors="replace").split("\r\n")[0]
    return {"sent_mb": sent, "answer": head, "body": answer.decode(errors="replace").split("\r\n\r\n")[-1][:200],
            "seconds": round(time.perf_counter() - began, 2)}


def malformed(server: Server, wait: float, field: str) -> dict:
    request = json.loads(normal_body(2))
    request[field] = "a string, not a list" if field == "prompts" else [1, 2]
    return post(server.port, json.dumps(request).encode(), wait)


def idle(server: Server, idle_wait: float, connections: int = 50) -> dict:
    sockets = [socket.create_connection((HOST, server.port)) for _ in range(connections)]
    time.sleep(2)
    after_open = server.status()["threads"]
    time.sleep(idle_wait)
    result = {"connections": connections, "threads_before": server.baseline["threads"],
              "threads_after_2s": after_open, f"threads_after_{idle_wait:g}s": server.status()["threads"],
              "normal_request": post(server.port, normal_body(), 60)}
    for s in sockets:
        s.close()
    return result


class LegitClients:
    """``n`` threads posting a normal request in a loop until stopped: worst latency, failures."""

    def __init__(self, port: int, wait: float, n: int = 2):
        self.port, self.wait, self.stop_flag = port, wait, threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.body = normal_body()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]

    def _loop(self) -> None:
        while not self.stop_flag.is_set():
            result = post(self.port, self.body, self.wait)
            self.latencies.append(result["seconds"])
            if result["status"] != 200:
                self.failures.append(f"{result['status']}: {result['answer'][:80]}")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        for t in self.threads:
            t.join()

    def report(self) -> dict:
        return {"legit_requests": len(self.latencies), "legit_worst_s": round(max(self.latencies, default=0.0), 2),
                "legit_failures": len(self.failures), "legit_failure_example": self.failures[:1]}


def flood(server: Server, hold: float, connections: int = 900) -> dict:
    held = []
    for _ in range(connections):
        try:
            s = socket.create_connection((HOST, server.port), timeout=5)
            s.sendall(b"POST /score HTTP/1.1\r\nContent-Length: 10\r\n")
            held.append(s)
        except OSError:
            break
    time.sleep(hold)
    result = {"connections_held": len(held), "threads_while_held": server.status()["threads"]}
    for s in held:
        s.close()
    return result


def pixel_request(server: Server, wait: float, count: int = 64, side: int = 1024) -> dict:
    spec = prompt_split("test")[0]
    body = json.dumps({"format": "png", "samples": [png(np.zeros((side, side, 3), dtype=np.uint8))] * count,
                       "prompts": [spec["prompt"]] * count, "metadata": [spec] * count}).encode()
    return {"body_bytes": len(body), "attack": post(server.port, body, wait)}


def batched_bad(server: Server, wait: float, rounds: int = 20) -> dict:
    request = json.loads(normal_body(2))
    request["metadata"] = [{"bogus": 1}, {"bogus": 2}]
    body = json.dumps(request).encode()
    answers = [post(server.port, body, wait)["status"] for _ in range(rounds)]
    return {"bad_answers": sorted(set(answers))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the checkout to serve from")
    parser.add_argument("--reward", default="shapes")
    parser.add_argument("--server-args", default="", help="extra reward-server flags, e.g. '--idle-timeout-s 5'")
    parser.add_argument("--wait", type=float, default=150, help="client timeout of each attack request, seconds")
    parser.add_argument("--meanwhile-after", type=float, default=5,
                        help="seconds after the 4000×4000 PNG that the normal request is sent")
    parser.add_argument("--idle-wait", type=float, default=35, help="seconds the idle connections are held")
    parser.add_argument("--flood-hold", type=float, default=10, help="seconds the flood's connections are held")
    parser.add_argument("--only", default="bomb,negative_length,bad_prompts,bad_metadata,idle,flood,pixel_request,"
                                          "batched_bad")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    attacks = {"bomb": lambda s: bomb(s, args.wait, args.meanwhile_after),
               "bomb_at_bound": lambda s: bomb(s, args.wait, args.meanwhile_after, 2048),
               "negative_length": lambda s: negative_length(s, args.wait),
               "bad_prompts": lambda s: malformed(s, args.wait, "prompts"),
               "bad_metadata": lambda s: malformed(s, args.wait, "metadata"),
               "idle": lambda s: idle(s, args.idle_wait),
               "flood": lambda s: flood(s, args.flood_hold),
               "pixel_request": lambda s: pixel_request(s, args.wait),
               "batched_bad": lambda s: batched_bad(s, args.wait)}
    results = {"repo": args.repo, "reward": args.reward, "server_args": args.server_args}
    for name in args.only.split(","):
        server = Server(Path(args.repo), args.reward, args.server_args.split())
        try:
            with LegitClients(server.port, args.wait) as legit:
                outcome = attacks[name](server)
            outcome.update(legit.report())
            status = server.status()
            outcome.update(baseline_rss_mb=server.baseline["rss_mb"], peak_rss_mb=status["peak_rss_mb"],
                           peak_increase_mb=round(status["peak_rss_mb"] - server.baseline["rss_mb"], 1))
        finally:
            server.stop()
        results[name] = outcome
        print(name, json.dumps(outcome), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
