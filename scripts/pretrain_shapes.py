"""Pre-train the built-in shapes demo model (a small real StableDiffusion3Pipeline) on a CPU.

Two stages, both on scenes drawn by ``flowalign.worlds.shapes`` from the *whole* prompt space
(the "web data" of this world; RL later trains on the train split only):

1. the ``AutoencoderKL`` learns to reconstruct scenes; its latent shift and scale are then
   measured and written into its config, as SD3's VAE carries them;
2. the ``SD3Transformer2DModel`` and both CLIP text encoders learn rectified flow
   (velocity target ε − x0, logit-normal σ, 10 % of captions dropped to "" for CFG) on the
   posterior *means*. This tiny VAE's posterior std is ~0.9 of the latents' spread (its KL weight
   is negligible), so flow targets drawn from the posterior are mostly noise, and a model trained
   on them draws blobs with bleeding colours; the decoder, trained on posterior samples, decodes
   the means losslessly (the printed reconstruction accuracy).

The result is saved with ``save_pretrained`` (safetensors), with its settings in
``pretraining.json``; ``scripts/measure_baseline.py`` then writes its held-out accuracy per
category (``baseline.json``) with the evaluation settings of the demo config.

    python scripts/pretrain_shapes.py --out pipelines/demo_models/shapes-sd3
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from flowalign.worlds.shapes import render_scene, sample_specs, to_array, vocabulary
from pipelines.tiny import TinySD3Sizes, build_tiny_sd3_pipeline

DEMO_SIZES = TinySD3Sizes(image_size=32, vae_channels=(16, 32), text_hidden=64, text_projection=32,
                          layers=6, heads=4, head_dim=24, max_prompt_tokens=16)


def scenes(n: int, rng: random.Random) -> tuple[torch.Tensor, list[str]]:
    """n random scenes: images float [n, 3, 32, 32] in [-1, 1] and their captions."""
    specs = sample_specs(n, rng)
    images = np.stack([to_array(render_scene(s, rng)) for s in specs])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1, [s["prompt"] for s in specs]


def train_vae(vae, steps: int, batch: int, rng: random.Random, lr: float = 1e-3) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    bar = tqdm(range(steps), desc="vae")
    for step in bar:
        x, _ = scenes(batch, rng)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(mse=f"{loss.item():.4f}")


@torch.no_grad()
def reconstruction_accuracy(vae, rng: random.Random, n: int = 256) -> float:
    """Shapes-verifier accuracy on VAE reconstructions of true scenes (1.0 = lossless enough)."""
    from reward_models.shapes import ShapesVerifier

    specs = sample_specs(n, rng)
    x = torch.from_numpy(np.stack([to_array(render_scene(s, rng)) for s in specs])).permute(0, 3, 1, 2) / 127.5 - 1
    recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
    return ShapesVerifier()(recon / 2 + 0.5, [s["prompt"] for s in specs], specs)["accuracy"].mean().item()


@torch.no_grad()
def encode_dataset(vae, n: int, rng: random.Random, batch: int = 256):
    """Posterior means of n scenes [n, C, h, w] and their captions."""
    means, captions = [], []
    for _ in tqdm(range(math.ceil(n / batch)), desc="encode"):
        x, c = scenes(batch, rng)
        means.append(vae.encode(x).latent_dist.mean)
        captions += c
    return torch.cat(means), captions


def train_flow(pipe, means, captions, steps: int, batch: int, rng: random.Random, lr: float) -> None:
    vae, transformer = pipe.vae, pipe.transformer
    encoders = [pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in [transformer, *encoders] for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = min(200, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    bar = tqdm(range(steps), desc="flow")
    for step in bar:
        idx = torch.randint(len(captions), (batch,), generator=g)
        x0 = (means[idx] - shift) * scale
        prompts = [captions[i] if rng.random() > 0.1 else "" for i in idx.tolist()]
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=1)
        sigma = torch.sigmoid(torch.randn(batch, generator=g)).view(-1, 1, 1, 1)  # logit-normal
        noise = torch.randn(x0.shape, generator=g)
        xt = (1 - sigma) * x0 + sigma * noise
        v = transformer(hidden_states=xt, timestep=sigma.flatten() * 1000, encoder_hidden_states=embeds,
                        pooled_projections=pooled).sample
        loss = F.mse_loss(v, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pipelines/demo_models/shapes-sd3", help="output folder (diffusers format)")
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--dataset", type=int, default=60_000, help="scenes encoded once for stage 2")
    parser.add_argument("--flow-steps", type=int, default=6000)
    parser.add_argument("--flow-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init", default=None,
                        help="continue stage 2 from this saved model (its VAE and latent scale are kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    start = time.time()

    if args.init:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(args.init, text_encoder_3=None, tokenizer_3=None)
        pipe.vae.eval().requires_grad_(False)
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
    else:
        pipe = build_tiny_sd3_pipeline(vocabulary(), DEMO_SIZES, seed=args.seed)
        train_vae(pipe.vae, args.vae_steps, args.vae_batch, rng)
        pipe.vae.eval().requires_grad_(False)
        print(f"verifier accuracy on VAE reconstructions: {reconstruction_accuracy(pipe.vae, rng):.3f}")
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
        pipe.vae.register_to_config(shift_factor=means.mean().item(), scaling_factor=1.0 / means.std().item())
    train_flow(pipe, means, captions, args.flow_steps, args.flow_batch, rng, args.lr)

    out = Path(args.out)
    pipe.save_pretrained(out)
    (out / "pretraining.json").write_text(json.dumps({**vars(args), "minutes": (time.time() - start) / 60}, indent=2))
    print(f"saved to {out} after {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
