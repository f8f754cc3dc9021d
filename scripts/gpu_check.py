"""One command that records, on one CUDA GPU in under 8 minutes, what CPU runs cannot.

    python scripts/gpu_check.py --out docs/gpu_check.json          # on a machine with one CUDA GPU
    python scripts/gpu_check.py --cpu-subset --out /tmp/check.json  # anywhere (tests/test_gpu_check.py)

Sections, in order (each fails soft: an exception is recorded as its error string and the last
lines of its traceback, and the next section runs; the JSON is rewritten after every section, so
a run killed half-way keeps what it measured):

  environment       torch / diffusers / peft versions, the GPU, which optional kernels import
  precision         one step (a rollout with log-probs → advantages → an update) of the real Trainer
                    on the tiny SD3 model and the shipped demo model, in bf16 and fp16 (frozen weights
                    in that dtype, Accelerate's autocast; fp16 with its GradScaler): every training
                    statistic finite, the rollout's log-probs float32, time, peak memory
  attention         the same step per attention backend that can run: sdpa and xformers on the demo
                    (SD3's processors call SDPA themselves), and diffusers' dispatcher backends
                    (native, flash, sage, _native_cudnn, _native_flash, _native_efficient, flex) on a
                    tiny FLUX model, whose attention goes through the dispatcher; each with the
                    processors actually in use, so a fallback to sdpa is visible
  checkpointing     gradient checkpointing off / on (the demo, bf16): time, peak memory
  compile           train.compile off / on (the demo, bf16): time of a step after the compiling one,
                    peak memory, every statistic finite (the CPU subset skips it)
  launch            a 1-process FSDP and a 1-process DeepSpeed ZeRO-2 launch (configs/accelerate/, with
                    num_processes: 1): 2 epochs with a checkpoint each, then resumed to epoch 3
  rollout_overhead  our rollout with log-probs ÷ the plain diffusers pipeline, same weights, steps,
                    batch and output (latents), paired and alternating

"step" below = ``Trainer.sample_epoch`` + ``compute_advantages`` + ``update_policy`` for one
epoch of 2 groups × 4 samples, 4 sampling steps, measured after one warm-up step (kernel choice,
allocator). Peak memory: ``torch.cuda.max_memory_allocated`` over the measured step (null on CPU).

The CPU subset (``--cpu-subset``, automatic without CUDA) runs every section it can on the CPU in
float32 on the tiny model (precision fp32, attention sdpa, checkpointing, rollout_overhead) and
records the GPU-only parts as skipped with the reason, so the script cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

DISPATCH = ("native", "flash", "sage", "_native_cudnn", "_native_flash", "_native_efficient", "flex")
KERNEL_PACKAGES = ("xformers", "flash_attn", "flash_attn_interface", "sageattention", "deepspeed", "bitsandbytes")
STEP = ["tracker=none", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "sampling.num_steps=4", "eval.every=0",
        "eval.seeds=1", "checkpoint_every=0", "model.lora_rank=4"]


# -- running sections --------------------------------------------------------------------------
def run_section(results: dict, name: str, fn, out: Path | None) -> None:
    """``results[name] = fn()``, or the error it raised; seconds either way; the JSON rewritten."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:  # noqa: BLE001  (fail soft: one broken backend must not lose the rest)
        results[name] = {"error": f"{type(error).__name__}: {error}".strip()[:2000],
                         "traceback": traceback.format_exc().strip().splitlines()[-4:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"[gpu_check] {name}: {'error: ' + results[name]['error'] if 'error' in results[name] else 'ok'} "
          f"({results[name]['seconds']} s)", flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=2, default=str))


def each(cases: dict, fn) -> dict:
    """``{case: fn(*args)}`` for each case, each failing soft on its own (its error recorded)."""
    rows = {}
    for case, args in cases.items():
        try:
            rows[case] = fn(*args)
        except Exception as error:  # noqa: BLE001
            rows[case] = {"error": f"{type(error).__name__}: {error}".strip()[:2000]}
        print(f"[gpu_check]   {case}: {rows[case].get('error', 'ok')}", flush=True)
    return rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- models ------------------------------------------------------------------------------------
