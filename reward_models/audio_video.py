"""Rewards of the audio-video world (``reward_models.worlds.audio_video``), exact and download-free.

Input: decoded audio-video samples, ``pipelines.joint.AudioVideoSamples`` (``.video`` float
[B, F, 3, H, W] in [0, 1], ``.audio`` float [B, A, T] in [−1, 1]: channels are averaged to mono;
[B, T] and a dict with those keys are accepted too), at the world's 8 frames of 16 × 16 and 64
audio samples per frame period (512 Hz).

Two readers turn a sample into measurements; the components are simple functions of them.

**Ball tracker** (per frame). Every pixel goes to its nearest palette colour (the background or a
ball colour); a pixel nearest a ball colour, within ``MAX_COLOR_DIST`` of it, is *foreground*.
A frame's ball is detected when it has ≥ ``MIN_AREA`` foreground pixels; its position is the
foreground centroid minus 1.5 (the top-left coordinate of the world's 4 × 4 ball), its colour the
majority colour of its foreground pixels.

**Onset detector.** RMS over windows of 16 samples (4 per frame period); a window is active when
its RMS exceeds max(½·the clip's largest window RMS, ``ONSET_FLOOR``); an onset is the start of a
run of active windows, its time in frames = window index / 4 (a beep starting at frame f's
period has its onset at exactly f). **Chunk spectrum**: the waveform cut into its 8 frame periods,
each DFT'd (64 samples: 8 Hz bins; the world's pitches 40, 80, 160 Hz are bins 5, 10, 20), powers
summed over periods (one-sided, Parseval-weighted). A *band* is a bin ± 1.

Components, each a float [B] in [0, 1] (a true clip scores 1 on every one):

* ``video_quality`` = mean of (a) palette fidelity: mean over pixels of
  max(0, 1 − d / ``PALETTE_TOL``), d the RGB distance to the nearest palette colour; (b) ball
  crispness: mean over frames of min(A, 12) / max(A, 12), A the foreground area (0 without a
  ball); (c) no flicker: the fraction of frames whose ball has the clip's majority colour;
  (d) physical motion (the world's physics: a ball reaches a wall in every clip and turns only
  there; since 2026-12-06, before which a ball turning in mid-air could score 1): ½·(reach + turns),
  reach = clip(1 − (g − ``WALL_TOL``) / ``REACH_TOL``, 0, 1) with g the ball's closest approach to
  a wall along its dominant axis of motion, turns = the mean of the same discount over the gaps at
  the frames where the ball reverses along that axis (both steps ≥ ``TURN_MIN`` px; 1 without a
  reversal); 0 without a tracked ball.
* ``audio_quality`` = spectral purity × loudness: purity = the energy of the strongest band over
  the total energy (1 for one pure tone; noise, clicks and a second pitch lower it); loudness =
  min(1, largest window RMS / (½·the beep's RMS)) (silence scores 0).
* ``text_video`` = mean of colour (fraction of frames whose detected ball has the caption's
  colour), axis (variance of the tracked position along the caption's axis over the total
  variance; 0 for a ball that moves less than 1 px²) and speed (max(0, 1 − |ŝ − s| / 2), ŝ the mean
  |step| between consecutive detected frames along the dominant axis of motion (the larger
  variance), s the caption's 2 or 4 px per frame). Each wrong attribute costs its third.
* ``text_audio`` = the energy in the caption pitch's band over the energy in the three pitch
  bands (0 when they hold no energy).
* ``sync`` = max(0, 1 − d̄ / ``SYNC_TOL``), d̄ the symmetric mean onset offset in frames:
  ½·(mean over visual events of the distance to the nearest audio onset + mean over audio onsets
  of the distance to the nearest visual event). Visual events are the frames where the tracked
  ball is within ``WALL_TOL`` px of a wall along its dominant axis of motion (the axis with the
  larger variance; the caption is not consulted). No onsets or no visual events: 0. Shifting a
  clip's audio by k frames moves each onset by k: a single-bounce clip then scores 1 − k / 3.
* ``sync_soft`` (a training signal, not part of ``score``): ``sync`` with a soft wall touch. With
  g the ball's closest approach to a wall (px, along the same axis), the events are the frames at
  gap ≤ max(g, ``WALL_TOL``) and the score is reach × (1 − d̄ / ``SYNC_TOL``)₊, reach =
  clip(1 − (g − ``WALL_TOL``) / ``REACH_TOL``, 0, 1). It equals ``sync`` on every clip whose ball
  touches a wall; a clip whose ball turns short of the walls, which ``sync`` scores 0 whatever its
  audio, scores the alignment of its onsets with the closest approach, discounted by the shortfall.
* ``score``: the mean of the five (the default single reward).
"""

