"""Video rewards: a video-level temporal-consistency score, and any image reward applied per frame.

Videos arrive as the video families decode them (``pipelines/wan.py``): float [B, F, 3, H, W]
in [0, 1], F frames in time order (the layout of ``WanPipeline``'s ``output_type="pt"``).

* ``temporal_consistency`` scores the video as a whole, from pixel differences between
  consecutive frames (see the class).
* ``per_frame`` turns an image reward into a video reward: every frame is scored and the scores
  are averaged over frames. It is a wrapper named in the config rather than something the
  trainer does by itself when an image reward meets a video, because how a video is reduced to
  frames (all of them or a few, averaged) is a choice the run should state; the trainer refuses a
  reward that declares ``modality = "image"`` on a video family, with the setting to use.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from reward_models.base import Reward, build_reward, register_reward


def check_video(samples: torch.Tensor, who: str, min_frames: int = 1) -> None:
    """Raise a ValueError naming ``who`` unless samples is a video batch [B, F, 3, H, W] with F ≥ min_frames."""
    if not isinstance(samples, torch.Tensor) or samples.ndim != 5 or samples.shape[2] != 3:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"{who} scores videos float [B, F, 3, H, W] (a video family such as wan), got {shape}")
    if samples.shape[1] < min_frames:
        raise ValueError(f"{who} needs at least {min_frames} frames, got {samples.shape[1]}")


def frame_differences(videos: torch.Tensor, pool: int = 1) -> torch.Tensor:
    """Mean absolute difference between consecutive frames, per video.

    videos: float [B, F, 3, H, W] in [0, 1], F ≥ 2. Each frame is first average-pooled over
    ``pool`` × ``pool`` pixel blocks (1: no pooling; a partial block at the border is dropped).
    Returns float [B]: mean over the F − 1 consecutive pairs and over all channels and pooled
    pixels of |x_{f+1} − x_f|, in [0, 1].
    """
    b, f = videos.shape[:2]
    frames = videos.float().flatten(0, 1)  # [B·F, 3, H, W]
    if pool > 1:
        frames = F.avg_pool2d(frames, pool)
    frames = frames.view(b, f, *frames.shape[1:])
    return (frames[:, 1:] - frames[:, :-1]).abs().flatten(1).mean(1)


@register_reward("temporal_consistency")
class TemporalConsistency(Reward):
    """1 − mean |x_{f+1} − x_f|: how little consecutive frames differ (VBench's temporal-flickering score).

    What it rewards: frames that change little from one to the next, i.e. no flicker and smooth
    motion. ``pool`` > 1 compares ``pool`` × ``pool`` block averages, so pixel-level noise that
    averages out within a block (grain, dithering) is not penalised, only changes of coarser
    structure are. The score is in [0, 1]; 1 exactly when every frame equals the previous one.

    Hacking risk: the maximum is a *static* video (any still image, even a blank one, scores 1),
    and less motion always scores higher. Optimised alone it teaches the model to stop moving.
    Use it with a small weight next to a per-frame quality or prompt-alignment reward, or as an
    ``eval.extra_rewards`` check, and watch the samples.

    >>> still = torch.full((1, 4, 3, 8, 8), 0.5)                      # 4 identical frames
    >>> blink = torch.stack([torch.zeros(3, 8, 8), torch.ones(3, 8, 8)] * 2)[None]  # black, white, ...
    >>> reward = TemporalConsistency()
    >>> reward(torch.cat([still, blink]), ["a", "b"], [{}, {}])["temporal_consistency"].tolist()
    [1.0, 0.0]
    """

    components = ("temporal_consistency",)
    modality = "video"

    def __init__(self, pool: int = 1):
        if pool < 1:
            raise ValueError(f"pool must be ≥ 1 pixels, got {pool}")
        self.pool = pool

    def __call__(self, samples, prompts, metadata):
        """samples: float [B, F, 3, H, W] in [0, 1], F ≥ 2. Returns {"temporal_consistency": [B]}."""
        check_video(samples, "temporal_consistency", min_frames=2)
        return {"temporal_consistency": 1.0 - frame_differences(samples, self.pool).cpu()}


def frame_indices(num_frames: int, frames: Optional[int]) -> torch.Tensor:
    """The frames scored: all of them (``frames`` None), else ``frames`` evenly spaced ones, first
    and last included (rounded like ``flowalign.grids.contact_sheet``). long [F']."""
    if frames is None or frames >= num_frames:
        return torch.arange(num_frames)
    return torch.linspace(0, num_frames - 1, frames).round().long()


@register_reward("per_frame")
class PerFrame(Reward):
    """Any registered image reward applied to every frame of a video and averaged over frames.

    ``reward``: the image reward's registered name, built with ``reward_kwargs``; ``frames``: score
    only this many evenly spaced frames (first and last included), to bound the cost of a neural
    reward on long videos (None: all). The components are the image reward's, under the same
    names, so ``reward.weights`` reads as it would for images. For each video b and component c:

        score_c[b] = mean over the scored frames f of image_reward(frame (b, f))[c]

    The image reward sees all B·F' frames in one call, frame-major (every video's first frame,
    then every video's second, ...), each with its video's prompt and metadata plus ``"frame"``
    (the frame index); a group-level reward (``pref_grpo``) thus compares frames within a group's
    videos. A frame scored NaN makes its video's score NaN (the trainer drops that sample): a
    video is scored on all its frames or not at all.

    Config: ``reward: {name: per_frame, kwargs: {reward: jpeg_compressibility}, weights:
    {jpeg_compressibility: 1.0}}``.

    >>> videos = torch.zeros(2, 3, 3, 16, 16)
    >>> videos[1, 1:] = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # video 1: noise
    >>> scores = PerFrame("jpeg_compressibility")(videos, ["a", "b"], [{}, {}])["jpeg_compressibility"]
    >>> bool(scores[0] > scores[1])  # blank frames compress better
    True
    """

    modality = "video"

    def __init__(self, reward: str, reward_kwargs: Optional[dict] = None, frames: Optional[int] = None):
        if frames is not None and frames < 1:
            raise ValueError(f"frames must be ≥ 1 (or None: every frame), got {frames}")
        self.image_reward = build_reward(reward, **(reward_kwargs or {}))
        if getattr(self.image_reward, "modality", None) == "video":
            raise ValueError(f"reward {reward!r} already scores videos; per_frame wraps image rewards")
        self.name, self.frames = reward, frames
        self.components = tuple(getattr(self.image_reward, "components", ()))

    def __call__(self, samples, prompts, metadata):
        """samples: float [B, F, 3, H, W] in [0, 1]. Returns {component: [B]}, the frame means."""
        check_video(samples, f"per_frame({self.name})")
        b = samples.shape[0]
        index = frame_indices(samples.shape[1], self.frames).tolist()
        frames = samples[:, index].transpose(0, 1).flatten(0, 1)  # [F'·B, 3, H, W], frame-major
        frame_prompts = [p for _ in index for p in prompts]
        frame_metadata = [{**m, "frame": f} for f in index for m in metadata]
        scored = self.image_reward(frames, frame_prompts, frame_metadata)
        return {k: torch.as_tensor(v, dtype=torch.float32).cpu().view(len(index), b).mean(0)
                for k, v in scored.items()}
