"""The built-in audio-video model, its pipeline and adapter: save/load, the rollout equals the
pipeline's sampler, the cross-modal attention recorder, the joint layout, LoRA round trip."""

import json
import random
from pathlib import Path

import pytest
import torch

from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from reward_models.worlds.audio_video import AUDIO_SAMPLES, FRAMES, SIZE, clip_batch, prompt_split, vocabulary
from pipelines import load_adapter
from pipelines.av_demo import AVDemoAdapter, AVPipeline, TinyAVSizes, build_tiny_av_pipeline
from pipelines.base import DEMO_MODELS_DIR
from pipelines.joint import AudioVideoSamples
from reward_models.audio_video import AudioVideoReward

PROMPTS = [s["prompt"] for s in prompt_split("test")[:3]]
SIZES = TinyAVSizes(layers=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-av")
    pipe = build_tiny_av_pipeline(vocabulary(), SIZES, seed=0)
    # the output and adaLN layers start at zero (a velocity of 0): give them weights so the tests see a real model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pipe.model.parameters():
            if not p.any():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    pipe.save_pretrained(path)
    return path


@pytest.fixture
def adapter(tiny_dir):
    return load_adapter("av_demo", str(tiny_dir))


def _noise(adapter, n, seed=0):
    return adapter.initial_noise(n, torch.Generator().manual_seed(seed))


def test_save_load_round_trip_gives_the_same_clips(tiny_dir, tmp_path):
    pipe = AVPipeline.from_pretrained(tiny_dir)
    again = tmp_path / "again"
    pipe.save_pretrained(again)
    reloaded = AVPipeline.from_pretrained(again)
    a = pipe(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(1))
    b = reloaded(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.latents, b.latents)
    assert a.video.shape == (3, FRAMES, 3, SIZE, SIZE) and a.audio.shape == (3, 1, AUDIO_SAMPLES)
    assert json.loads((again / "model_index.json").read_text())["model"] == ["pipelines.av_model", "AVDiffusionModel"]


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_ode_rollout_equals_the_pipeline(adapter, guidance):
    steps = 4
    noise = _noise(adapter, len(PROMPTS), seed=3)
    traj = rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(steps), plan_steps(steps, len(PROMPTS), 0.0),
                   guidance_scale=guidance)
    out = adapter.pipe(PROMPTS, num_inference_steps=steps, guidance_scale=guidance, latents=noise)
    assert (traj.samples - noise).abs().mean() > 0.1  # the model moves the latents
    assert (traj.samples - out.latents).abs().max().item() <= 1e-5
    decoded = adapter.decode(traj.samples)
    assert isinstance(decoded, AudioVideoSamples) and (decoded.sample_rate, decoded.fps) == (512, 8.0)
    assert torch.allclose(decoded.video, out.video, atol=1e-5)


def test_pipeline_noise_is_the_adapters_initial_noise(adapter):
    out = adapter.pipe(PROMPTS[:2], num_inference_steps=2, generator=torch.Generator().manual_seed(5))
    again = adapter.pipe(PROMPTS[:2], num_inference_steps=2, latents=_noise(adapter, 2, seed=5))
    assert torch.equal(out.latents, again.latents)


def test_joint_layout_round_trips_clips_and_partitions_elements(adapter):
    video, audio, meta = clip_batch(prompt_split("test")[:2], random.Random(0))
    x0 = adapter.pipe.pack_clip(video, audio)
    assert x0.shape == (2, adapter.latent_shape()[0]) == (2, FRAMES * 3 * SIZE * SIZE + AUDIO_SAMPLES)
    decoded = adapter.decode(x0)
    assert torch.allclose(decoded.video, video, atol=1e-6) and torch.equal(decoded.audio[:, 0], audio)
    assert AudioVideoReward()(decoded, [m["prompt"] for m in meta], meta)["score"].min() > 0.999
    masks = adapter.branch_masks()
    assert masks.shape == (2, x0.shape[1]) and masks.sum(0).eq(1).all()
    assert masks[0].sum() == FRAMES * 3 * SIZE * SIZE and adapter.branches == ("video", "audio")
    # a token's weight lands on exactly that token's pixels
    layout = adapter.joint_layout
    weights = torch.zeros(1, layout.video_tokens)
    weights[0, 17] = 1.0  # frame 1, patch row 0, column 1 of the 4 × 4 grid
    elements = layout.expand_tokens(weights, torch.zeros(1, layout.audio_tokens))
    pixels = adapter.model.unpatchify_video(layout.unpack(elements)[0])
    assert pixels[0, 1, :, 0:4, 4:8].eq(1).all() and pixels.sum() == 3 * 16


