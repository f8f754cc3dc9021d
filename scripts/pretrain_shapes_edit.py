"""Pre-train the built-in edit demo model shapes-kontext on a CPU: a small real
``FluxKontextPipeline`` (FLUX.1-Kontext) that edits scenes of the shapes edit world
(``reward_models/worlds/shapes_edit.py``: "make the red circle blue", "move the square up").

Data: (input image, instruction, intended result) triples drawn by ``render_edit`` from the
*train* split's edits only, each with a fresh random layout (the held-out edits' instructions
and other objects never appear; ``--dataset`` triples are drawn and encoded once).

Model: FLUX.1's classes as ``pipelines.tiny.build_tiny_flux_pipeline`` makes them, with

* the trained ``AutoencoderKL`` of shapes-sd3 (``--source``; 4 latent channels, its measured
  shift and scale, which FLUX's pipelines apply as SD3's do): no VAE is trained here;
* shapes-sd3's first CLIP text encoder (saved as ``CLIPTextModelWithProjection``, loaded as the
  ``CLIPTextModel`` FLUX reads the pooled output of) and its tokenizer;
* a new ``T5EncoderModel`` over a T5 tokenizer of the edit vocabulary (shapes-sd3 has no T5);
* a new ``FluxTransformer2DModel`` (no guidance embedding: there is no teacher to distil guidance
  from) and FLUX.1-dev's ``FlowMatchEulerDiscreteScheduler`` configuration, as Kontext ships it.

Loss: rectified flow (velocity target ε − x0, σ = sigmoid(logit_mean + logit_std·z)) on the
target's VAE posterior mean (shifted and scaled), with the input image given exactly as Kontext
gives it: its latents (the VAE's mode, shifted and scaled, packed into 2×2 tokens) appended after
the noisy latent tokens with position ids whose first coordinate is 1. The forward pass is
``FluxKontextAdapter.predict`` itself, so the RL adapter and ``FluxKontextPipeline`` sample the
result unchanged. The transformer and both text encoders train; the saved weights are the EMA
(``--ema``).

Logged: the held-out loss (a fixed batch of test-split triples, fixed noise and σ) every
``--eval-every`` steps, and the held-out edit accuracy (the ``shapes_edit`` reward) of η = 0
samples of the 189 test edits (``write_edit_prompts(…, "test")``, seed 0) every
``--accuracy-every`` steps and at the end, with the EMA weights; all in ``pretraining.json``.

    python scripts/pretrain_shapes_edit.py --out pipelines/demo_models/shapes-kontext
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pipelines.base import Conditioning, resolve_model_path
from pipelines.tiny import FLUX_DEV_SCHEDULER, _t5_config, build_t5_tokenizer
from reward_models.worlds.shapes_edit import edit_split, edit_vocabulary, layout_scene, render_edit

SIZE = 32  # the shapes world's image size
MAX_SEQUENCE_LENGTH = 8  # T5 tokens: the longest instruction ("move the triangle to the left") is 6 words + </s>


def to_tensor(images) -> torch.Tensor:
    """PIL images → float [n, 3, H, W] in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(np.stack([np.asarray(i, dtype=np.float32) for i in images])).permute(0, 3, 1, 2) / 127.5 - 1


