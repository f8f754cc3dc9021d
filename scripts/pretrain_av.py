"""Pre-train the built-in audio-video demo model (an ``AVPipeline``, ``pipelines/av_demo.py``) on a CPU.

Clips are drawn on the fly by ``reward_models.worlds.audio_video`` from the *whole* prompt space (the
"web data" of this world, as ``pretrain_shapes.py`` does; RL later trains on the train split).
The ``AVDiffusionModel`` and the CLIP text encoder learn rectified flow on the joint latents
x0 (video pixels in [−1, 1] and the waveform, as tokens): velocity target ε − x0, logit-normal σ,
10 % of captions dropped to "" (the CFG branch); the loss is the video elements' mean squared
error plus the audio elements' (each branch weighs the same, though the video has 12× as many
elements). An EMA of the weights (``--ema``) is what gets saved. Every ``--eval-every`` steps the
EMA model samples the held-out prompts (ODE, fixed seeds) and prints the ``audio_video`` reward.

The result is saved with ``save_pretrained`` (safetensors), its settings in ``pretraining.json``;
``--baseline`` then writes ``baseline.json``: every reward component of the base model on the
test prompts (``flowalign.evaluation.evaluate``: ODE, guidance 1, seeds 0…7, 16 steps).

    OMP_NUM_THREADS=1 python scripts/pretrain_av.py --out pipelines/demo_models/av-demo --steps 5000
    OMP_NUM_THREADS=1 python scripts/pretrain_av.py --baseline-only --out pipelines/demo_models/av-demo

``--init FOLDER`` continues from a saved model (a fresh optimiser and schedule). ``quick_eval``
also prints ``coupling``: sync minus the sync of the same videos paired with the audio of another
seed of the same prompt. A model that draws its beeps independently of its video scores ≈ 0
there, however high its sync (which the prompt's speed alone can raise); ``video_informs_audio``
is the same question asked of the loss (``video_informs_audio()``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from reward_models.worlds.audio_video import clip_batch, prompt_split, sample_specs, vocabulary
from pipelines.av_demo import AVPipeline, TinyAVSizes, build_tiny_av_pipeline

DEMO_SIZES = TinyAVSizes(dim=96, layers=4, heads=4, mlp_ratio=4, text_hidden=32, text_layers=2, max_prompt_tokens=16)
BASELINE = {"prompts": "av:test", "seeds": list(range(8)), "steps": 16, "guidance": 1.0}


def shifted(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift σ ↦ sσ / (1 + (s − 1)σ): s > 1 moves mass toward pure noise."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def noise_levels(b: int, g: torch.Generator, shift: float = 1.0, independent: float = 0.0,
                 conditional: float = 0.0, video_first: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each clip's noise levels (σ_video, σ_audio) [B, 2] and which streams' losses it trains
    [B, 2] (1 or 0). σ is logit-normal, shifted by ``shift``, and shared by both streams, except for

    * a fraction ``independent`` of the clips, whose streams each draw σ uniformly from [0, 1]
      (UniDiffuser's independent per-modality timesteps; the model reads both levels);
    * a fraction ``conditional``, in which one stream (video or audio, even odds) is clean
      (σ = 0: the condition) and the other draws σ from U(0, 1) shifted by 3 toward noise, where
      the condition decides the most: p(audio | video) and p(video | audio);
    * a fraction ``video_first``, the two phases of video-first sampling (``pipelines/av_demo.py``),
      even odds: the video at the shared σ with the audio pure noise (σ_a = 1), training the
      video's loss only (p(video | text)), or the video clean and the audio at σ from U(0, 1)
      shifted by 3, training the audio's loss only (p(audio | video, text)).

    Why: a beep is so loud that its own noisy samples reveal it up to σ ≈ 0.95, so with a shared
    σ the audio is predictable from the audio alone wherever logit-normal σ puts its mass, and
    the loss never rewards reading the video; a model trained so draws its beeps without looking
    at its ball (docs/audio_video.md)."""
    sigma = shifted(torch.sigmoid(torch.randn(b, 1, generator=g)), shift).expand(b, 2).clone()  # (video, audio)
    kind = torch.rand(b, generator=g)
    own = kind < independent
    sigma[own] = torch.rand(int(own.sum()), 2, generator=g)
    cond = (kind >= independent) & (kind < independent + conditional)
    generated = shifted(torch.rand(b, generator=g), 3.0)
    audio_given_video = torch.rand(b, generator=g) < 0.5
    sigma[cond] = torch.stack([torch.where(audio_given_video, 0.0, generated),
                               torch.where(audio_given_video, generated, 0.0)], 1)[cond]
    trains = torch.ones(b, 2)
    if video_first > 0:  # (drawn only then: the other modes' random streams stay as they were)
        phased = (kind >= independent + conditional) & (kind < independent + conditional + video_first)
        video_phase = torch.rand(b, generator=g) < 0.5
        first, second = phased & video_phase, phased & ~video_phase
        sigma[first, 1] = 1.0
        sigma[second] = torch.stack([torch.zeros(b), generated], 1)[second]
        trains[first, 1] = 0.0
        trains[second, 0] = 0.0
    return sigma, trains