def tiny_models(root: Path, flux: bool) -> dict[str, Path]:
    """The tiny SD3 (and, for the dispatcher backends, FLUX) pipelines of the tests, built from code
    and saved (no download)."""
    from pipelines.tiny import build_tiny_flux_pipeline, build_tiny_sd3_pipeline
    from reward_models.worlds.shapes import vocabulary

    paths = {"tiny_sd3": root / "tiny-sd3", "tiny_flux": root / "tiny-flux"}
    build_tiny_sd3_pipeline(vocabulary(), seed=0).save_pretrained(paths["tiny_sd3"])
    if flux:
        build_tiny_flux_pipeline(vocabulary(), guidance_embeds=True).save_pretrained(paths["tiny_flux"])
    return paths


def model_overrides(model: str, paths: dict) -> list[str]:
    if model == "demo":
        return ["model.family=sd3", "model.path=shapes-sd3"]
    if model == "tiny_flux":
        return ["model.family=flux", f"model.path={paths['tiny_flux']}", "model.height=16", "model.width=16",
                "sampling.guidance_scale=3.5", "reward.name=jpeg_compressibility",
                "reward.weights={jpeg_compressibility: 1.0}"]
    return ["model.family=sd3", f"model.path={paths['tiny_sd3']}"]


# -- one training step -------------------------------------------------------------------------
def train_step(root: Path, overrides: list[str]) -> dict:
    """One warm-up and one measured step of the real Trainer (see the module docstring)."""
    from flowalign.config import load_config
    from flowalign.trainer import Trainer
    from pipelines.attention import attention_processors

    out = Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    trainer = Trainer(load_config(None, [f"output_dir={out}", *STEP, *overrides]))
    try:
        trainer.sampler.prepare(trainer.objective.rollout)
        for measured in (False, True):
            sync()
            if measured and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            batch = trainer.sample_epoch()
            sync()
            t1 = time.perf_counter()
            advantages, _ = trainer.compute_advantages(batch)
            stats = trainer.update_policy(batch, advantages)
            sync()
            t2 = time.perf_counter()
            trainer.epoch += 1
        finite = {k: v for k, v in stats.items() if isinstance(v, float)}
        return {"rollout_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0,
                "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
                "log_prob_dtype": str(batch.traj.log_probs.dtype).removeprefix("torch."),
                "log_probs_finite": bool(torch.isfinite(batch.traj.log_probs).all()),
                "stats_finite": all(v == v and abs(v) != float("inf") for v in finite.values()),
                "skipped_nonfinite": stats.get("train/skipped_nonfinite"),
                "loss_terms": {k: v for k, v in finite.items() if "loss" in k or k.endswith("ratio")},
                "attention": attention_processors(trainer.adapter.model),
                "weights_dtype": str(trainer.adapter.model.dtype).removeprefix("torch.")}
    finally:
        del trainer
        free()


PRECISION = {"bf16": ["model.dtype=bfloat16", "train.mixed_precision=bf16"],
             "fp16": ["model.dtype=float16", "train.mixed_precision=fp16"],
             "fp32": ["model.dtype=float32", "train.mixed_precision='no'"]}  # quoted: YAML reads no as false


def precision(root: Path, paths: dict, cuda: bool) -> dict:
    cases = {f"{model}/{p}": (root, [*model_overrides(model, paths), *PRECISION[p]])
             for model in (("tiny_sd3", "demo") if cuda else ("tiny_sd3",))
             for p in (("bf16", "fp16") if cuda else ("fp32",))}
    rows = each(cases, train_step)
    return {"cases": rows, "ok": all(r.get("stats_finite") and r.get("log_prob_dtype") == "float32" for r in rows.values())}


