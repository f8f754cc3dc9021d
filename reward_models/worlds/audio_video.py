"""The audio-video world: a coloured ball bouncing between two walls, beeping at every wall touch.

The built-in analogue of a joint audio-video benchmark, small enough to train and score on a CPU.
A clip lasts one second:

* video: ``FRAMES`` = 8 frames (``FPS`` = 8) of ``SIZE`` × ``SIZE`` = 16 × 16 RGB, float
  [F, 3, H, W] in [0, 1]: a ``BALL`` × ``BALL`` = 4 × 4 ball (corners cut: 12 pixels) in one of
  the shapes world's colours on its light background;
* audio: a mono waveform of ``SAMPLES_PER_FRAME`` = 64 samples per frame period, i.e.
  ``AUDIO_SAMPLES`` = 512 samples at ``SAMPLE_RATE`` = 512 Hz, float [T] in [−1, 1]: silence,
  except a beep during the frame period of every wall touch.

Motion. The ball moves along one axis ("left and right": x, "up and down": y) at ``SPEEDS`` px per
frame ("slowly" 2, "quickly" 4), reflected off the walls; its top-left coordinate along the axis
stays in [0, ``TRAVEL``] = [0, 12] and the other coordinate is fixed. The start position is a
multiple of the speed (12 is divisible by both), so the ball is *at* a wall exactly at some frames
— the **event frames** (at least one per clip: a slow ball touches a wall every 6 frames, a fast one
every 3). Which frames these are depends on the random start position and direction, which the
caption does not name: a model can only synchronise its beeps by looking at its own video.

Sound. A beep is ``BEEP_AMPLITUDE``·sin(2π·f·n / SAMPLE_RATE) over the 64 samples of an event
frame's period, n counted from the period's start (phase 0), at the caption's pitch f (``PITCHES``:
low 40 Hz, medium 80 Hz, high 160 Hz: 5, 10, 20 whole cycles per frame period, so each beep is
exactly one bin of a 64-sample DFT and a true clip's spectrum is pure).

Captions name colour, speed, axis and pitch: "a red ball bouncing quickly left and right with a
high beep". A prompt *spec* is a plain dict::

    {"prompt": "...", "tag": "fast", "color": "red", "speed": "fast", "axis": "horizontal",
     "pitch": "high"}

(``tag``: the speed, the evaluation's category). ``generate_clip`` draws one clip for a spec and
returns its tensors and per-clip metadata (the spec plus ``start``, ``direction``, ``offset``,
``positions`` [F] top-left (x, y), ``event_frames``).

Prompt splits are fixed (seeded by the world's name, not by a run): of the 4 · 2 · 2 · 3 = 48
attribute combinations a quarter (12) are held out as ``"test"``; every single attribute value
still occurs in ``"train"``, so the test prompts are unseen *combinations*. Registered as the
prompt sets ``av:train``, ``av:test``, ``av:all`` (``flowalign.prompts``).
"""

from __future__ import annotations

import copy
import itertools
import random
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from reward_models.worlds.shapes import BACKGROUND, COLORS

FRAMES = 8
FPS = 8
SIZE = 16
BALL = 4
TRAVEL = SIZE - BALL  # the top-left coordinate runs over [0, TRAVEL]
SAMPLES_PER_FRAME = 64
SAMPLE_RATE = FPS * SAMPLES_PER_FRAME  # 512 Hz
AUDIO_SAMPLES = FRAMES * SAMPLES_PER_FRAME  # 512
BEEP_AMPLITUDE = 0.8
SPEEDS = {"slow": 2, "fast": 4}  # px per frame; both divide TRAVEL
SPEED_WORDS = {"slow": "slowly", "fast": "quickly"}
AXES = {"horizontal": "left and right", "vertical": "up and down"}
PITCHES = {"low": 40.0, "medium": 80.0, "high": 160.0}  # Hz: 5, 10, 20 cycles per frame period
TEST_FRACTION = 0.25
SPLIT_SEED_NAME = "audio_video"

# the ball's pixels within its BALL × BALL box: a square with the four corners cut
BALL_MASK = np.ones((BALL, BALL), bool)
BALL_MASK[[0, 0, -1, -1], [0, -1, 0, -1]] = False
BALL_AREA = int(BALL_MASK.sum())  # 12


def caption(color: str, speed: str, axis: str, pitch: str) -> str:
    return f"a {color} ball bouncing {SPEED_WORDS[speed]} {AXES[axis]} with a {pitch} beep"


def all_specs() -> list[dict]:
    """Every prompt of the world (48), in a fixed order."""
    return [{"prompt": caption(c, s, a, p), "tag": s, "color": c, "speed": s, "axis": a, "pitch": p}
            for c, s, a, p in itertools.product(COLORS, SPEEDS, AXES, PITCHES)]


