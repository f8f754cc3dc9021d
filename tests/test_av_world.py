"""The audio-video world and its rewards: true clips score 1, each kind of mistake costs what the
definitions in reward_models/audio_video.py say it costs."""

import random

import numpy as np
import pytest
import torch

from flowalign.prompts import load_prompts
from reward_models.worlds.audio_video import (AUDIO_SAMPLES, COLORS, FRAMES, PITCHES, SAMPLES_PER_FRAME, SIZE, SPEEDS,
                                          TRAVEL, all_specs, clip_batch, event_frames, generate_clip, prompt_split,
                                          render_audio, render_video, trajectory)
from pipelines.joint import AudioVideoSamples
from reward_models.audio_video import (COMPONENTS, AudioVideoReward, audio_onsets, mean_onset_offset, physical_motion,
                                       track_ball)
from reward_models.base import available_rewards, build_reward


def _spec(**attrs):
    return next(s for s in all_specs() if all(s[k] == v for k, v in attrs.items()))


def _clip(spec, start, direction, offset=5, events_shift=0, pitch=None):
    """A hand-built clip: video [1, F, 3, H, W], audio [1, T] and its event frames."""
    along = trajectory(spec["speed"], start, direction)
    other = np.full(FRAMES, offset)
    positions = np.stack([along, other] if spec["axis"] == "horizontal" else [other, along], axis=1)
    events = event_frames(along)
    video = torch.from_numpy(render_video(spec["color"], positions))[None]
    audio = torch.from_numpy(render_audio(pitch or spec["pitch"], [e + events_shift for e in events]))[None]
    return video, audio, events


def _score(video, audio, spec):
    return AudioVideoReward()({"video": video, "audio": audio}, [spec["prompt"]] * len(video), [spec] * len(video))


def test_splits_are_fixed_disjoint_and_cover_every_attribute():
    train, test, every = prompt_split("train"), prompt_split("test"), prompt_split("all")
    assert (len(train), len(test), len(every)) == (36, 12, 48)
    assert {s["prompt"] for s in train}.isdisjoint({s["prompt"] for s in test})
    assert {s["prompt"] for s in train} | {s["prompt"] for s in test} == {s["prompt"] for s in every}
    for key, values in (("color", COLORS), ("speed", SPEEDS), ("pitch", PITCHES), ("axis", ("horizontal", "vertical"))):
        assert {s[key] for s in train} == set(values)  # test prompts are held-out combinations only
    assert load_prompts("av:test") == test and load_prompts("av:train") == train
    assert prompt_split("test") == test  # seeded by the world's name, not by global state
    random.seed(123)
    assert prompt_split("test") == test


def test_generation_is_deterministic_and_beeps_at_wall_touches():
    spec = _spec(speed="fast", axis="vertical")
    a, b = generate_clip(spec, random.Random(7)), generate_clip(spec, random.Random(7))
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio) and a.metadata == b.metadata
    assert a.video.shape == (FRAMES, 3, SIZE, SIZE) and a.audio.shape == (AUDIO_SAMPLES,)
    for seed in range(20):
        clip = generate_clip(spec, random.Random(seed))
        ys = [p[1] for p in clip.metadata["positions"]]
        events = clip.metadata["event_frames"]
        assert events == [f for f, y in enumerate(ys) if y in (0, TRAVEL)] and len(events) >= 2
        assert all(abs(ys[f + 1] - ys[f]) == SPEEDS["fast"] for f in range(FRAMES - 1))
        loud = np.abs(clip.audio.reshape(FRAMES, SAMPLES_PER_FRAME)).max(1) > 0
        assert np.nonzero(loud)[0].tolist() == events


def test_true_clips_score_one_on_every_component():
    specs = [s for s in all_specs() for _ in range(2)]
    video, audio, meta = clip_batch(specs, random.Random(0))
    out = AudioVideoReward()(AudioVideoSamples(video, audio[:, None], 512, 8.0), [m["prompt"] for m in meta], meta)
    assert set(out) == {*COMPONENTS, "score", "sync_soft"}
    for name, values in out.items():
        assert values.shape == (len(specs),)
        assert torch.allclose(values, torch.ones_like(values), atol=1e-5), name
    assert "audio_video" in available_rewards() and isinstance(build_reward("audio_video"), AudioVideoReward)