def draw_triples(n: int, split: str, rng: random.Random):
    """n (input, target) image tensors [n, 3, 32, 32] and their instructions: edits of ``split``
    drawn uniformly, each laid out afresh."""
    edits = edit_split(split)
    inputs, targets, prompts = [], [], []
    for _ in range(n):
        edit = rng.choice(edits)
        record = {**edit, "objects": layout_scene(edit, rng, SIZE)}
        source, target = render_edit(record, SIZE)
        inputs.append(source)
        targets.append(target)
        prompts.append(edit["prompt"])
    return to_tensor(inputs), to_tensor(targets), prompts


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Images [n, 3, H, W] → (posterior mean − shift) · scale [n, C, h, w]: Kontext's input latents
    (``_encode_vae_image`` takes the mode) and the flow targets (posterior means, as shapes-sd3)."""
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    return torch.cat([(vae.encode(images[i:i + batch]).latent_dist.mode() - shift) * scale
                      for i in range(0, len(images), batch)])


def build_pipeline(source: str, layers: int, single_layers: int, heads: int, head_dim: int, t5_hidden: int,
                   t5_layers: int, seed: int):
    """shapes-kontext before training (module docstring)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    source = resolve_model_path(source)
    vae = AutoencoderKL.from_pretrained(source, subfolder="vae")
    clip = CLIPTextModel.from_pretrained(source, subfolder="text_encoder")  # the projection is not read by FLUX
    clip_tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer")
    t5_tokenizer = build_t5_tokenizer(edit_vocabulary())
    t5 = T5EncoderModel(T5Config(**_t5_config(t5_tokenizer, t5_hidden, t5_layers)))
    third = head_dim // 4  # rotary axes (image index, row, column), summing to head_dim as FLUX's (16, 56, 56)
    rope = (head_dim - 4 * third, 2 * third, 2 * third)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip.config.hidden_size, guidance_embeds=False, axes_dims_rope=rope)
    return FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER), vae=vae,
                               text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer,
                               transformer=transformer)


def flow_loss(adapter, x0: torch.Tensor, image_latents: torch.Tensor, prompts: list[str], noise: torch.Tensor,
              sigma: torch.Tensor) -> torch.Tensor:
    """Rectified-flow MSE for targets x0 [B, C, h, w] given the input latents [B, C, h, w] and σ [B]."""
    pipe = adapter.pipe
    embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH)
    n, c, h, w = image_latents.shape
    cond = Conditioning({"embeds": embeds, "pooled": pooled,
                         "image_latents": pipe._pack_latents(image_latents, n, c, h, w)})
    s = sigma.view(-1, 1, 1, 1)
    v = adapter.predict((1 - s) * x0 + s * noise, sigma * 1000, cond, model=pipe.transformer)
    return F.mse_loss(v, noise - x0)