def prompt_split(split: str) -> list[dict]:
    """The fixed ``"train"`` (36) / ``"test"`` (12) / ``"all"`` (48) prompts (module docstring)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    specs = all_specs()
    if split == "all":
        return specs
    order = list(range(len(specs)))
    random.Random(zlib.crc32(SPLIT_SEED_NAME.encode())).shuffle(order)
    n_test = round(TEST_FRACTION * len(specs))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [specs[i] for i in sorted(chosen)]


def vocabulary() -> list[str]:
    """Every word of every caption (for building the demo model's tokenizer)."""
    return sorted({w for spec in all_specs() for w in spec["prompt"].split()})


# --------------------------------------------------------------------------- generation


def reflect(position: np.ndarray | int, travel: int = TRAVEL) -> np.ndarray:
    """Fold positions on the line into [0, travel] as reflections off walls at 0 and travel."""
    p = np.mod(position, 2 * travel)
    return np.where(p > travel, 2 * travel - p, p)


def trajectory(speed: str, start: int, direction: int) -> np.ndarray:
    """The along-axis top-left coordinate at every frame: int [F]. start ∈ [0, TRAVEL], a multiple
    of the speed; direction ±1."""
    s = SPEEDS[speed]
    if start % s or not 0 <= start <= TRAVEL:
        raise ValueError(f"start must be a multiple of {s} in [0, {TRAVEL}], got {start}")
    return reflect(start + direction * s * np.arange(FRAMES)).astype(int)


def event_frames(along: np.ndarray) -> list[int]:
    """Frames at which the ball touches a wall (its along-axis coordinate is 0 or TRAVEL)."""
    return [int(f) for f in np.nonzero((along == 0) | (along == TRAVEL))[0]]


def render_video(color: str, positions: np.ndarray) -> np.ndarray:
    """positions int [F, 2] top-left (x, y) → video float32 [F, 3, H, W] in [0, 1]."""
    video = np.empty((len(positions), SIZE, SIZE, 3), np.float32)
    video[:] = np.array(BACKGROUND, np.float32) / 255
    rgb = np.array(COLORS[color], np.float32) / 255
    for f, (x, y) in enumerate(positions):
        box = video[f, y:y + BALL, x:x + BALL]
        box[BALL_MASK] = rgb
    return video.transpose(0, 3, 1, 2)


def beep(pitch: str, samples: int = SAMPLES_PER_FRAME) -> np.ndarray:
    """One beep: float32 [samples], BEEP_AMPLITUDE·sin(2π f n / SAMPLE_RATE) from phase 0."""
    n = np.arange(samples)
    return (BEEP_AMPLITUDE * np.sin(2 * np.pi * PITCHES[pitch] * n / SAMPLE_RATE)).astype(np.float32)


def render_audio(pitch: str, events: list[int] | tuple[int, ...], frames: int = FRAMES) -> np.ndarray:
    """A beep in the period of every event frame, silence elsewhere: float32 [frames·64]."""
    audio = np.zeros(frames * SAMPLES_PER_FRAME, np.float32)
    for f in events:
        if 0 <= f < frames:
            audio[f * SAMPLES_PER_FRAME:(f + 1) * SAMPLES_PER_FRAME] = beep(pitch)
    return audio


@dataclass
class Clip:
    """video float32 [F, 3, H, W] in [0, 1]; audio float32 [T] in [−1, 1]; metadata: the spec plus
    start, direction, offset (the fixed cross-axis coordinate), positions [F][x, y], event_frames."""

    video: np.ndarray
    audio: np.ndarray
    metadata: dict


def generate_clip(spec: dict, rng: random.Random) -> Clip:
    """One clip satisfying ``spec`` (color, speed, axis, pitch); start, direction and the fixed
    coordinate are drawn from ``rng``."""
    s = SPEEDS[spec["speed"]]
    start = s * rng.randrange(TRAVEL // s + 1)
    direction = rng.choice((-1, 1))
    offset = rng.randint(0, TRAVEL)
    along = trajectory(spec["speed"], start, direction)
    other = np.full(FRAMES, offset)
    positions = np.stack([along, other] if spec["axis"] == "horizontal" else [other, along], axis=1)
    events = event_frames(along)
    metadata = {**copy.deepcopy(spec), "start": start, "direction": direction, "offset": offset,
                "positions": positions.tolist(), "event_frames": events}
    return Clip(render_video(spec["color"], positions), render_audio(spec["pitch"], events), metadata)


def sample_specs(n: int, rng: random.Random, split: str = "all") -> list[dict]:
    """``n`` specs drawn uniformly from a split."""
    specs = prompt_split(split)
    return [copy.deepcopy(rng.choice(specs)) for _ in range(n)]


def clip_batch(specs: list[dict], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Clips for B specs: video float32 [B, F, 3, H, W] in [0, 1], audio float32 [B, T], metadata."""
    clips = [generate_clip(spec, rng) for spec in specs]
    return (torch.from_numpy(np.stack([c.video for c in clips])), torch.from_numpy(np.stack([c.audio for c in clips])),
            [c.metadata for c in clips])
