"""Video-first sampling of the built-in audio-video model (pipelines/av_demo.py): the schedule, the
pipeline against the RL rollout, the waiting stream, the forward process DiffusionNFT trains on,
and its pre-training loss (scripts/pretrain_av.py)."""

import random

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.objectives.diffusion_nft import diffusion_nft_loss
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from script_module import load_script
from reward_models.worlds.audio_video import prompt_split, sample_specs, vocabulary
from pipelines import load_adapter
from pipelines.av_demo import AVPipeline, TinyAVSizes, build_tiny_av_pipeline, video_first_levels, video_first_schedule
from test_av_routing_trainer import av_config

PROMPTS = [s["prompt"] for s in prompt_split("test")[:3]]


pretrain_av = load_script("pretrain_av")


@pytest.fixture(scope="module")
def video_first_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-av-video-first")
    pipe = build_tiny_av_pipeline(vocabulary(), TinyAVSizes(layers=2), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the zero-initialised output and adaLN layers: give them weights
        for p in pipe.model.parameters():
            if not p.any():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    pipe.set_sampling_order("video_first")
    pipe.save_pretrained(path)
    return path


@pytest.fixture
def adapter(video_first_dir):
    return load_adapter("av_demo", str(video_first_dir))


def test_schedule_runs_the_video_then_the_audio_and_levels_follow_the_phase():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    tau = video_first_schedule(sigmas)
    assert tau.tolist() == [2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25, 0.0]
    sigma_video, sigma_audio, video_moves = video_first_levels(tau)
    assert sigma_video.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert sigma_audio.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert video_moves.tolist() == [True] * 4 + [False] * 5  # τ = 1 starts the audio's phase


def test_sampling_order_is_saved_and_checked(video_first_dir, tmp_path):
    pipe = AVPipeline.from_pretrained(video_first_dir)
    assert pipe.sampling_order == "video_first"
    pipe.set_sampling_order("joint")
    pipe.save_pretrained(tmp_path)
    assert AVPipeline.from_pretrained(tmp_path).sampling_order == "joint"
    with pytest.raises(ValueError, match="sampling_order"):
        pipe.set_sampling_order("audio_first")
    with pytest.raises(ValueError, match="even"):
        AVPipeline.from_pretrained(video_first_dir)(PROMPTS[:1], num_inference_steps=3)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_ode_rollout_equals_the_pipeline_and_each_phase_moves_one_stream(adapter, guidance):
    steps = 6
    noise = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(3))
    schedule = adapter.schedule(steps)
    assert schedule.num_steps == steps and schedule.sigmas[0] == 2 and schedule.sigmas[steps // 2] == 1
    traj = rollout(adapter, adapter.encode(PROMPTS), noise, schedule, plan_steps(steps, len(PROMPTS), 0.0),
                   guidance_scale=guidance)
    out = adapter.pipe(PROMPTS, num_inference_steps=steps, guidance_scale=guidance, latents=noise)
    assert (traj.samples - out.latents).abs().max().item() <= 1e-5
    video, audio = adapter.branch_masks()
    halfway = traj.latents[:, steps // 2]
    assert torch.equal(halfway[:, audio], noise[:, audio])  # the audio waits while the video forms
    assert (halfway[:, video] - noise[:, video]).abs().mean() > 0.1
    assert torch.equal(traj.samples[:, video], halfway[:, video])  # then the video stays as it was
    assert (traj.samples[:, audio] - halfway[:, audio]).abs().mean() > 0.1


def test_the_audio_phase_reads_the_finished_video(adapter):
    """Change only the video at the start of the audio phase: the audio the model makes changes with it."""
    video, audio = adapter.branch_masks()
    x = adapter.initial_noise(2, torch.Generator().manual_seed(4))
    other = x.clone()
    other[:, video] = torch.randn(2, int(video.sum()), generator=torch.Generator().manual_seed(5))
    cond = adapter.encode(PROMPTS[:2])
    with torch.no_grad():
        v, v_other = (adapter.predict(z, torch.tensor(500.0), cond) for z in (x, other))
    assert torch.equal(v[:, video], torch.zeros_like(v[:, video]))
    assert (v[:, audio] - v_other[:, audio]).abs().max() > 1e-3


def test_forward_process_noises_each_stream_to_its_level_and_trains_the_moving_one(adapter):
    video, audio = adapter.branch_masks()
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, video.numel(), generator=g)
    eps = torch.randn(2, video.numel(), generator=g)
    tau = torch.tensor([1.75, 0.5])  # sample 0: video phase at σ_v 0.75; sample 1: audio phase at σ_a 0.5
    target, x_t, sigma = adapter.forward_noised(x0, eps, tau)
    assert sigma.tolist() == [0.75, 0.5]
    torch.testing.assert_close(x_t[0, video], 0.25 * x0[0, video] + 0.75 * eps[0, video])
    torch.testing.assert_close(x_t[0, audio], eps[0, audio])  # the waiting audio: pure noise
    torch.testing.assert_close(x_t[1, video], x0[1, video])  # the finished video: clean
    torch.testing.assert_close(x_t[1, audio], 0.5 * x0[1, audio] + 0.5 * eps[1, audio])
    assert torch.equal(target[0, audio], x_t[0, audio]) and torch.equal(target[1, video], x0[1, video])

    # the NFT loss at the model's own velocity: its gradient reaches only the moving stream's output
    cond = adapter.encode(PROMPTS[:2])
    v = adapter.predict(x_t, 1000 * tau, cond).requires_grad_(True)
    v_old = 0.9 * v.detach()  # like v_θ, 0 on the waiting stream (the old policy is the same model)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, target, sigma, torch.tensor([0.9, 0.2]), beta=1.0)
    loss.backward()
    assert v.grad[0, audio].abs().max() == 0 and v.grad[1, video].abs().max() == 0
    assert v.grad[0, video].abs().max() > 0 and v.grad[1, audio].abs().max() > 0
    # joint order: the ordinary forward process
    adapter.pipe.set_sampling_order("joint")
    target, x_t, sigma = adapter.forward_noised(x0, eps, torch.tensor([0.75, 0.5]))
    torch.testing.assert_close(x_t, (1 - sigma[:, None]) * x0 + sigma[:, None] * eps)
    assert torch.equal(target, x0)


def test_pretraining_draws_the_two_phases_of_video_first_sampling():
    sigma, trains = pretrain_av.noise_levels(4000, torch.Generator().manual_seed(0), video_first=1.0)
    video_phase = trains[:, 1] == 0
    assert 0.45 < video_phase.float().mean() < 0.55
    assert (sigma[video_phase, 1] == 1).all() and (trains[video_phase] == torch.tensor([1.0, 0.0])).all()
    audio_phase = ~video_phase
    assert (sigma[audio_phase, 0] == 0).all() and (trains[audio_phase] == torch.tensor([0.0, 1.0])).all()
    assert 0.35 < (sigma[audio_phase, 1] > 0.8).float().mean() < 0.5  # U(0, 1) shifted by 3: 43 % above 0.8
    # without the flag the levels are shared and both streams train, on the same random stream as before
    shared, both = pretrain_av.noise_levels(8, torch.Generator().manual_seed(0))
    assert torch.equal(shared[:, 0], shared[:, 1]) and both.eq(1).all()


def test_pretraining_loss_leaves_out_the_stream_a_phase_does_not_generate(video_first_dir):
    """A batch entirely in the video phase: scaling the model's audio output does not change the loss."""
    pipe = AVPipeline.from_pretrained(video_first_dir)
    specs = sample_specs(4, random.Random(0))
    seed = next(s for s in range(200)
                if (pretrain_av.noise_levels(4, torch.Generator().manual_seed(s), video_first=1.0)[1][:, 1] == 0).all())

    def loss(audio_scale: float) -> float:
        with torch.no_grad():
            pipe.model.audio_out.proj.weight.mul_(audio_scale)
            value = pretrain_av.flow_loss(pipe, specs, random.Random(1), torch.Generator().manual_seed(seed),
                                          drop=0.0, video_first=1.0).item()
            pipe.model.audio_out.proj.weight.div_(audio_scale)
        return value

    assert loss(3.0) == pytest.approx(loss(1.0), rel=1e-6)
    with torch.no_grad():  # the joint loss of the same draw does count the audio
        joint = pretrain_av.flow_loss(pipe, specs, random.Random(1), torch.Generator().manual_seed(seed), drop=0.0)
    assert joint.item() != pytest.approx(loss(1.0), rel=1e-3)


def test_only_ode_diffusion_nft_trains_a_video_first_model(video_first_dir, tmp_path):
    with pytest.raises(ConfigError, match="video-first"):
        Trainer(av_config(video_first_dir, tmp_path, "sampling.num_steps=4", "method=flow_grpo", "sampling.eta=0.7"))
    with pytest.raises(ConfigError, match="sampling.eta"):
        Trainer(av_config(video_first_dir, tmp_path, "sampling.num_steps=4", "sampling.eta=0.5"))
    trainer = Trainer(av_config(video_first_dir, tmp_path, "sampling.num_steps=4", "train.epochs=1",
                                "routing.reweight=true", "routing.influence=true"))
    trainer.train()
    (row,) = trainer.history
    assert row["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(row["train/policy_loss"]))


def test_a_stage_record_nests_the_stage_it_continued_and_sums_the_minutes(tmp_path):
    import argparse
    import json

    args = argparse.Namespace(lr=1e-3)
    first = pretrain_av.stage_record(args, None, 2.0, 10)
    assert first["init"] is None and first["total_minutes"] == 2.0 and first["steps_taken"] == 10
    (tmp_path / "pretraining.json").write_text(json.dumps(first))
    second = pretrain_av.stage_record(args, str(tmp_path), 3.0, 5, sizes={"d": 8})
    assert second["init"] == first and second["total_minutes"] == 5.0 and second["sizes"] == {"d": 8}