def flow_loss(pipe: AVPipeline, specs: list[dict], rng: random.Random, g: torch.Generator,
              drop: float = 0.1, independent: float = 0.0, conditional: float = 0.0,
              shift: float = 1.0, video_first: float = 0.0) -> torch.Tensor:
    """Rectified-flow loss on fresh clips of ``specs`` at the levels of ``noise_levels``: per stream,
    the mean squared error over its elements, averaged over the clips that train it; the two
    streams' losses summed."""
    video, audio, _ = clip_batch(specs, rng)
    x0 = pipe.pack_clip(video, audio)
    b = len(specs)
    prompts = [s["prompt"] if rng.random() > drop else "" for s in specs]
    text, pooled = pipe.encode_prompt(prompts)
    sigma, trains = noise_levels(b, g, shift, independent, conditional, video_first)
    masks = pipe.joint_layout.masks()
    sigma_el = torch.where(masks[1], sigma[:, 1:], sigma[:, :1])  # [B, D]: each element its stream's σ
    noise = torch.randn(x0.shape, generator=g)
    xt = (1 - sigma_el) * x0 + sigma_el * noise
    v = pipe.velocity(xt, sigma * 1000, text, pooled)
    err = (v - (noise - x0)) ** 2
    return sum((w * err[:, m].mean(1)).sum() / w.sum().clamp(min=1.0) for m, w in zip(masks, trains.T))


@torch.no_grad()
def quick_eval(pipe: AVPipeline, n_seeds: int = 2, steps: int = 16) -> dict[str, float]:
    """Mean ``audio_video`` components over the test prompts × ``n_seeds`` (ODE, guidance 1)."""
    from reward_models.audio_video import AudioVideoReward, audio_onsets, sync, track_ball, visual_events

    specs = [s for s in prompt_split("test") for _ in range(n_seeds)]
    noise = torch.cat([torch.randn((1, pipe.joint_layout.numel), generator=torch.Generator().manual_seed(k % n_seeds))
                       for k in range(len(specs))])
    out = pipe([s["prompt"] for s in specs], num_inference_steps=steps, latents=noise)
    samples = pipe.decode_latents(out.latents)
    scores = AudioVideoReward()(samples, [s["prompt"] for s in specs], specs)
    other_seed = torch.arange(len(specs)).view(-1, n_seeds).roll(1, dims=1).flatten()  # same prompt, next seed
    track = track_ball(samples.video)
    scores["coupling"] = scores["sync"] - sync(track, samples.audio.flatten(1)[other_seed])
    touch = torch.tensor([bool(events) for events in visual_events(track)])
    scores["no_touch"] = (~touch).float()  # sync 0 whatever the audio
    scores["sync_given_touch"] = scores["sync"][touch]
    scores["onsets"] = torch.tensor([float(len(o)) for o in audio_onsets(samples.audio.mean(1))])
    return {**{k: round(v.mean().item(), 4) for k, v in scores.items()}, "video_informs_audio": video_informs_audio(pipe)}