@torch.no_grad()
def edit_accuracy(adapter, records: list[dict], seeds: list[int], steps: int) -> dict:
    """Held-out η = 0 edits of ``records`` (× ``seeds``) scored by the ``shapes_edit`` reward:
    the mean of each component."""
    from flowalign.evaluation import sample_pairs
    from reward_models.shapes_edit import ShapesEditVerifier

    pairs = [(r, s) for r in records for s in seeds]
    images = sample_pairs(adapter, pairs, steps, 1.0, batch_size=64)
    scores = ShapesEditVerifier()(images, [r["prompt"] for r, _ in pairs], [r for r, _ in pairs])
    return {k: round(v.mean().item(), 4) for k, v in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pipelines/demo_models/shapes-kontext")
    parser.add_argument("--source", default="shapes-sd3", help="the model whose VAE, first CLIP encoder and "
                        "tokenizer are reused (a demo name or folder)")
    parser.add_argument("--dataset", type=int, default=20_000, help="train triples, drawn and encoded once")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--logit-mean", type=float, default=0.5, help="σ = sigmoid(mean + std·z), as shapes-sd3")
    parser.add_argument("--logit-std", type=float, default=1.0)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--t5-hidden", type=int, default=64)
    parser.add_argument("--t5-layers", type=int, default=2)
    parser.add_argument("--sample-steps", type=int, default=10, help="Euler steps of the accuracy probes")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--accuracy-every", type=int, default=1000)
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this wall time "
                        "(0: run all --steps); the lr schedule is set for --steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from pipelines.flux_kontext import FluxKontextAdapter
    from reward_models.worlds.shapes_edit import write_edit_prompts
    from flowalign.prompts import load_prompts
    from scripts.pretrain_shapes import _optimizer

    torch.set_num_threads(args.threads)
    start = time.time()
    rng = random.Random(args.seed)
    pipe = build_pipeline(args.source, args.layers, args.single_layers, args.heads, args.head_dim, args.t5_hidden,
                          args.t5_layers, args.seed)
    pipe.vae.eval().requires_grad_(False)
    adapter = FluxKontextAdapter(pipe, height=SIZE, width=SIZE, max_sequence_length=MAX_SEQUENCE_LENGTH)

    source, target, prompts = draw_triples(args.dataset, "train", rng)
    inputs, targets = encode_latents(pipe.vae, source), encode_latents(pipe.vae, target)
    del source, target
    held_src, held_tgt, held_prompts = draw_triples(256, "test", random.Random(12345))
    held_in, held_x0 = encode_latents(pipe.vae, held_src), encode_latents(pipe.vae, held_tgt)
    g_held = torch.Generator().manual_seed(1)
    held_noise = torch.randn(held_x0.shape, generator=g_held)
    held_sigma = torch.sigmoid(args.logit_mean + args.logit_std * torch.randn(len(held_x0), generator=g_held))
    test_dir = Path(tempfile.mkdtemp(prefix="shapes-edit-test-"))
    test_records = load_prompts(str(write_edit_prompts(test_dir, "test", seed=0, size=SIZE)))
    print(f"{len(prompts)} train triples, {len(test_records)} held-out edits; "
          f"data ready after {(time.time() - start) / 60:.1f} min")

    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    opt, sched = _optimizer(params, args.steps, args.lr)
    ema = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(args.seed)
    log = {"held_out_loss": [], "train_loss": [], "edit_accuracy": []}

    def with_ema(fn):
        """fn() run with the EMA weights in place (what is saved and sampled), the raw ones restored."""
        raw = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, ema)
        for m in modules:
            m.eval()
        try:
            return fn()
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, raw)
            for m in modules:
                m.train()

    def probe(step: int) -> None:
        acc = with_ema(lambda: edit_accuracy(adapter, test_records, [0], args.sample_steps))
        log["edit_accuracy"].append({"step": step, "minutes": round((time.time() - start) / 60, 2), **acc})
        print(f"step {step}: held-out (EMA, η = 0, {args.sample_steps} steps) {acc}", flush=True)

    running, step = [], 0
    bar = tqdm(range(args.steps), desc="flow", mininterval=30)
    for step in bar:
        idx = torch.randint(len(prompts), (args.batch,), generator=g)
        sigma = torch.sigmoid(args.logit_mean + args.logit_std * torch.randn(args.batch, generator=g))
        noise = torch.randn((args.batch, *targets.shape[1:]), generator=g)
        loss = flow_loss(adapter, targets[idx], inputs[idx], [prompts[i] for i in idx.tolist()], noise, sigma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(args.ema, (1 + step) / (10 + step))  # warm-up: early weights are forgotten fast
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        running.append(loss.item())
        if (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                for m in modules:
                    m.eval()
                held = flow_loss(adapter, held_x0, held_in, held_prompts, held_noise, held_sigma).item()
                for m in modules:
                    m.train()
            log["train_loss"].append({"step": step + 1, "loss": round(sum(running) / len(running), 5)})
            log["held_out_loss"].append({"step": step + 1, "loss": round(held, 5),
                                         "minutes": round((time.time() - start) / 60, 2)})
            print(f"step {step + 1}: train {sum(running) / len(running):.4f}, held-out {held:.4f}, "
                  f"{(time.time() - start) / 60:.1f} min", flush=True)
            running = []
        if (step + 1) % args.accuracy_every == 0 and step + 1 < args.steps:
            probe(step + 1)
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            print(f"stopping at step {step + 1}: --max-minutes {args.max_minutes} reached")
            break
    steps_done = step + 1
    with torch.no_grad():
        torch._foreach_copy_(params, ema)
    for m in modules:
        m.eval()
    final = edit_accuracy(adapter, test_records, [0, 1], args.sample_steps)
    log["edit_accuracy"].append({"step": steps_done, "minutes": round((time.time() - start) / 60, 2), "seeds": 2,
                                 **final})
    print(f"final held-out (EMA, η = 0, seeds 0-1): {final}")

    out = Path(args.out)
    pipe.save_pretrained(out)
    (out / "pretraining.json").write_text(json.dumps(
        {"command": " ".join(["python", *sys.argv]), **vars(args), "steps_done": steps_done,
         "train_triples": len(prompts), "held_out_edits": len(test_records),
         "reused": f"VAE, first CLIP text encoder and tokenizer of {args.source}",
         "minutes": round((time.time() - start) / 60, 2), **log}, indent=2))
    print(f"saved to {out} after {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
