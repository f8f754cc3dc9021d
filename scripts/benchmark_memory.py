"""Peak memory and time of one training step, per attention backend, with and without gradient
checkpointing, on an SD3 transformer big enough for attention to dominate.

One step is what the trainer does for one trained timestep of Flow-GRPO: a forward pass of the
LoRA policy through ``SD3Transformer2DModel`` (random weights, built from a config in code), the
log-density of a given next latent under the Flow-GRPO SDE step (``flowalign.samplers.flow_sde``),
the clipped-ratio loss (``flowalign.objectives.flow_grpo``), the backward pass and an AdamW step.

Backends:

* ``math``: PyTorch SDPA restricted to its unfused math kernel (``sdpa_kernel(SDPBackend.MATH)``):
  softmax(QKᵀ/√d)·V with the [B, H, N, N] attention matrix materialised and kept for the backward
  pass, which is what diffusers' plain ``AttnProcessor`` computes (SD3's joint attention has no
  ``AttnProcessor`` variant, so its ``JointAttnProcessor2_0`` runs on the math kernel instead);
* ``sdpa``: the processors' default, PyTorch picks its fused kernel (flash on CPU; flash or
  memory-efficient on CUDA);
* ``xformers``: ``enable_xformers_memory_efficient_attention()``, only where xformers imports and
  the device is CUDA (``pipelines.attention``).

Every configuration runs in a fresh subprocess, so one's peak cannot hide another's. Memory: on
CUDA the peak of ``torch.cuda.max_memory_allocated`` above what the model, LoRA and optimizer
hold before the first step; on CPU the peak resident set size (``ru_maxrss``) above the resident
size just before the first step, with glibc told to return every large block to the system
(``MALLOC_MMAP_THRESHOLD_``) so that RSS follows the tensors alive. Time: the median of
``--steps`` steps after ``--warmup`` (steps/s printed as it/s).

    OMP_NUM_THREADS=1 python scripts/benchmark_memory.py --threads 1 --out docs/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BACKENDS = ("math", "sdpa", "xformers")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads per configuration (CPU)")
    p.add_argument("--latent", type=int, default=90, help="latent side; tokens = (latent / 2)² image + --text")
    p.add_argument("--text", type=int, default=77, help="text tokens")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=32, help="0: train every weight")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backends", default="math,sdpa,xformers", help="those that cannot run here are skipped")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "<backend>:<0|1>": run one configuration
    return p.parse_args(argv)


# -- one configuration (the child process) --------------------------------------------------
def build(args, device, dtype):
    import torch
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from pipelines.denoiser import JOINT_ATTENTION_LORA_TARGETS

    torch.manual_seed(0)
    width = args.heads * args.head_dim
    model = SD3Transformer2DModel(
        sample_size=args.latent, patch_size=2, in_channels=16, out_channels=16, num_layers=args.layers,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=width,
        caption_projection_dim=width, pooled_projection_dim=width, pos_embed_max_size=max(96, args.latent // 2))
    model.to(device=device, dtype=dtype) if dtype != torch.float32 else model.to(device)
    if args.lora_rank > 0:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                     target_modules=list(JOINT_ATTENTION_LORA_TARGETS)))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    model.train()
    return model


def inputs(args, device):
    """x, the next latent x' [B, 16, h, w]; text [B, L, D]; pooled [B, D]; σ = 0.7 → σ' = 0.6."""
    import torch

    g = torch.Generator().manual_seed(1)
    width = args.heads * args.head_dim
    shape = (args.batch, 16, args.latent, args.latent)
    x = torch.randn(shape, generator=g)
    data = {"x": x, "x_next": x + 0.1 * torch.randn(shape, generator=g),
            "text": torch.randn(args.batch, args.text, width, generator=g),
            "pooled": torch.randn(args.batch, width, generator=g),
            "advantages": torch.randn(args.batch, generator=g)}
    return {k: v.to(device) for k, v in data.items()}


def training_step(model, optimizer, data, dtype):
    """One trained timestep of Flow-GRPO: policy forward, SDE log-prob, clipped loss, backward, AdamW."""
    import torch

    from flowalign.objectives.flow_grpo import flow_grpo_loss
    from flowalign.samplers.flow_sde import flow_grpo_sde_step

    sigma, sigma_next = 0.7, 0.6
    t = torch.full((data["x"].shape[0],), 1000 * sigma, device=data["x"].device)
    v = model(hidden_states=data["x"].to(dtype), timestep=t, encoder_hidden_states=data["text"].to(dtype),
              pooled_projections=data["pooled"].to(dtype), return_dict=False)[0]
    step = flow_grpo_sde_step(v, data["x"], sigma, sigma_next, 0.7, prev_sample=data["x_next"])
    loss, _ = flow_grpo_loss(step.log_prob, step.log_prob.detach(), data["advantages"], clip_range=1e-4)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_child(args) -> dict:
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend, checkpointing = args.child.split(":")
    checkpointing = checkpointing == "1"
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build(args, device, dtype)
    if checkpointing:
        model.enable_gradient_checkpointing()
    if backend == "xformers":
        model.enable_xformers_memory_efficient_attention()
    kernel = sdpa_kernel([SDPBackend.MATH]) if backend == "math" else contextlib.nullcontext()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    data = inputs(args, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base, maxrss_before = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    with kernel:
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            training_step(model, optimizer, data, dtype)
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    if cuda:
        peak_total, note = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    else:
        peak_total, note = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
        if peak_total <= maxrss_before:
            note += " (not above the model build's own peak: the step's peak is not visible)"
    median = statistics.median(times)
    return {"backend": backend, "gradient_checkpointing": checkpointing, "device": device.type,
            "baseline_mb": base / 2**20, "peak_mb": peak_total / 2**20, "step_peak_mb": (peak_total - base) / 2**20,
            "step_s": median, "it_per_s": 1 / median, "times_s": times, "memory_measure": note,
            "trainable_params": sum(p.numel() for p in params), "params": sum(p.numel() for p in model.parameters()),
            "attention_processor": type(next(iter(model.attn_processors.values()))).__name__}


# -- the table (the parent process) ----------------------------------------------------------
def available_backends(requested: list[str], device: str) -> tuple[list[str], dict[str, str]]:
    from pipelines.attention import xformers_unavailable

    run, skipped = [], {}
    for backend in requested:
        reason = xformers_unavailable(device) if backend == "xformers" else None
        if reason:
            skipped[backend] = reason
        else:
            run.append(backend)
    return run, skipped


def run_configuration(args, backend: str, checkpointing: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, *child_argv(args), "--child", f"{backend}:{int(checkpointing)}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"backend": backend, "gradient_checkpointing": checkpointing, "error": out.stderr.strip()[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_argv(args) -> list[str]:
    keys = ("device", "threads", "latent", "text", "layers", "heads", "head_dim", "batch", "lora_rank", "dtype",
            "warmup", "steps")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def table(rows: list[dict]) -> str:
    """Markdown: one row per configuration; ratios against math attention without checkpointing."""
    ok = [r for r in rows if "error" not in r]
    ref = next((r for r in ok if r["backend"] == "math" and not r["gradient_checkpointing"]), ok[0] if ok else None)
    head = "| attention | grad ckpt | step peak MB | × math | step s | it/s | × math |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {'on' if r['gradient_checkpointing'] else 'off'} | failed | | | | |")
            continue
        lines.append(f"| {r['backend']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['step_peak_mb']:.0f} | "
                     f"{r['step_peak_mb'] / ref['step_peak_mb']:.2f} | {r['step_s']:.2f} | {r['it_per_s']:.3f} | "
                     f"{r['step_s'] / ref['step_s']:.2f} |")
    return "\n".join(lines)


ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(run_child(args)))
        return 0
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sys.path.insert(0, str(ROOT))
    backends, skipped = available_backends(args.backends.split(","), args.device)
    tokens = (args.latent // 2) ** 2 + args.text
    print(f"SD3Transformer2DModel: {args.layers} joint blocks, {args.heads} heads × {args.head_dim}, "
          f"{tokens} tokens ({(args.latent // 2) ** 2} image + {args.text} text), batch {args.batch}, "
          f"{'LoRA r=' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, {args.dtype}, "
          f"{args.device}, {args.threads} thread(s)", flush=True)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", flush=True)
    rows = []
    for checkpointing in (False, True):
        for backend in backends:
            t0 = time.perf_counter()
            row = run_configuration(args, backend, checkpointing)
            rows.append(row)
            status = row.get("error", "").splitlines()[-1:] or [f"step peak {row['step_peak_mb']:.0f} MB, "
                                                                  f"{row['step_s']:.2f} s/step"]
            print(f"  {backend:8s} checkpointing {'on ' if checkpointing else 'off'}: {status[0]} "
                  f"({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    print(table(rows))
    if args.out:
        result = {"command": "python scripts/benchmark_memory.py " + " ".join(sys.argv[1:]),
                  "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
                  "tokens": tokens, "torch": torch.__version__, "skipped": skipped, "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
