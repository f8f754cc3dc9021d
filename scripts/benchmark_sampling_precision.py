"""What ``sampling.autocast`` gives on this CPU: one rollout forward of the demo model (shapes-sd3,
LoRA rank 32, batch 64, no gradient) in float32 against bf16 autocast on the merged LoRA (what
``flowalign.rollout.sampling_precision`` runs) and autocast alone on the unmerged one, process CPU time, medians of paired rounds, for
each oneDNN instruction-set cap given (``ONEDNN_MAX_CPU_ISA``: a cap below the CPU's own shows
what a CPU without AMX or AVX512-BF16 would do; each cap runs in its own process, since oneDNN
reads it once).

    python scripts/benchmark_sampling_precision.py --isa ALL AVX512_CORE_BF16 AVX512_CORE AVX2 \\
        --rounds 5 --out docs/sampling_precision_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(rounds: int) -> dict:
    import torch

    from flowalign.rollout import native_bf16
    from pipelines.sd3 import SD3Adapter
    from reward_models.worlds.shapes import prompt_split

    torch.set_num_threads(1)
    adapter = SD3Adapter.from_pretrained("shapes-sd3")
    torch.manual_seed(0)
    adapter.add_lora(32)
    with torch.no_grad():  # a LoRA that has moved off zero, as after some training
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    prompts = [s["prompt"] for s in prompt_split("train")]
    cond = adapter.encode((prompts * 64)[:64])
    x = adapter.initial_noise(64, torch.Generator().manual_seed(0))
    t = adapter.schedule(10).timesteps[3]

    def float32():
        with torch.no_grad():
            return adapter.predict(x, t, cond, 1.0)

    def bf16_merged():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), adapter.merged_lora():
            return adapter.predict(x, t, cond, 1.0)

    def bf16_unmerged():  # autocast alone: the LoRA's three products, each frozen weight cast on every call
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return adapter.predict(x, t, cond, 1.0)

    sides = (("float32", float32), ("bf16_merged", bf16_merged), ("bf16_unmerged", bf16_unmerged))
    full, low = float32(), bf16_merged()
    bf16_unmerged()
    times = {name: [] for name, _ in sides}
    for _ in range(rounds):
        for name, fn in sides:
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    ratio = {name: statistics.median(b / f for b, f in zip(times[name], times["float32"])) for name, _ in sides[1:]}
    return {"float32_s": statistics.median(times["float32"]), "bf16_merged_s": statistics.median(times["bf16_merged"]),
            "bf16_unmerged_s": statistics.median(times["bf16_unmerged"]), "bf16_over_float32": ratio["bf16_merged"],
            "bf16_unmerged_over_float32": ratio["bf16_unmerged"],
            "relative_error": float((low.float() - full).norm() / full.norm()), "native_bf16": native_bf16("cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="+", default=["ALL"], help="ONEDNN_MAX_CPU_ISA values, one process each")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure and print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.rounds)))
        return
    results = {}
    for isa in args.isa:
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, __file__, "--one", "--rounds", str(args.rounds)], env=env,
                             capture_output=True, text=True, check=True).stdout
        results[isa] = json.loads(out.strip().splitlines()[-1])
        print(isa, results[isa], flush=True)
    from flowalign.trainer import run_environment

    results["settings"] = {"rounds": args.rounds, **run_environment()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
