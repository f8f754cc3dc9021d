"""The ``flowalign`` command: train from a YAML recipe, sample, and draw prompt × seed grids.

Examples::

    flowalign train configs/shapes_flow_grpo.yaml                     # the built-in demo
    flowalign train configs/shapes_flow_grpo.yaml train.epochs=5 output_dir=runs/try
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m flowalign.cli train CONFIG
    flowalign grid --model shapes-sd3 --lora runs/shapes-flow-grpo/final --prompts shapes:test --out grid.png
"""

from __future__ import annotations

import argparse
import sys

import torch


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shapes-sd3", help="built-in demo name, local diffusers folder or hub id")
    p.add_argument("--family", default="sd3", help="adapter family (default: sd3)")
    p.add_argument("--lora", default=None, help="folder with trained LoRA weights (a run's final/ folder)")
    p.add_argument("--steps", type=int, default=10, help="sampling steps (ODE)")
    p.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale")
    p.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds (grid columns)")


def _load(args):
    from pipelines import adapter_class

    return adapter_class(args.family).from_pretrained(args.model, lora=args.lora)


def _sample(adapter, prompts: list[str], seeds: list[int], steps: int, guidance: float) -> torch.Tensor:
    """Images [len(prompts)·len(seeds), 3, H, W], row-major (prompt, seed); ODE sampling."""
    from flowalign.rollout import rollout
    from flowalign.samplers.steps import plan_steps

    cond = adapter.encode(prompts).repeat_interleave(len(seeds))
    noise = torch.cat([adapter.initial_noise(1, torch.Generator().manual_seed(s)) for s in seeds])
    noise = noise.repeat(len(prompts), *([1] * (noise.ndim - 1)))
    traj = rollout(adapter, cond, noise, adapter.schedule(steps), plan_steps(steps, len(cond), 0.0),
                   guidance_scale=guidance)
    return adapter.decode(traj.samples)


def cmd_train(args) -> int:
    from flowalign.config import load_config
    from flowalign.trainer import train

    config = load_config(args.config, args.overrides)
    summary = train(config)
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key in sorted(after):
        if isinstance(after[key], float) and isinstance(before.get(key), float):
            print(f"{key}: {before[key]:.4f} → {after[key]:.4f}")
    print(f"outputs in {config.output_dir} (metrics.json, grids/, final/)")
    return 0


def cmd_grid(args) -> int:
    from flowalign.grids import save_grid, to_pil_grid
    from flowalign.prompts import load_prompts

    prompts = args.prompt or [p["prompt"] for p in load_prompts(args.prompts)][: args.max_prompts]
    seeds = [int(s) for s in args.seeds.split(",")]
    adapter = _load(args)
    images = torch.cat([_sample(adapter, prompts[i:i + 8], seeds, args.steps, args.guidance)
                        for i in range(0, len(prompts), 8)])
    save_grid(to_pil_grid(images, len(prompts), len(seeds)), args.out, prompts)
    print(f"wrote {args.out} ({len(prompts)} prompts × {len(seeds)} seeds; prompts in {args.out[:-4]}.txt)")
    return 0


def cmd_sample(args) -> int:
    from torchvision.utils import save_image

    seeds = [int(s) for s in args.seeds.split(",")]
    images = _sample(_load(args), [args.prompt], seeds, args.steps, args.guidance)
    for seed, image in zip(seeds, images):
        path = args.out.replace("{seed}", str(seed)) if "{seed}" in args.out else f"{args.out[:-4]}-{seed}.png"
        save_image(image, path)
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowalign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an alignment experiment from a YAML config",
                       description="Run an experiment. Any config value can be overridden: key.sub=value "
                                   "(e.g. train.learning_rate=1e-4 sampling.num_steps=8). resume=auto continues "
                                   "from the latest checkpoint in output_dir.")
    p.add_argument("config", help="YAML recipe, e.g. configs/shapes_flow_grpo.yaml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("grid", help="prompts × seeds in one PNG (ODE sampling)")
    _add_model_args(p)
    p.add_argument("--prompts", default="shapes:test", help="shapes:test, a .txt or a .jsonl prompt file")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; overrides --prompts)")
    p.add_argument("--max-prompts", type=int, default=12)
    p.add_argument("--out", default="grid.png")
    p.set_defaults(func=cmd_grid)

    p = sub.add_parser("sample", help="images for one prompt, one file per seed")
    _add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("--out", default="sample-{seed}.png", help="output path; {seed} is replaced")
    p.set_defaults(func=cmd_sample)
    return parser


def main(argv: list[str] | None = None) -> int:
    from flowalign.config import ConfigError
    from pipelines.base import ModelNotFoundError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ModelNotFoundError, FileNotFoundError) as error:
        print(f"flowalign: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