def attention(root: Path, paths: dict, cuda: bool) -> dict:
    from pipelines.attention import dispatcher_unavailable, xformers_unavailable

    device = "cuda" if cuda else "cpu"
    base = PRECISION["bf16" if cuda else "fp32"]
    model = "demo" if cuda else "tiny_sd3"
    cases, skipped = {f"{model}/sdpa": (root, [*model_overrides(model, paths), *base, "model.attention=sdpa"])}, {}
    reason = xformers_unavailable(device)
    if reason:
        skipped[f"{model}/xformers"] = reason
    else:
        cases[f"{model}/xformers"] = (root, [*model_overrides(model, paths), *base, "model.attention=xformers"])
    for backend in DISPATCH:  # the tiny FLUX model: its attention goes through diffusers' dispatcher
        reason = dispatcher_unavailable(backend, device) if cuda else "the CPU subset runs sdpa only"
        if reason:
            skipped[f"tiny_flux/{backend}"] = reason
        else:
            cases[f"tiny_flux/{backend}"] = (root, [*model_overrides("tiny_flux", paths), *base,
                                                    f"model.attention={backend}"])
    return {"cases": each(cases, train_step), "skipped": skipped}


def checkpointing(root: Path, paths: dict, cuda: bool) -> dict:
    model = "demo" if cuda else "tiny_sd3"
    base = [*model_overrides(model, paths), *PRECISION["bf16" if cuda else "fp32"]]
    return {"cases": each({f"{model}/off": (root, [*base, "model.gradient_checkpointing=false"]),
                           f"{model}/on": (root, [*base, "model.gradient_checkpointing=true"])}, train_step)}


def compiled(root: Path, paths: dict, cuda: bool) -> dict:
    """``train.compile`` off and on, one measured step each after a warm-up step (which pays the
    compilation); the CPU subset skips it (inductor's C++ builds take minutes there; docs/performance.md)."""
    if not cuda:
        return {"skipped": "the CPU subset does not compile (docs/performance.md measures train.compile on CPU)"}
    base = [*model_overrides("demo", paths), *PRECISION["bf16"]]
    return {"cases": each({"demo/eager": (root, [*base, "train.compile=false"]),
                           "demo/compiled": (root, [*base, "train.compile=true"])}, train_step)}


