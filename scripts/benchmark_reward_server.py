"""The reward server under load, and its overhead per image against the same reward in-process.

    python scripts/benchmark_reward_server.py --clients 1,4,16 --seconds 10 --out docs/reward_server.json

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
from reward_models.remote import RemoteReward


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", default="shapes")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(args.reward, args.port)
    result = {"reward": args.reward, "load": []}
    try:
        local, remote = build_reward(args.reward), RemoteReward(url)
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
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