from __future__ import annotations

import math

import torch

from reward_models.worlds.audio_video import (BALL, BALL_AREA, BEEP_AMPLITUDE, PITCHES, SAMPLE_RATE, SAMPLES_PER_FRAME,
                                          SPEEDS, TRAVEL)
from reward_models.worlds.shapes import BACKGROUND, COLORS
from reward_models.base import Reward, register_reward

PALETTE_TOL = 0.3  # RGB distance (channels in [0, 1]) at which a pixel's palette fidelity reaches 0
MAX_COLOR_DIST = 0.35  # a foreground pixel is at most this far from its ball colour
MIN_AREA = 3  # foreground pixels for a frame to have a ball
WALL_TOL = 1.0  # px: a tracked ball this close to a wall touches it
SYNC_TOL = 3.0  # frames: a mean onset offset of this much scores 0
REACH_TOL = 2.0  # px: a ball turning or stopping this far beyond WALL_TOL from the walls scores 0 reach
TURN_MIN = 0.5  # px: a reversal needs steps at least this long on both sides (tracking jitter is not a turn)
SPEED_TOL = 2.0  # px per frame: the gap between the two speeds
ONSET_WINDOW = 16  # samples
ONSET_FLOOR = 0.1  # RMS below which a window is silent
BEEP_RMS = BEEP_AMPLITUDE / math.sqrt(2)
_COLOR_NAMES = list(COLORS)
_PALETTE = torch.tensor([BACKGROUND, *COLORS.values()], dtype=torch.float32) / 255  # [1 + C, 3]
COMPONENTS = ("video_quality", "audio_quality", "text_video", "text_audio", "sync")