def test_recorder_returns_attention_maps_whose_rows_sum_to_one(adapter):
    cond = adapter.encode(PROMPTS)
    x = _noise(adapter, len(PROMPTS))
    plain = adapter.predict(x, torch.tensor(700.0), cond)
    with adapter.record_cross_modal(maps=True) as recorder:
        recorded = adapter.predict(x, torch.tensor(700.0), cond)
    assert torch.allclose(plain, recorded, atol=1e-5)  # explicit softmax = SDPA
    layout, heads = adapter.joint_layout, SIZES.heads
    names = [f"blocks.{i}.{m}" for i in range(SIZES.layers) for m in ("audio_to_video_attn", "video_to_audio_attn")]
    assert sorted(recorder.records) == sorted(names)
    assert set(adapter.cross_modal_attention()) == set(names)
    for name in names:
        record = recorder.last(name)
        n_query, n_key = ((layout.video_tokens, layout.audio_tokens) if "audio_to_video" in name
                          else (layout.audio_tokens, layout.video_tokens))
        assert record.probs.shape == (len(PROMPTS), heads, n_query, n_key)
        assert torch.allclose(record.probs.sum(-1), torch.ones(len(PROMPTS), heads, n_query), atol=1e-5)
        assert torch.allclose(record.received_mass.sum(-1), torch.ones(len(PROMPTS), heads), atol=1e-5)
        assert record.output_norm.shape == record.residual_norm.shape == (len(PROMPTS), n_query)
        assert (record.response_ratio >= 0).all() and not record.probs.requires_grad
    for module in adapter.model.cross_modal_modules().values():
        assert module.recorder is None  # the context cleans up
    with adapter.record_cross_modal(maps=False) as recorder:
        adapter.predict(x, torch.tensor(300.0), cond)
    assert recorder.last(names[0]).probs is None and recorder.last(names[0]).output_norm.shape[0] == len(PROMPTS)


def test_lora_saves_and_loads_into_the_same_policy(adapter, tiny_dir, tmp_path):
    adapter.add_lora(rank=4, init=False)  # random B: the LoRA changes the output
    cond, x = adapter.encode(PROMPTS[:2]), _noise(adapter, 2)
    trained = adapter.predict(x, torch.tensor(500.0), cond)
    with adapter.reference():
        base = adapter.predict(x, torch.tensor(500.0), cond)
    assert not torch.allclose(trained, base)
    adapter.save_trained(tmp_path / "final")
    loaded = AVDemoAdapter.from_pretrained(str(tiny_dir), trained=str(tmp_path / "final"))
    assert torch.allclose(loaded.predict(x, torch.tensor(500.0), cond), trained, atol=1e-5)
    with pytest.raises(ValueError, match="num_frames"):
        AVDemoAdapter.from_pretrained(str(tiny_dir), num_frames=9)


def test_the_shipped_demo_model_loads_by_name_and_is_small():
    folder = DEMO_MODELS_DIR / "av-demo"
    if not (folder / "model_index.json").is_file():
        pytest.skip("the demo model has not been pre-trained yet (scripts/pretrain_av.py)")
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    assert size <= 10 * 2**20
    adapter = load_adapter("av_demo", "av-demo")
    assert adapter.latent_shape() == (FRAMES * 3 * SIZE * SIZE + AUDIO_SAMPLES,)
    baseline = json.loads((folder / "baseline.json").read_text())
    assert baseline["prompts"] == "av:test" and 0 <= baseline["metrics"]["audio_video/sync"] <= 1
    # it samples video-first (docs/audio_video.md), and pretraining.json records every stage that made it
    assert adapter.sampling_order == "video_first" and adapter.schedule(10).sigmas[0] == 2
    record = json.loads((folder / "pretraining.json").read_text())
    stage, minutes = record, []
    while stage:
        minutes.append(stage["minutes"])
        stage = stage.get("init")
    assert len(minutes) == 3
    assert record["total_minutes"] == pytest.approx(sum(minutes))


