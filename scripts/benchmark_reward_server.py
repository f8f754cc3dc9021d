"""The reward server under load, and its overhead per image against the same reward in-process.

    python scripts/benchmark_reward_server.py --clients 1,4,16 --seconds 10 --out docs/reward_server.json

Payload formats side by side (``--formats``: only this part; its result is merged into ``--out``
under "formats"):

    python scripts/benchmark_reward_server.py --formats png,uint8 --size 512 --reward jpeg_compressibility \
        --batch-size 4 --reps 10 --out docs/reward_server.json

one client sends the same batch in each format in turn, alternating which goes first (paired:
machine noise hits both alike), for two kinds of 512² image: "noise" (uniform random pixels, PNG's
worst case, like an early rollout's) and "smooth" (a shapes scene upscaled: flat colour, PNG's
best case). Per format and kind: images/s (batch / median request time), the client's encode
time and the server-side decode time per image (in-process), and the bytes per image on the wire.

A real ``flowalign reward-server`` subprocess serves the reward; N client threads in this process
send batches of rendered shapes-world images for a fixed time. Reported per N: requests, images/s,
latency p50/p95/max. Then the server is killed mid-run: what the clients see (retries, then NaN
batches with a clear warning) is counted. Overhead per image = (server latency at N = 1 − the
in-process time of the same batch) / batch size, interleaved in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from reward_models.worlds.shapes import prompt_split, render_scene
from reward_models.base import build_reward
from reward_models.remote import RemoteReward, decode_samples, encode_samples


def batch(n: int, seed: int):
    specs = [prompt_split("test")[i % 44] for i in range(n)]
    rng = random.Random(seed)
    images = np.stack([np.asarray(render_scene(s, rng)) for s in specs])
    return torch.from_numpy(images).permute(0, 3, 1, 2) / 255, [s["prompt"] for s in specs], specs


def start_server(reward: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "flowalign.cli", "reward-server", "--reward", reward,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # "serving ..." once it listens
    return proc


def load(url: str, clients: int, seconds: float, batch_size: int, **client_kwargs) -> dict:
    latencies, failed_batches = [], [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(k):
        client = RemoteReward(url, components=["accuracy", "score"], **client_kwargs)
        data = batch(batch_size, k)
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            out = client(*data)
            dt = time.perf_counter() - t0
            with lock:
                if torch.isnan(out["score"]).all():
                    failed_batches[0] += 1
                else:
                    latencies.append(dt)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = sorted(latencies)
    return {"clients": clients, "batch_size": batch_size, "seconds": wall, "requests": len(q),
            "failed_batches": failed_batches[0], "images_per_s": len(q) * batch_size / wall,
            "latency_p50_ms": 1000 * q[len(q) // 2] if q else None,
            "latency_p95_ms": 1000 * q[int(len(q) * 0.95)] if q else None,
            "latency_max_ms": 1000 * q[-1] if q else None}


def images_of(kind: str, n: int, size: int) -> torch.Tensor:
    """float [n, 3, size, size] in [0, 1]: uniform noise, or shapes scenes upscaled (flat colour)."""
    if kind == "noise":
        return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(0))
    small = batch(n, 0)[0]
    return torch.nn.functional.interpolate(small, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)


def median_ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def compare_formats(url: str, formats: list[str], size: int, batch_size: int, reps: int) -> dict:
    """Paired, alternating requests of the same batch in each format (see the module docstring)."""
    out = {"size": size, "batch_size": batch_size, "reps": reps, "kinds": {}}
    for kind in ("noise", "smooth"):
        images = images_of(kind, batch_size, size)
        prompts, meta = ["x"] * batch_size, [{}] * batch_size
        clients = {f: RemoteReward(url, format=f, retries=0, timeout=120) for f in formats}
        for f in formats:  # warm-up: connection open, server code paths touched
            clients[f](images, prompts, meta)
        times = {f: [] for f in formats}
        for rep in range(reps):
            for f in (formats if rep % 2 == 0 else formats[::-1]):
                t0 = time.perf_counter()
                scores = clients[f](images, prompts, meta)
                times[f].append(time.perf_counter() - t0)
                assert all(torch.isfinite(v).all() for v in scores.values()), (f, scores)
        row = {}
        for f in formats:
            encoded = encode_samples(images, f)
            row[f] = {"images_per_s": batch_size / statistics.median(times[f]),
                      "request_ms_median": 1000 * statistics.median(times[f]),
                      "encode_ms_per_image": median_ms(lambda: encode_samples(images, f)) / batch_size,
                      "decode_ms_per_image": median_ms(lambda: decode_samples(encoded, f)) / batch_size,
                      "bytes_per_image": sum(len(e) for e in encoded) / batch_size}
        out["kinds"][kind] = row
        print(kind, json.dumps(row))
    return out


def write_merged(path: str, result: dict) -> None:
    """Replace ``result``'s keys in the JSON at ``path``, keeping the others (the load test and the
    format comparison are run separately and share one file)."""
    try:
        with open(path) as f:
            whole = json.load(f)
    except FileNotFoundError:
        whole = {}
    whole.update(result)
    with open(path, "w") as f:
        json.dump(whole, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", default="shapes")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--formats", default=None, help="e.g. png,uint8: only compare payload formats")
    parser.add_argument("--size", type=int, default=512, help="image side of the --formats comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    url = f"http://127.0.0.1:{args.port}"
    if args.formats:
        proc = start_server(args.reward, args.port)
        try:
            result = compare_formats(url, args.formats.split(","), args.size, args.batch_size, args.reps)
        finally:
            proc.terminate()
            proc.wait()
        result.update(reward=args.reward, command=" ".join(["python", *sys.argv]))
        if args.out:
            write_merged(args.out, {"formats": result})
        return
    proc = start_server(args.reward, args.port)
    result = {"reward": args.reward, "load": [], "command": " ".join(["python", *sys.argv])}
    try:
        local, remote = build_reward(args.reward), RemoteReward(url)
        result["client_format"] = remote.format  # the default for this server: uint8 on 127.0.0.1
        data = batch(args.batch_size, 0)
        t_local, t_remote = [], []
        for _ in range(args.reps):  # interleaved, so machine noise hits both alike
            t0 = time.perf_counter()
            local(*data)
            t_local.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            remote(*data)
            t_remote.append(time.perf_counter() - t0)
        ms_local, ms_remote = 1000 * statistics.median(t_local), 1000 * statistics.median(t_remote)
        result["overhead"] = {"batch_size": args.batch_size, "in_process_ms": ms_local, "server_ms": ms_remote,
                              "overhead_ms_per_image": (ms_remote - ms_local) / args.batch_size}
        print(json.dumps(result["overhead"]))
        for n in map(int, args.clients.split(",")):
            result["load"].append(load(url, n, args.seconds, args.batch_size))
            print(json.dumps(result["load"][-1]))
    finally:
        proc.terminate()
        proc.wait()

    # Killed mid-run: 4 clients for `seconds`; the server is killed after a third of it.
    proc = start_server(args.reward, args.port)
    threading.Timer(args.seconds / 3, proc.kill).start()
    result["killed_mid_run"] = load(url, 4, args.seconds, args.batch_size, retries=2, backoff=0.1, timeout=5)
    proc.wait()
    print(json.dumps(result["killed_mid_run"]))
    if args.out:
        write_merged(args.out, result)


if __name__ == "__main__":
    main()