@torch.no_grad()
def audio_loss_own_vs_other_video(pipe: AVPipeline, sigma_audio: float,
                                  clips_per_prompt: int = 2) -> tuple[float, float]:
    """The model's audio flow loss with the audio at ``sigma_audio`` and a clean video: (the
    clip's own video, another clip's of the same prompt). Every prompt × ``clips_per_prompt``,
    fixed clips and noise."""
    specs = [s for s in prompt_split("all") for _ in range(clips_per_prompt)]
    video, audio, _ = clip_batch(specs, random.Random(0))
    x0 = pipe.pack_clip(video, audio)
    audio_mask = pipe.joint_layout.masks()[1]
    text, pooled = pipe.encode_prompt([s["prompt"] for s in specs])
    other = torch.arange(len(specs)).view(-1, clips_per_prompt).roll(1, dims=1).flatten()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([[0.0, 1000 * sigma_audio]]).expand(len(specs), 2)
    losses = []
    for clean in (x0, x0[other]):
        x = torch.where(audio_mask, (1 - sigma_audio) * x0 + sigma_audio * noise, clean)
        v = pipe.velocity(x, t, text, pooled)
        losses.append(((v - (noise - x0))[:, audio_mask] ** 2).mean().item())
    return losses[0], losses[1]


def video_informs_audio(pipe: AVPipeline, sigma_audio: float = 0.98) -> float:
    """How much the model's audio prediction uses the video: ``audio_loss_own_vs_other_video``'s
    other − own. 0 for a model that ignores its video; an ideal one gains ≈ the audio's variance
    (≈ 0.1) near σ_a = 1."""
    own, other = audio_loss_own_vs_other_video(pipe, sigma_audio)
    return round(other - own, 4)


