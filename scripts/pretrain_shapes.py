"""Pre-train the built-in shapes demo models on a CPU: shapes-sd3 (a small real
StableDiffusion3Pipeline, ``--family sd3``) and its UNet variant shapes-sd15 (a small real
StableDiffusionPipeline, ``--family sd``).

Two stages, both on scenes drawn by ``reward_models.worlds.shapes`` from the *whole* prompt space
(the "web data" of this world; RL later trains on the train split only):

1. the ``AutoencoderKL`` learns to reconstruct scenes; its latent shift and scale are then
   measured and written into its config, as SD3's VAE carries them;
2. the ``SD3Transformer2DModel`` and both CLIP text encoders learn rectified flow
   (velocity target ε − x0, logit-normal σ, 10 % of captions dropped to "" for CFG) on the
   posterior *means*. This tiny VAE's posterior std is ~0.9 of the latents' spread (its KL weight
   is negligible), so flow targets drawn from the posterior are mostly noise, and a model trained
   on them draws blobs with bleeding colours; the decoder, trained on posterior samples, decodes
   the means losslessly (the printed reconstruction accuracy).

``--family sd`` (shapes-sd15, for DDPO) skips stage 1: it reuses shapes-sd3's trained
``AutoencoderKL`` and its first CLIP text encoder + tokenizer (``--source``, loaded with
``from_pretrained``), and trains a new ``UNet2DConditionModel`` with DDPM's ε-prediction loss
(t uniform over the 1000 training timesteps, x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε) under SD1.5's noise
schedule, the ``DDIMScheduler`` the SD adapter samples with (``pipelines.tiny.SD_BETAS``,
``clip_sample=False``, ``set_alpha_to_one=False``), on the same posterior means and caption dropout.
The text encoder is fine-tuned jointly, as for shapes-sd3: SD1.x reads the *last* hidden states,
a layer shapes-sd3 only trained through its pooled projection. Latent scale: SD1.x pipelines
hand the decoder latents / ``scaling_factor`` and have no shift, so the VAE is saved with
``shift_factor`` None (the adapter then adds none either: ``DenoiserAdapter.vae_latents``) and the
UNet learns x0 = mean · scaling_factor, unshifted, as SD1.x's latents are; shapes-sd3's shift is
0.0196 against a latent std of 0.66 (x0 has mean ≈ 0.03, std 1). The UNet has cross-attention at
8×8 and 4×4 only (``SD15_UNET``): one at 16×16 triples the step time on one CPU thread.

**The shipped shapes-sd3** is built in two runs. The first (the defaults: a 6-layer, 96-wide
transformer, logit-normal(0, 1) σ) trains the VAE and text encoders but leaves a transformer that
cannot lay out a scene from pure noise: started from a true scene noised to σ = 0.7 it finishes
83 % of multi-object scenes correctly, from σ = 0.85 20 %, from σ = 1 9 %
(``scripts/probe_shapes_layout.py``), and logit-normal(0, 1) puts 4 % of its σ's above 0.85.
The second run (``--reuse``) trains a new, wider transformer (7 layers × 128) on that VAE and
those text encoders, with σ shifted up (``--logit-mean 0.5``: 11 % above 0.85, as SD3 shifts σ
for larger latents) and saves the EMA of its weights (``--ema 0.999``); held-out accuracy
0.205 → 0.406.

The result is saved with ``save_pretrained`` (safetensors), with its settings in
``pretraining.json``; ``scripts/measure_baseline.py`` then writes its held-out accuracy per
category (``baseline.json``) with the evaluation settings of the demo config.

    python scripts/pretrain_shapes.py --out /tmp/shapes-sd3-stage1
    python scripts/pretrain_shapes.py --reuse /tmp/shapes-sd3-stage1 --layers 7 --heads 4 --head-dim 32 \
        --flow-steps 6500 --logit-mean 0.5 --ema 0.999 --seed 3 --out pipelines/demo_models/shapes-sd3
    python scripts/pretrain_shapes.py --family sd --out pipelines/demo_models/shapes-sd15 --threads 1 \
        --dataset 40000 --flow-steps 3600
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from reward_models.worlds.shapes import render_batch, sample_specs, vocabulary
from pipelines.base import resolve_model_path
from pipelines.tiny import SD_BETAS, TinySD3Sizes, build_tiny_sd3_pipeline

DEMO_SIZES = TinySD3Sizes(image_size=32, vae_channels=(16, 32), text_hidden=64, text_projection=32,
                          layers=6, heads=4, head_dim=24, max_prompt_tokens=16)
# shapes-sd15's UNet (16×16×4 latents): 1.69 M parameters, cross-attention in the two lower levels
SD15_UNET = dict(block_out_channels=(32, 64, 64), layers_per_block=1, attention_head_dim=4, norm_num_groups=8,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))


def scenes(n: int, rng: random.Random) -> tuple[torch.Tensor, list[str]]:
    """n random scenes: images float [n, 3, 32, 32] in [-1, 1] and their captions."""
    specs = sample_specs(n, rng)
    return render_batch(specs, rng), [s["prompt"] for s in specs]


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
    recon = vae.decode(vae.encode(render_batch(specs, rng)).latent_dist.mode()).sample
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


def _optimizer(params, steps: int, lr: float):
    """AdamW with a linear warm-up and a cosine decay to 10 % of lr."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, min(200, steps // 10))  # runs under 10 steps (smoke tests) have no warm-up
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    return opt, sched