def _model_inputs(adapter, g):
    """Random video and audio tokens, text of two prompts and two timesteps for ``adapter.model``."""
    layout = adapter.model.joint_layout
    video = torch.randn(2, layout.video_tokens, layout.video_channels, generator=g)
    audio = torch.randn(2, layout.audio_tokens, layout.audio_channels, generator=g)
    return (video, audio, *adapter.pipe.encode_prompt(PROMPTS[:2]), torch.tensor([250.0, 700.0]))


def test_per_stream_noise_levels_reduce_to_the_shared_level_and_each_reaches_its_stream(adapter):
    model = adapter.model
    video, audio, text, pooled, t = _model_inputs(adapter, torch.Generator().manual_seed(3))
    with torch.no_grad():
        shared = model(video, audio, t, text, pooled)
        same = model(video, audio, torch.stack([t, t], 1), text, pooled)
        other_audio_level = model(video, audio, torch.stack([t, t.flip(0)], 1), text, pooled)
    for a, b in zip(shared, same):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (other_audio_level[1] - shared[1]).abs().max() > 1e-3  # the audio stream reads its own level


def test_cross_modal_window_limits_attention_to_nearby_frames_and_survives_save_load(adapter, tmp_path):
    model = adapter.model
    layout, per_frame_v = model.joint_layout, model.grid[0] * model.grid[1]
    per_frame_a = model.audio_tokens_per_frame
    g = torch.Generator().manual_seed(4)
    video, audio, text, pooled, t = _model_inputs(adapter, g)
    with torch.no_grad():
        full = model(video, audio, t, text, pooled)
        model.set_cross_modal_window(FRAMES)  # reaches every frame: the same as no window
        wide = model(video, audio, t, text, pooled)
        model.set_cross_modal_window(0)
        narrow = model(video, audio, t, text, pooled)
    for a, b in zip(full, wide):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (narrow[1] - full[1]).abs().max() > 1e-3

    # one cross-modal layer on its own: audio tokens of frame 3 read video frame 3 and nothing else
    layer = model.blocks[0].video_to_audio_attn
    video_sees_audio, audio_sees_video = model.cross_modal_masks()
    assert audio_sees_video.sum(1).eq(per_frame_v).all() and video_sees_audio.sum(1).eq(per_frame_a).all()
    h_v = torch.randn(2, layout.video_tokens, model.config.dim, generator=g)
    h_a = torch.randn(2, layout.audio_tokens, model.config.dim, generator=g)
    frame3 = slice(3 * per_frame_a, 4 * per_frame_a)
    elsewhere, own = h_v.clone(), h_v.clone()
    elsewhere[:, :3 * per_frame_v] += torch.randn(2, 3 * per_frame_v, model.config.dim, generator=g)
    own[:, 3 * per_frame_v:4 * per_frame_v] += torch.randn(2, per_frame_v, model.config.dim, generator=g)
    with torch.no_grad():
        base = layer(h_a, h_v, audio_sees_video)[:, frame3]
        torch.testing.assert_close(layer(h_a, elsewhere, audio_sees_video)[:, frame3], base, rtol=0, atol=0)
        assert (layer(h_a, own, audio_sees_video)[:, frame3] - base).abs().max() > 1e-3
        with model.record_cross_modal(maps=True) as recorder:
            recorded = model(video, audio, t, text, pooled)
    torch.testing.assert_close(recorded[1], narrow[1], rtol=0, atol=1e-5)  # explicit softmax = SDPA, masked
    probs = recorder.last("blocks.0.video_to_audio_attn").probs
    assert probs[..., ~audio_sees_video].eq(0).all()

    model.save_pretrained(tmp_path / "windowed")
    reloaded = type(model).from_pretrained(tmp_path / "windowed")
    assert reloaded.config.cross_modal_window == 0
    with pytest.raises(ValueError, match="cross_modal_window"):
        model.set_cross_modal_window(-1)