def train(pipe: AVPipeline, steps: int, batch: int, lr: float, ema_decay: float, rng: random.Random,
          max_minutes: float, eval_every: int, independent: float = 0.0, conditional: float = 0.0,
          shift: float = 1.0, video_first: float = 0.0) -> tuple[AVPipeline, int]:
    """AdamW with warm-up and cosine decay to 10 %; returns (the EMA pipeline, steps taken)."""
    params = [p for m in (pipe.model, pipe.text_encoder) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, min(200, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    ema = copy.deepcopy(pipe)
    ema_params = [p for m in (ema.model, ema.text_encoder) for p in m.parameters()]
    for p in ema_params:
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    start, step = time.time(), 0
    bar = tqdm(range(steps), desc="flow", mininterval=30)
    for step in bar:
        loss = flow_loss(pipe, sample_specs(batch, rng), rng, g, independent=independent,
                         conditional=conditional, shift=shift, video_first=video_first)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(ema_decay, (1 + step) / (10 + step))  # short warm-up of the average
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1 - decay)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if eval_every and step and step % eval_every == 0:
            print(f"step {step} ({(time.time() - start) / 60:.1f} min) loss {loss.item():.4f} "
                  f"eval {quick_eval(ema)}", flush=True)
        if (time.time() - start) / 60 > max_minutes:
            print(f"stopping at step {step}: --max-minutes {max_minutes} reached", flush=True)
            break
    return ema, step + 1


def measure_baseline(out: Path) -> dict:
    """``baseline.json``: every reward component of the saved model on ``BASELINE``'s prompts and seeds."""
    from flowalign.evaluation import Policy, evaluate
    from flowalign.prompts import load_prompts
    from reward_models.base import build_reward

    records = load_prompts(BASELINE["prompts"])
    with tempfile.TemporaryDirectory() as tmp:
        summary = evaluate([Policy("base", None)], records, {"audio_video": build_reward("audio_video")}, tmp,
                           model=str(out), family="av_demo", seeds=BASELINE["seeds"], steps=BASELINE["steps"],
                           guidance=BASELINE["guidance"], batch_size=24)
    result = {**BASELINE, "sampling": "ODE", "metrics": summary["base"]}
    (out / "baseline.json").write_text(json.dumps(result, indent=2))
    return result


def stage_record(args, init: str | None, minutes: float, steps: int, **extra) -> dict:
    """A stage's pretraining.json: its arguments, steps and minutes, the record of the stage it
    continued (``init``'s pretraining.json, nested; None for a model built from scratch) and
    ``total_minutes`` over every stage so far."""
    earlier = Path(init) / "pretraining.json" if init else None
    done = json.loads(earlier.read_text()) if earlier is not None and earlier.is_file() else None
    before = done.get("total_minutes", done["minutes"]) if done else 0.0
    return {**vars(args), "steps_taken": steps, "minutes": minutes, "total_minutes": before + minutes, **extra,
            "init": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pipelines/demo_models/av-demo", help="output folder (diffusers format)")
    parser.add_argument("--init", default=None, help="continue from this saved model folder")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--independent-noise", type=float, default=0.0,
                        help="fraction of clips whose video and audio are noised to independent levels (flow_loss)")
    parser.add_argument("--cross-modal-window", type=int, default=None,
                        help="frames a token's cross-modal attention reaches (0: its own frame; default: all); "
                             "also switches a model loaded with --init")
    parser.add_argument("--conditional", type=float, default=0.0,
                        help="fraction of clips with one stream clean and the other noised (flow_loss)")
    parser.add_argument("--video-first", type=float, default=0.0,
                        help="fraction of clips in the two phases of video-first sampling (flow_loss); with "
                             "--sampling-order video_first the saved pipeline samples that way")
    parser.add_argument("--sampling-order", choices=["joint", "video_first"], default=None,
                        help="the saved pipeline's sampling order (default: the --init model's, else joint)")
    parser.add_argument("--sigma-shift", type=float, default=1.0,
                        help="shift of the shared logit-normal σ toward noise (SD3's shift; 1: none)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-minutes", type=float, default=40.0, help="stop (and save) after this long")
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--baseline", action="store_true", help="measure baseline.json after saving")
    parser.add_argument("--baseline-only", action="store_true", help="only measure baseline.json of --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.baseline_only:
        print(json.dumps(measure_baseline(out), indent=2))
        return
    rng = random.Random(args.seed)
    start = time.time()
    pipe = AVPipeline.from_pretrained(args.init) if args.init else build_tiny_av_pipeline(vocabulary(), DEMO_SIZES,
                                                                                           seed=args.seed)
    if args.cross_modal_window is not None:
        pipe.model.set_cross_modal_window(args.cross_modal_window)
    if args.sampling_order is not None:
        pipe.set_sampling_order(args.sampling_order)
    ema, taken = train(pipe, args.steps, args.batch, args.lr, args.ema, rng, args.max_minutes, args.eval_every,
                       args.independent_noise, args.conditional, args.sigma_shift, args.video_first)
    print(f"final eval (EMA): {quick_eval(ema, n_seeds=4)}", flush=True)
    ema.save_pretrained(out)
    minutes = (time.time() - start) / 60
    (out / "pretraining.json").write_text(json.dumps(stage_record(args, args.init, minutes, taken,
                                                                  sizes=vars(DEMO_SIZES)), indent=2))
    print(f"saved to {out} after {minutes:.1f} min", flush=True)
    if args.baseline:
        print(json.dumps(measure_baseline(out), indent=2))


if __name__ == "__main__":
    main()
