"""Does the audio-video model's audio read its video? Two probes behind docs/audio_video.md
("What the model's audio reads").

    python scripts/probe_av_reading.py losses pipelines/demo_models/av-demo
    OMP_NUM_THREADS=2 python scripts/probe_av_reading.py conditional pipelines/demo_models/av-demo \\
        --out runs/av-stage1 --minutes 5
    python scripts/probe_av_reading.py coupling pipelines/demo_models/av-demo [--order joint]
    python scripts/probe_av_reading.py coupling av-demo --weights runs/av-nft/final --steps 10

``losses``: the audio flow loss with a clean video, the clip's own vs another clip's of the same
prompt, at several audio noise levels (``pretrain_av.audio_loss_own_vs_other_video``); equal
losses mean the audio ignores the video.

``coupling``: ``pretrain_av.quick_eval`` of the model over the test prompts × ``--seeds``
(``--steps`` ODE steps): every reward component, ``coupling`` (sync minus sync against another
seed's audio of the same prompt), ``no_touch`` (the fraction of clips whose video shows no wall
touch: sync 0 whatever the audio), ``sync_given_touch`` (mean sync of the other clips),
``onsets`` (audio onsets per clip) and ``video_informs_audio``, sampled in the model's own order
or ``--order``'s; ``--weights`` fuses a run's trained weights (its ``final/``) in first.

``conditional``: trains only the case where the video alone can tell when to beep (clean video,
audio at σ_a ~ U(``--sigma-min``, 1), audio loss only, the model's weights, constant lr, no EMA),
with ``cross_modal_window`` 0, printing ``video_informs_audio`` every 200 steps, and saves the
result (the first stage of the two-stage pre-training; continue it with
``pretrain_av.py --init OUT --conditional 0.3``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from reward_models.worlds.audio_video import clip_batch, sample_specs
from pipelines.av_demo import AVPipeline
from pipelines.base import resolve_model_path
from pretrain_av import audio_loss_own_vs_other_video, quick_eval, stage_record, video_informs_audio


def train_conditional(pipe: AVPipeline, minutes: float, lr: float, sigma_min: float, batch: int, seed: int) -> int:
    params = list(pipe.model.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    audio_mask = pipe.joint_layout.masks()[1]
    start, step = time.time(), 0
    while (time.time() - start) / 60 < minutes:
        specs = sample_specs(batch, rng)
        video, audio, _ = clip_batch(specs, rng)
        x0 = pipe.pack_clip(video, audio)
        text, pooled = pipe.encode_prompt([s["prompt"] for s in specs])
        sigma_audio = sigma_min + (1 - sigma_min) * torch.rand(batch, 1, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        x = torch.where(audio_mask, (1 - sigma_audio) * x0 + sigma_audio * noise, x0)
        v = pipe.velocity(x, torch.cat([torch.zeros(batch, 1), 1000 * sigma_audio], 1), text, pooled)
        loss = ((v - (noise - x0))[:, audio_mask] ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0:
            print(f"step {step} ({(time.time() - start) / 60:.1f} min) loss {loss.item():.4f} "
                  f"video_informs_audio {video_informs_audio(pipe)}", flush=True)
        step += 1
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["losses", "coupling", "conditional"])
    parser.add_argument("model", help="a saved AVPipeline folder or a built-in demo name (av-demo)")
    parser.add_argument("--sigmas", default="0.3,0.6,0.9,0.95,0.98,1.0", help="losses: audio noise levels")
    parser.add_argument("--out", help="conditional: where to save the trained model")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--sigma-min", type=float, default=0.8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=8, help="coupling: seeds per test prompt")
    parser.add_argument("--steps", type=int, default=16, help="coupling: sampling steps")
    parser.add_argument("--order", choices=["joint", "video_first"], default=None,
                        help="coupling: sample in this order instead of the model's own")
    parser.add_argument("--weights", default=None, help="coupling: a run's trained weights (its final/)")
    args = parser.parse_args()
    if args.weights:
        from pipelines import load_adapter

        pipe = load_adapter("av_demo", args.model, trained=args.weights).pipe
    else:
        pipe = AVPipeline.from_pretrained(resolve_model_path(args.model))
    if args.probe == "losses":
        for sigma in (float(s) for s in args.sigmas.split(",")):
            own, other = audio_loss_own_vs_other_video(pipe, sigma)
            print(f"σ_a {sigma}: audio loss with its own video {own:.4f}, with another clip's {other:.4f}")
        return
    if args.probe == "coupling":
        pipe.set_progress_bar_config(disable=True)
        if args.order:
            pipe.set_sampling_order(args.order)
        print(json.dumps({"model": args.model, "weights": args.weights, "order": pipe.sampling_order, "steps": args.steps,
                          **quick_eval(pipe, n_seeds=args.seeds, steps=args.steps)}))
        return
    if not args.out:
        parser.error("conditional needs --out")
    pipe.model.set_cross_modal_window(0)
    start = time.time()
    steps = train_conditional(pipe, args.minutes, args.lr, args.sigma_min, args.batch, args.seed)
    pipe.save_pretrained(args.out)
    (Path(args.out) / "pretraining.json").write_text(json.dumps(
        stage_record(args, args.model, (time.time() - start) / 60, steps), indent=2))
    print(f"video_informs_audio {video_informs_audio(pipe)}; saved to {args.out}")


if __name__ == "__main__":
    main()
