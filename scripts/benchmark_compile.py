"""What ``train.compile`` gives on this machine: the demo model's (shapes-sd3, LoRA rank 32) two
kinds of denoiser call, eager against compiled (``flowalign.model_setup.compile_denoisers``), in
process CPU time, paired rounds, after the compiled side's first calls (whose compilation time is
reported apart):

* a rollout forward: no gradient, batch 64 (the demo's sampling and evaluation batches);
* a training forward + backward: LoRA gradient, batch 32 (one DiffusionNFT loss term).

    OMP_NUM_THREADS=1 python scripts/benchmark_compile.py --rounds 5 --out /tmp/compile.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from flowalign.model_setup import compile_denoisers
from flowalign.trainer import run_environment
from pipelines.sd3 import SD3Adapter
from reward_models.worlds.shapes import prompt_split


def cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    eager = SD3Adapter.from_pretrained("shapes-sd3")
    torch.manual_seed(0)
    eager.add_lora(32)
    compiled = copy.copy(eager)  # the same pipeline object, another denoiser: a deep copy of the model
    compiled.model = compiled.denoiser = copy.deepcopy(eager.model)
    prompts = [s["prompt"] for s in prompt_split("train")]
    cond64 = eager.encode((prompts * 64)[:64])
    g = torch.Generator().manual_seed(0)
    x64 = eager.initial_noise(64, g)
    t = eager.schedule(10).timesteps[3]

    def rollout_forward(a):
        a.model.eval()
        with torch.no_grad():
            a.predict(x64, t, cond64, 1.0)

    def train_step(a):
        a.model.train()
        a.predict(x64[:32], t, cond64[:32], 1.0).square().mean().backward()
        a.model.zero_grad(set_to_none=True)

    compile_seconds = {}
    compile_denoisers(compiled)
    for name, fn in (("rollout_forward_b64", rollout_forward), ("train_forward_backward_b32", train_step)):
        compile_seconds[name] = cpu_time(lambda: fn(compiled))  # compiles
        fn(eager)
    times = {name: {"eager": [], "compiled": []} for name in compile_seconds}
    for _ in range(args.rounds):
        for name, fn in (("rollout_forward_b64", rollout_forward), ("train_forward_backward_b32", train_step)):
            times[name]["eager"].append(cpu_time(lambda: fn(eager)))
            times[name]["compiled"].append(cpu_time(lambda: fn(compiled)))
    results = {name: {"eager_s": statistics.median(v["eager"]), "compiled_s": statistics.median(v["compiled"]),
                      "speedup": statistics.median(e / c for e, c in zip(v["eager"], v["compiled"])),
                      "first_call_cpu_s": compile_seconds[name]} for name, v in times.items()}
    results["settings"] = {"rounds": args.rounds, **run_environment()}
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
