"""Where a shapes-sd3 model fails on multi-object scenes: at which noise level, and how.

1. **From σ** (SDEdit): true scenes of the multi-object categories are noised to σ and finished
   with Euler ODE steps; the verifier's accuracy against their own captions. A model that renders
   well but cannot lay a scene out from pure noise scores high from σ = 0.5 and low from σ = 1.
2. **Failures from pure noise**: samples of two-object and colour-attribute prompts, each failure
   put in one class: too few objects (merged or missing), too many, the right number with a wrong
   class, or only a colour wrong.

    python scripts/probe_shapes_layout.py pipelines/demo_models/shapes-sd3

Prints a Markdown table row per σ and the failure counts (the tables in docs/results.md).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

import torch

from reward_models.worlds.shapes import IMAGE_SIZE, render_batch, sample_specs
from pipelines import load_adapter
from reward_models.shapes import ShapesVerifier, detect_objects, judge

MULTI_OBJECT = ("two_object", "color_attr", "counting", "position")


@torch.no_grad()
def finish(adapter, z: torch.Tensor, sigma: float, specs: list[dict], steps: int) -> torch.Tensor:
    """Euler ODE from latents z [B, C, h, w] at σ down to 0, conditioned on the specs' captions;
    decoded images float [B, 3, H, W] in [0, 1]."""
    cond = adapter.encode([s["prompt"] for s in specs])
    sigmas = torch.linspace(sigma, 0, steps + 1)
    for i in range(steps):
        z = z + (sigmas[i + 1] - sigmas[i]) * adapter.predict(z, sigmas[i] * 1000, cond)
    return adapter.decode(z)


def failure_class(objects, spec) -> str:
    if judge(objects, spec, IMAGE_SIZE)[0]:
        return "right"
    requested = sum(item["count"] for item in spec["include"])
    if len(objects) != requested:
        return "too few objects" if len(objects) < requested else "too many objects"
    right_classes = sorted(o.shape for o in objects) == sorted(item["class"] for item in spec["include"])
    return "colour wrong" if right_classes else "class wrong"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a shapes-sd3 folder or demo name")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps from σ = 1 (fewer from lower σ)")
    parser.add_argument("--sigmas", default="0.3,0.5,0.7,0.85,1.0")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_adapter("sd3", args.model)
    verifier = ShapesVerifier()
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    specs = sample_specs(args.samples, rng, categories=MULTI_OBJECT)
    vae = adapter.pipe.vae
    with torch.no_grad():
        x0 = (vae.encode(render_batch(specs, rng)).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn(x0.shape, generator=g)
    prompts = [s["prompt"] for s in specs]
    print("| started from σ | accuracy |\n|---|---|")
    for sigma in (float(s) for s in args.sigmas.split(",")):
        images = finish(adapter, (1 - sigma) * x0 + sigma * noise, sigma, specs, max(1, round(args.steps * sigma)))
        print(f"| {sigma:g} | {verifier(images, prompts, specs)['accuracy'].mean().item():.3f} |")

    specs = sample_specs(args.samples, rng, categories=("two_object", "color_attr"))
    images = finish(adapter, torch.randn(x0.shape, generator=g), 1.0, specs, args.steps)
    arrays = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    counts = Counter(failure_class(detect_objects(im), s) for im, s in zip(arrays, specs))
    print("from pure noise (two_object, color_attr):", dict(counts.most_common()))


if __name__ == "__main__":
    main()