@pytest.mark.parametrize("k", [-2, -1, 0, 1, 2, 3])
def test_shifting_the_audio_by_k_frames_costs_k_over_three(k):
    spec = _spec(speed="slow", axis="horizontal", color="blue", pitch="medium")
    video, audio, events = _clip(spec, start=6, direction=-1, events_shift=k)  # one wall touch, at frame 3
    assert events == [3]
    assert audio_onsets(audio) == [[3.0 + k]]
    out = _score(video, audio, spec)
    assert out["sync"].item() == pytest.approx(max(0.0, 1 - abs(k) / 3))
    assert out["sync_soft"].item() == out["sync"].item()  # the ball touches a wall: the soft touch changes nothing
    assert out["text_audio"].item() == pytest.approx(1.0) and out["audio_quality"].item() == pytest.approx(1.0)


def test_sync_is_the_symmetric_mean_offset_with_several_events():
    spec = _spec(speed="fast", axis="vertical", color="green", pitch="low")
    video, audio, events = _clip(spec, start=8, direction=1, events_shift=1)  # touches at 1, 4, 7; beeps at 2, 5
    assert events == [1, 4, 7] and audio_onsets(audio) == [[2.0, 5.0]]
    # events → nearest onset: 1, 1, 2 (mean 4/3); onsets → nearest event: 1, 1 (mean 1)
    assert mean_onset_offset([1, 4, 7], [2, 5]) == pytest.approx((4 / 3 + 1) / 2)
    assert _score(video, audio, spec)["sync"].item() == pytest.approx(1 - 7 / 18)


@pytest.mark.parametrize("closest, beep_at, soft", [(2, 3, 0.5), (2, 4, 0.5 * (1 - 1 / 3)), (3, 3, 0.0), (1, 3, 1.0)])
def test_sync_soft_scores_a_ball_that_turns_short_of_the_walls(closest, beep_at, soft):
    spec = _spec(speed="slow", axis="horizontal", color="red", pitch="low")
    along = [8, 6, 4, closest, 4, 6, 8, 9]  # nearest a wall (closest px) at frame 3 only
    video = torch.from_numpy(render_video(spec["color"], np.stack([along, np.full(FRAMES, 5)], 1)))[None]
    out = _score(video, torch.from_numpy(render_audio(spec["pitch"], [beep_at]))[None], spec)
    # reach = 1 − (closest − 1) / 2: ½ at 2 px, 0 at 3 px; the one event is frame 3, the one onset beep_at
    assert out["sync_soft"].item() == pytest.approx(soft)
    assert out["sync"].item() == (soft if closest <= 1 else 0.0)  # sync needs a touch (≤ 1 px)


@pytest.mark.parametrize("along, reach, turns", [
    ([8, 6, 4, 2, 4, 6, 8, 9], 0.5, 0.5),     # turns at 2 px: reach and the turn both ½
    ([8, 6, 4, 3, 4, 6, 8, 9], 0.0, 0.0),     # turns at 3 px: both 0
    ([10, 8, 6, 4, 2, 1, 3, 5], 1.0, 1.0),    # turns at 1 px (= WALL_TOL): physical
    ([0, 2, 4, 6, 8, 6, 4, 2], 1.0, 0.0),     # touches at frame 0, then turns in mid-air (4 px from a wall)
    ([0, 2, 4, 6, 8, 10, 10, 10], 1.0, 1.0),  # stops without turning: no reversal to judge
    ([6, 6, 6, 6, 7, 7, 7, 7], 0.0, 1.0),     # never reaches a wall and never reverses
    ([4, 12, 4, 12, 4, 12, 7, 5], 1.0, 0.6),  # five turns: three at a wall (12), two at 4 px; 7 → 5 is no reversal
])
def test_video_quality_scores_physical_motion(along, reach, turns):
    spec = _spec(speed="slow", axis="horizontal", color="red", pitch="low")
    video = torch.from_numpy(render_video(spec["color"], np.stack([along, np.full(FRAMES, 5)], 1)))[None]
    out = _score(video, torch.from_numpy(render_audio(spec["pitch"], [3]))[None], spec)
    # palette, crispness and colour are perfect: video quality = (3 + ½·(reach + turns)) / 4
    assert physical_motion(track_ball(video)).item() == pytest.approx(0.5 * (reach + turns))
    assert out["video_quality"].item() == pytest.approx((3 + 0.5 * (reach + turns)) / 4)