# -- launches ----------------------------------------------------------------------------------
def one_process_config(name: str, root: Path) -> Path:
    """configs/accelerate/<name>.yaml with num_processes: 1."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / "accelerate" / f"{name}.yaml").read_text())
    config["num_processes"] = 1
    path = root / f"{name}-1proc.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(name: str, root: Path, timeout: float) -> dict:
    """Train 2 epochs with a checkpoint each under ``accelerate launch``, then resume to epoch 3."""
    config = one_process_config(name, root)
    precision_ = "bf16" if name.startswith("deepspeed") else "'no'"  # DeepSpeed: its launch file's; quoted for YAML
    out = root / f"launch-{name}"
    common = ["tracker=none", "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
              "train.train_batch_size=8", "sampling.num_steps=4", "eval.every=0", "eval.seeds=1",
              "checkpoint_every=1", "train.ema_decay=0", f"train.mixed_precision={precision_}", f"output_dir={out}"]
    if name.startswith("deepspeed"):
        common.append("model.lora_rank=0")  # ZeRO-2 is for full fine-tuning (its launch file says so)
    row = {}
    for phase, extra in (("train", ["train.epochs=2"]), ("resume", ["train.epochs=3", "resume=auto"])):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m",
               "flowalign.cli", "train", "configs/shapes_flow_grpo.yaml", *common, *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
        row[phase] = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0,
                      "stderr_tail": proc.stderr.strip().splitlines()[-6:] if proc.returncode else []}
        if proc.returncode:
            break
    history = out / "history.jsonl"
    row["epochs_in_history"] = len(history.read_text().splitlines()) if history.is_file() else 0
    row["ok"] = all(p["returncode"] == 0 for p in row.values() if isinstance(p, dict)) and row["epochs_in_history"] == 3
    return row


def launches(root: Path, cuda: bool, timeout: float) -> dict:
    if not cuda:
        return {"skipped": "needs CUDA: FSDP and DeepSpeed launches shard over GPUs"}
    cases = {"fsdp": ("fsdp", root, timeout)}
    if importlib.util.find_spec("deepspeed") is None:
        skipped = {"deepspeed_zero2": "deepspeed is not installed (pip install deepspeed)"}
    else:
        skipped, cases["deepspeed_zero2"] = {}, ("deepspeed_zero2", root, timeout)
    return {"cases": each(cases, launch), "skipped": skipped}


# -- rollout with log-probs ÷ the plain pipeline -----------------------------------------------
def rollout_overhead(paths: dict, cuda: bool, reps: int = 3) -> dict:
    from flowalign.rollout import rollout
    from flowalign.samplers.steps import plan_steps
    from pipelines import load_adapter

    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    path = "shapes-sd3" if cuda else str(paths["tiny_sd3"])
    adapter = load_adapter("sd3", path, dtype=dtype, device=device)
    prompts, steps = ["a red circle", "two blue squares", "a green triangle", "a yellow star"] * 2, 10

    def ours():
        noise = adapter.initial_noise(len(prompts), torch.Generator().manual_seed(0))
        plan = plan_steps(steps, len(prompts), eta=1.0)
        traj = rollout(adapter, adapter.encode(prompts), noise, adapter.schedule(steps), plan,
                       generator=torch.Generator().manual_seed(1))
        return traj.log_probs

    def plain():
        return adapter.pipe(prompts, num_inference_steps=steps, guidance_scale=1.0, output_type="latent",
                            height=adapter.height, width=adapter.width, generator=torch.Generator().manual_seed(0),
                            max_sequence_length=adapter.max_sequence_length)  # the same text tokens as ours

    times = {"rollout": [], "pipeline": []}
    with torch.no_grad():
        ours(), plain()  # warm-up
        for rep in range(reps):
            for name, fn in (("rollout", ours), ("pipeline", plain))[:: 1 if rep % 2 == 0 else -1]:
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
    rollout_s, pipeline_s = statistics.median(times["rollout"]), statistics.median(times["pipeline"])
    adapter = None  # frees the model (the closures above hold the name, not a copy)
    free()
    return {"model": path, "device": device, "dtype": dtype, "batch": len(prompts), "steps": steps,
            "rollout_s": rollout_s, "pipeline_s": pipeline_s, "ratio": rollout_s / pipeline_s, "times": times}


def environment(cuda: bool) -> dict:
    import diffusers
    import peft

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "peft": peft.__version__, "cuda_available": cuda,
           "imports": {name: importlib.util.find_spec(name) is not None for name in KERNEL_PACKAGES}}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gb=props.total_memory / 2**30,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   bf16_supported=torch.cuda.is_bf16_supported())
    return env


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON here (rewritten after every section)")
    parser.add_argument("--cpu-subset", action="store_true", help="the CPU subset (automatic without CUDA)")
    parser.add_argument("--sections",
                        default="environment,precision,attention,checkpointing,compile,launch,rollout_overhead")
    parser.add_argument("--launch-timeout", type=float, default=120, help="seconds per accelerate launch (4 launches)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_subset
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out) if args.out else None
    results: dict = {"mode": "gpu" if cuda else "cpu-subset", "command": " ".join(["python", *sys.argv]),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        root = Path(tmp)
        paths = tiny_models(root, flux=cuda)
        sections = {"environment": lambda: environment(cuda),
                    "precision": lambda: precision(root, paths, cuda),
                    "attention": lambda: attention(root, paths, cuda),
                    "checkpointing": lambda: checkpointing(root, paths, cuda),
                    "compile": lambda: compiled(root, paths, cuda),
                    "launch": lambda: launches(root, cuda, args.launch_timeout),
                    "rollout_overhead": lambda: rollout_overhead(paths, cuda)}
        for name in args.sections.split(","):
            run_section(results, name, sections[name], out)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    if out is not None:
        out.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