def train_denoiser(pipe, means, captions, steps: int, batch: int, rng: random.Random, lr: float,
                   logit_mean: float = 0.0, logit_std: float = 1.0, ema_decay: float = 0.0) -> None:
    """Stage 2 for either family: the denoiser and its text encoders on batches of posterior means,
    10 % of the captions dropped to "" (CFG). sd3: rectified flow with σ = sigmoid(logit_mean +
    logit_std·z); sd: DDPM ε-prediction. With ``ema_decay`` > 0 the trained modules end holding the
    exponential moving average of their weights (what is saved and sampled)."""
    sd3 = hasattr(pipe, "transformer")
    vae, denoiser = pipe.vae, (pipe.transformer if sd3 else pipe.unet)
    encoders = [pipe.text_encoder, pipe.text_encoder_2] if sd3 else [pipe.text_encoder]
    params = [p for m in [denoiser, *encoders] for p in m.parameters()]
    for m in [denoiser, *encoders]:
        m.train().requires_grad_(True)
    opt, sched = _optimizer(params, steps, lr)
    ema = [p.detach().clone() for p in params] if ema_decay > 0 else None
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    alphas = None if sd3 else pipe.scheduler.alphas_cumprod.float()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    bar = tqdm(range(steps), desc="flow" if sd3 else "ddpm")
    for step in bar:
        idx = torch.randint(len(captions), (batch,), generator=g)
        x0 = (means[idx] - shift) * scale
        prompts = [captions[i] if rng.random() > 0.1 else "" for i in idx.tolist()]
        noise = torch.randn(x0.shape, generator=g)
        if sd3:
            embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, None, do_classifier_free_guidance=False,
                                                      max_sequence_length=1)
            sigma = torch.sigmoid(logit_mean + logit_std * torch.randn(batch, generator=g)).view(-1, 1, 1, 1)
            xt = (1 - sigma) * x0 + sigma * noise
            out = denoiser(hidden_states=xt, timestep=sigma.flatten() * 1000, encoder_hidden_states=embeds,
                           pooled_projections=pooled).sample
            target = noise - x0
        else:
            embeds, _ = pipe.encode_prompt(prompts, "cpu", 1, False)
            t = torch.randint(len(alphas), (batch,), generator=g)
            a = alphas[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise  # DDPMScheduler.add_noise
            out = denoiser(xt, t, encoder_hidden_states=embeds).sample
            target = noise
        loss = F.mse_loss(out, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if ema is not None:
            decay = min(ema_decay, (1 + step) / (10 + step))  # warm-up: early weights are forgotten fast
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    if ema is not None:
        with torch.no_grad():
            torch._foreach_copy_(params, ema)


def build_sd_from_sd3(source: str, seed: int):
    """shapes-sd15 before stage 2: shapes-sd3's VAE (shift dropped, see the module docstring) and
    first CLIP text encoder + tokenizer, a new UNet, SD1.5's DDIM schedule."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    source = resolve_model_path(source)
    vae = AutoencoderKL.from_pretrained(source, subfolder="vae")
    vae.register_to_config(shift_factor=None)
    text_encoder = CLIPTextModel.from_pretrained(source, subfolder="text_encoder")  # its projection is unused
    tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer")
    latent = vae.config.sample_size // 2 ** (len(vae.config.block_out_channels) - 1)
    unet = UNet2DConditionModel(sample_size=latent, in_channels=vae.config.latent_channels,
                                out_channels=vae.config.latent_channels,
                                cross_attention_dim=text_encoder.config.hidden_size, **SD15_UNET)
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(**SD_BETAS, clip_sample=False, set_alpha_to_one=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def new_transformer_on(source: str, sizes: TinySD3Sizes, seed: int):
    """shapes-sd3 with a new, randomly initialised ``SD3Transformer2DModel`` of ``sizes`` and the
    trained VAE (with its latent shift and scale), text encoders and tokenizers of ``source``."""
    from diffusers import StableDiffusion3Pipeline

    old = StableDiffusion3Pipeline.from_pretrained(resolve_model_path(source), text_encoder_3=None, tokenizer_3=None)
    fresh = build_tiny_sd3_pipeline(vocabulary(), sizes, seed=seed)
    return StableDiffusion3Pipeline(
        transformer=fresh.transformer, scheduler=old.scheduler, vae=old.vae, text_encoder=old.text_encoder,
        tokenizer=old.tokenizer, text_encoder_2=old.text_encoder_2, tokenizer_2=old.tokenizer_2,
        text_encoder_3=None, tokenizer_3=None)


def weights_mb(pipe) -> float:
    return sum(p.numel() * p.element_size() for m in pipe.components.values() if isinstance(m, torch.nn.Module)
               for p in m.parameters()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("sd3", "sd"), default="sd3",
                        help="sd3: shapes-sd3 from scratch; sd: the UNet variant on shapes-sd3's VAE and text encoder")
    parser.add_argument("--out", default=None, help="output folder (diffusers format); default "
                        "pipelines/demo_models/shapes-sd3 or, for --family sd, shapes-sd15")
    parser.add_argument("--source", default="shapes-sd3", help="--family sd: the model whose VAE, first text "
                        "encoder and tokenizer are reused (a demo name or folder)")
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--dataset", type=int, default=60_000, help="scenes encoded once for stage 2")
    parser.add_argument("--flow-steps", type=int, default=6000, help="stage-2 steps (flow or DDPM)")
    parser.add_argument("--flow-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--logit-mean", type=float, default=0.0, help="sd3: σ = sigmoid(mean + std·z)")
    parser.add_argument("--logit-std", type=float, default=1.0)
    parser.add_argument("--ema", type=float, default=0.0, help="save the EMA of stage 2's weights (e.g. 0.999)")
    parser.add_argument("--layers", type=int, default=DEMO_SIZES.layers, help="sd3: transformer blocks")
    parser.add_argument("--heads", type=int, default=DEMO_SIZES.heads, help="sd3: attention heads")
    parser.add_argument("--head-dim", type=int, default=DEMO_SIZES.head_dim, help="sd3: width per head")
    parser.add_argument("--reuse", default=None, help="sd3: a new transformer (--layers/--heads/--head-dim) on "
                        "this model's trained VAE, text encoders and tokenizers (skips stage 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init", default=None,
                        help="continue stage 2 from this saved model of --family (its VAE and latent scale are kept)")
    args = parser.parse_args()
    if args.reuse and (args.init or args.family != "sd3"):
        parser.error("--reuse builds a new sd3 transformer: it cannot be combined with --init or --family sd")
    args.out = args.out or f"pipelines/demo_models/{'shapes-sd3' if args.family == 'sd3' else 'shapes-sd15'}"
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    start = time.time()
    extra = {}

    if args.init:
        from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline

        if args.family == "sd3":
            pipe = StableDiffusion3Pipeline.from_pretrained(args.init, text_encoder_3=None, tokenizer_3=None)
        else:
            pipe = StableDiffusionPipeline.from_pretrained(args.init, safety_checker=None,
                                                           requires_safety_checker=False)
        pipe.vae.eval().requires_grad_(False)
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
    elif args.reuse:
        pipe = new_transformer_on(args.reuse, replace(DEMO_SIZES, layers=args.layers, heads=args.heads,
                                                      head_dim=args.head_dim), args.seed)
        pipe.vae.eval().requires_grad_(False)
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
    elif args.family == "sd":
        pipe = build_sd_from_sd3(args.source, args.seed)
        pipe.vae.eval().requires_grad_(False)
        extra["vae_reconstruction_accuracy"] = reconstruction_accuracy(pipe.vae, rng)
        print(f"verifier accuracy on VAE reconstructions: {extra['vae_reconstruction_accuracy']:.3f}")
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
    else:
        pipe = build_tiny_sd3_pipeline(vocabulary(), DEMO_SIZES, seed=args.seed)
        train_vae(pipe.vae, args.vae_steps, args.vae_batch, rng)
        pipe.vae.eval().requires_grad_(False)
        print(f"verifier accuracy on VAE reconstructions: {reconstruction_accuracy(pipe.vae, rng):.3f}")
        means, captions = encode_dataset(pipe.vae, args.dataset, rng)
        pipe.vae.register_to_config(shift_factor=means.mean().item(), scaling_factor=1.0 / means.std().item())
    if args.family == "sd":
        scaled = means * pipe.vae.config.scaling_factor
        extra.update(latent_mean=scaled.mean().item(), latent_std=scaled.std().item(), weights_mb=weights_mb(pipe))
        print(f"x0 = mean · scaling_factor: mean {extra['latent_mean']:.3f}, std {extra['latent_std']:.3f}; "
              f"weights {extra['weights_mb']:.2f} MB")
    train_denoiser(pipe, means, captions, args.flow_steps, args.flow_batch, rng, args.lr, args.logit_mean,
                   args.logit_std, args.ema)

    out = Path(args.out)
    pipe.save_pretrained(out)
    settings = {k: v for k, v in vars(args).items()
                if not (args.family == "sd" and k in ("vae_steps", "vae_batch"))}  # sd trains no VAE
    (out / "pretraining.json").write_text(json.dumps(
        {**settings, **extra, "minutes": (time.time() - start) / 60}, indent=2))
    print(f"saved to {out} after {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