def _video_audio(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """→ video [B, F, 3, H, W], mono audio [B, T]."""
    video, audio = (samples["video"], samples["audio"]) if isinstance(samples, dict) else (samples.video, samples.audio)
    return video, audio.mean(1) if audio.ndim == 3 else audio


# --------------------------------------------------------------------------- readers


def track_ball(video: torch.Tensor) -> dict[str, torch.Tensor]:
    """video float [B, F, 3, H, W] in [0, 1] → per frame: ``detected`` bool [B, F], ``area``
    [B, F] foreground pixels, ``position`` [B, F, 2] top-left (x, y) (NaN where undetected),
    ``color`` long [B, F] index into ``COLORS`` (−1 where undetected), ``color_counts`` [B, F, C]
    and ``palette_fidelity`` [B] (see the module docstring)."""
    rgb = video.float().clamp(0, 1).permute(0, 1, 3, 4, 2)  # [B, F, H, W, 3]
    dist = torch.linalg.vector_norm(rgb[..., None, :] - _PALETTE.to(rgb), dim=-1)  # [B, F, H, W, 1 + C]
    nearest, label = dist.min(-1)
    fidelity = (1 - nearest / PALETTE_TOL).clamp(min=0).flatten(1).mean(1)
    fg = (label > 0) & (nearest <= MAX_COLOR_DIST)
    counts = torch.stack([(fg & (label == k + 1)).sum((-2, -1)) for k in range(len(COLORS))], -1).float()
    area = fg.sum((-2, -1)).float()
    h, w = video.shape[-2:]
    ys = torch.arange(h, dtype=torch.float32, device=video.device).view(h, 1)
    xs = torch.arange(w, dtype=torch.float32, device=video.device).view(1, w)
    fgf = fg.float()
    cx = (fgf * xs).sum((-2, -1)) / area.clamp(min=1)
    cy = (fgf * ys).sum((-2, -1)) / area.clamp(min=1)
    detected = area >= MIN_AREA
    offset = (BALL - 1) / 2
    position = torch.stack([cx, cy], -1) - offset
    position[~detected] = float("nan")
    color = torch.where(detected, counts.argmax(-1), torch.full_like(area, -1, dtype=torch.long))
    return {"detected": detected, "area": area, "position": position, "color": color, "color_counts": counts,
            "palette_fidelity": fidelity}


def audio_onsets(audio: torch.Tensor) -> list[list[float]]:
    """audio float [B, T] → per sample the onset times in frames (module docstring)."""
    b, t = audio.shape
    rms = audio.float().reshape(b, t // ONSET_WINDOW, ONSET_WINDOW).pow(2).mean(-1).sqrt()  # [B, W]
    threshold = torch.maximum(0.5 * rms.max(1, keepdim=True).values, torch.tensor(ONSET_FLOOR))
    active = rms > threshold
    start = active & ~torch.cat([torch.zeros_like(active[:, :1]), active[:, :-1]], 1)
    per_frame = SAMPLES_PER_FRAME / ONSET_WINDOW
    return [(torch.nonzero(row).flatten().float() / per_frame).tolist() for row in start]


def chunk_spectrum(audio: torch.Tensor) -> torch.Tensor:
    """audio float [B, T] → one-sided power per 8 Hz bin [B, 33], summed over frame periods
    (bins 1…31 doubled, so that the bins sum to 64 × Σ samples² (Parseval))."""
    b, t = audio.shape
    power = torch.fft.rfft(audio.float().reshape(b, t // SAMPLES_PER_FRAME, SAMPLES_PER_FRAME), dim=-1).abs() ** 2
    power = power.sum(1)
    power[:, 1:-1] *= 2
    return power


def _band(power: torch.Tensor, k: int) -> torch.Tensor:
    return power[:, max(k - 1, 0):k + 2].sum(1)


def pitch_bin(pitch: str) -> int:
    return round(PITCHES[pitch] * SAMPLES_PER_FRAME / SAMPLE_RATE)


# --------------------------------------------------------------------------- components


def video_quality(track: dict[str, torch.Tensor]) -> torch.Tensor:
    area = track["area"]
    crisp = (torch.minimum(area, torch.tensor(float(BALL_AREA))) / torch.maximum(area, torch.tensor(float(BALL_AREA))))
    crisp = torch.where(track["detected"], crisp, torch.zeros_like(crisp)).mean(1)
    majority = track["color_counts"].sum(1).argmax(-1)  # [B]
    steady = (track["color"] == majority[:, None]).float().mean(1)
    return (track["palette_fidelity"] + crisp + steady + physical_motion(track)) / 4


def _reach(gap: torch.Tensor) -> torch.Tensor:
    """Wall gaps (px) → 1 within WALL_TOL, falling linearly to 0 at REACH_TOL beyond it (same shape)."""
    return 1 - ((gap - WALL_TOL) / REACH_TOL).clamp(0, 1)


def physical_motion(track: dict[str, torch.Tensor]) -> torch.Tensor:
    """float [B]: ½·(reach + turns) (module docstring, video quality (d))."""
    out = []
    for along in _dominant_positions(track):
        if along is None:
            out.append(0.0)
            continue
        gap = _wall_gap(along)
        step = along[1:] - along[:-1]  # NaN next to an undetected frame: no reversal there
        before, after = step[:-1], step[1:]
        turning = (before * after < 0) & (before.abs() >= TURN_MIN) & (after.abs() >= TURN_MIN)
        turns = _reach(gap[1:-1][turning]).mean().item() if turning.any() else 1.0
        out.append(0.5 * (_reach(gap.min()).item() + turns))
    return torch.tensor(out, dtype=torch.float32)


def audio_quality(audio: torch.Tensor) -> torch.Tensor:
    power = chunk_spectrum(audio)
    total = power.sum(1)
    bands = torch.stack([_band(power, k) for k in range(1, power.shape[1] - 1)], 1)
    purity = torch.where(total > 1e-8, bands.max(1).values / total.clamp(min=1e-12), torch.zeros_like(total))
    b, t = audio.shape
    peak = audio.float().reshape(b, t // ONSET_WINDOW, ONSET_WINDOW).pow(2).mean(-1).sqrt().max(1).values
    return purity.clamp(0, 1) * (peak / (0.5 * BEEP_RMS)).clamp(max=1)


def text_video(track: dict[str, torch.Tensor], metadata: list[dict]) -> torch.Tensor:
    out = []
    for i, spec in enumerate(metadata):
        detected = track["detected"][i]
        want = _COLOR_NAMES.index(spec["color"])
        colour = ((track["color"][i] == want) & detected).float().mean().item()
        pos = track["position"][i][detected]  # [n, 2]
        axis = 0 if spec["axis"] == "horizontal" else 1
        if len(pos) < 2:
            out.append(colour / 3)
            continue
        var = pos.var(0, unbiased=False)
        along = (var[axis] / var.sum()).item() if var.sum() >= 1.0 else 0.0
        dominant = int(var.argmax())  # speed is judged along the axis the ball moves on, whichever it is
        both = detected[1:] & detected[:-1]
        steps = (track["position"][i][1:, dominant] - track["position"][i][:-1, dominant]).abs()[both]
        speed = max(0.0, 1 - abs(steps.mean().item() - SPEEDS[spec["speed"]]) / SPEED_TOL) if len(steps) else 0.0
        out.append((colour + along + speed) / 3)
    return torch.tensor(out, dtype=torch.float32)


def text_audio(audio: torch.Tensor, metadata: list[dict]) -> torch.Tensor:
    power = chunk_spectrum(audio)
    bands = {p: _band(power, pitch_bin(p)) for p in PITCHES}
    total = sum(bands.values())
    want = torch.stack([bands[spec["pitch"]][i] for i, spec in enumerate(metadata)]) if metadata else total
    return torch.where(total > 1e-8, want / total.clamp(min=1e-12), torch.zeros_like(total))


def _dominant_positions(track: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """Per sample float [F]: the tracked position along the axis of larger variance (NaN where
    undetected); None when fewer than two frames have a ball."""
    out = []
    for detected, pos in zip(track["detected"], track["position"]):
        seen = pos[detected]
        out.append(pos[:, int(seen.var(0, unbiased=False).argmax())] if len(seen) >= 2 else None)
    return out


def _wall_gap(along: torch.Tensor) -> torch.Tensor:
    """Positions along the axis of motion [F] (NaN where undetected) → distance to the nearer wall [F] (inf there)."""
    return torch.where(along.isnan(), torch.tensor(math.inf), torch.minimum(along, TRAVEL - along))


def wall_gaps(track: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """Per sample float [F]: the tracked ball's distance to the nearer wall along its dominant axis
    of motion (inf where undetected); None when fewer than two frames have a ball."""
    return [None if along is None else _wall_gap(along) for along in _dominant_positions(track)]


def visual_events(track: dict[str, torch.Tensor]) -> list[list[float]]:
    """Per sample the frames at which the tracked ball touches a wall along its dominant axis."""
    return [[] if gap is None else torch.nonzero(gap <= WALL_TOL).flatten().float().tolist()
            for gap in wall_gaps(track)]


def mean_onset_offset(events: list[float], onsets: list[float]) -> float:
    """½·(mean over events of the distance to the nearest onset + the same from onsets to events),
    in frames; inf when either is empty."""
    if not events or not onsets:
        return math.inf
    e, o = torch.tensor(events, dtype=torch.float32), torch.tensor(onsets, dtype=torch.float32)
    d = (e[:, None] - o[None, :]).abs()
    return 0.5 * (d.min(1).values.mean() + d.min(0).values.mean()).item()


def sync(track: dict[str, torch.Tensor], audio: torch.Tensor) -> torch.Tensor:
    offsets = [mean_onset_offset(e, o) for e, o in zip(visual_events(track), audio_onsets(audio))]
    return torch.tensor([max(0.0, 1 - d / SYNC_TOL) for d in offsets], dtype=torch.float32)


def sync_soft(track: dict[str, torch.Tensor], audio: torch.Tensor) -> torch.Tensor:
    """``sync`` with a soft wall touch (module docstring): float [B], equal to ``sync`` where the ball touches."""
    out = []
    for gap, onsets in zip(wall_gaps(track), audio_onsets(audio)):
        if gap is None:
            out.append(0.0)
            continue
        closest = gap.min()
        events = torch.nonzero(gap <= max(closest.item(), WALL_TOL)).flatten().float().tolist()
        out.append(_reach(closest).item() * max(0.0, 1 - mean_onset_offset(events, onsets) / SYNC_TOL))
    return torch.tensor(out, dtype=torch.float32)


@register_reward("audio_video")
class AudioVideoReward(Reward):
    """The audio-video world's rewards (module docstring), one component each, plus their mean.

    >>> import random
    >>> from reward_models.worlds.audio_video import clip_batch, prompt_split
    >>> video, audio, meta = clip_batch(prompt_split("test")[:2], random.Random(0))
    >>> out = AudioVideoReward()({"video": video, "audio": audio}, [m["prompt"] for m in meta], meta)
    >>> [round(v, 4) for v in out["sync"].tolist()], round(out["score"].min().item(), 4)
    ([1.0, 1.0], 1.0)
    """

    components = (*COMPONENTS, "score", "sync_soft")
    modality = "audio_video"

    def __call__(self, samples, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """samples: ``.video`` [B, F, 3, H, W] in [0, 1] and ``.audio`` [B, 1, T]; metadata: the
        prompt specs (color, speed, axis, pitch). Returns {component: float [B]}."""
        video, audio = _video_audio(samples)
        video, audio = video.detach().float().cpu(), audio.detach().float().cpu()
        track = track_ball(video)
        out = {"video_quality": video_quality(track), "audio_quality": audio_quality(audio),
               "text_video": text_video(track, metadata), "text_audio": text_audio(audio, metadata),
               "sync": sync(track, audio)}
        out["score"] = torch.stack([out[k] for k in COMPONENTS]).mean(0)
        out["sync_soft"] = sync_soft(track, audio)
        return out