def test_wrong_pitch_fails_text_audio_only():
    spec = _spec(speed="slow", axis="horizontal", color="red", pitch="high")
    video, audio, _ = _clip(spec, start=0, direction=1, pitch="low")
    out = _score(video, audio, spec)
    assert out["text_audio"].item() < 1e-6
    for name in ("video_quality", "audio_quality", "text_video", "sync"):
        assert out[name].item() == pytest.approx(1.0), name


def test_wrong_colour_axis_or_speed_costs_a_third_of_text_video():
    spec = _spec(speed="slow", axis="horizontal", color="red", pitch="low")
    video, audio, _ = _clip(spec, start=2, direction=1)
    for wrong in (dict(color="yellow"), dict(axis="vertical"), dict(speed="fast")):
        other = _spec(**{**{k: spec[k] for k in ("color", "speed", "axis", "pitch")}, **wrong})
        assert _score(video, audio, other)["text_video"].item() == pytest.approx(2 / 3), wrong
    transposed = video.transpose(-1, -2)  # the ball now moves up and down
    out = _score(transposed, audio, spec)
    assert out["text_video"].item() == pytest.approx(2 / 3) and out["sync"].item() == pytest.approx(1.0)


def test_noise_silence_and_blank_video_score_low():
    spec = _spec(speed="fast", axis="horizontal", color="blue", pitch="medium")
    video, audio, _ = _clip(spec, start=0, direction=1)
    noisy = audio + 0.2 * torch.randn(audio.shape, generator=torch.Generator().manual_seed(0))
    assert _score(video, noisy, spec)["audio_quality"].item() < 0.8
    silent = _score(video, torch.zeros_like(audio), spec)
    assert silent["audio_quality"].item() == 0 and silent["text_audio"].item() == 0 and silent["sync"].item() == 0
    blank = _score(torch.full_like(video, 245 / 255), audio, spec)
    assert blank["video_quality"].item() == pytest.approx(1 / 4, abs=1e-3)  # palette fine, no ball, colour or motion
    assert blank["text_video"].item() == 0 and blank["sync"].item() == 0


def test_clips_write_as_wav_and_png_or_mp4(tmp_path):
    from flowalign.grids import as_image_cells, save_clip

    video, audio, _ = clip_batch(prompt_split("test")[:2], random.Random(0))
    cells = as_image_cells(AudioVideoSamples(video, audio[:, None], 512, 8.0))
    assert cells.shape == (2, 3, 2 * SIZE, FRAMES * SIZE)
    wav, png = save_clip(video[0], audio[0], tmp_path / "clip", fps=8, sample_rate=512)
    assert wav.stat().st_size == 44 + 2 * AUDIO_SAMPLES and png.is_file()
    pytest.importorskip("imageio_ffmpeg")
    (mp4,) = save_clip(video[0], audio[0][None], tmp_path / "clip.mp4", fps=8, sample_rate=512)
    assert mp4.suffix == ".mp4" and mp4.stat().st_size > 1000


def test_tracking_jitter_below_turn_min_is_not_a_turn():
    along = torch.tensor([10, 8, 6, 6.2, 6.0, 4, 2, 0])  # a 0.2 px wobble at 6 px from the wall, then on to it
    track = {"detected": torch.ones(1, FRAMES, dtype=torch.bool),
             "position": torch.stack([along, torch.full((FRAMES,), 5.0)], -1)[None]}
    assert physical_motion(track).item() == 1.0  # reaches the wall; the wobble's ±0.2 px steps are no reversal
    track["position"][0, 3:5, 0] = torch.tensor([7.0, 6.0])  # a real 1 px turn at 6 px from the wall
    assert physical_motion(track).item() == pytest.approx(0.5 * (1 + 0))
