"""DiffusionNFT with audio-video routing through the real trainer, on a tiny built-in AV model."""

import math

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.trainer import Trainer
from reward_models.worlds.audio_video import vocabulary
from pipelines.av_demo import TinyAVSizes, build_tiny_av_pipeline

WEIGHTS = "{video_quality: 1.0, audio_quality: 1.0, text_video: 1.0, text_audio: 1.0, sync: 2.0}"
CONCERNS = "{video_quality: [video], text_video: [video], audio_quality: [audio], text_audio: [audio]}"


@pytest.fixture(scope="module")
def tiny_av_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-av")
    pipe = build_tiny_av_pipeline(vocabulary(), TinyAVSizes(), seed=0)
    with torch.no_grad():  # the zero-initialised gates and output layer of a fresh model pass no gradient to a LoRA
        g = torch.Generator().manual_seed(1)
        for p in pipe.model.parameters():
            if not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pipe.save_pretrained(path)
    return path


def av_config(path, out, *overrides):
    """DiffusionNFT on the tiny av_demo (another ``method=`` among ``overrides``: without NFT's options)."""
    nft = not any(o.startswith("method=") for o in overrides)
    return load_config(None, [
        f"output_dir={out}", "model.family=av_demo", f"model.path={path}", "model.lora_rank=4", "tracker=none",
        "method=diffusion_nft", "sampling.eta=0.0", "sampling.num_steps=3", *(["train.noise_draws=2"] if nft else []),
        "data.train_prompts=av:train", "data.eval_prompts=av:test", "reward.name=audio_video",
        f"reward.weights={WEIGHTS}", "train.per_reward_advantages=true", f"routing.concerns={CONCERNS}",
        "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
        "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=1", "eval.grid_seeds=1", "eval.every=0",
        "checkpoint_every=0", "train.learning_rate=1e-3", *overrides])


def test_both_mechanisms_train_and_log_weights_scales_and_keep_priors_in_warmup(tiny_av_dir, tmp_path):
    trainer = Trainer(av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "routing.influence=true",
                                "routing.warmup=3"))
    priors = trainer.objective.router.priors.clone()
    assert priors[0].tolist() == [1.0, 0.0, 1.0, 0.0, 2.0] and priors[1].tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    trainer.train()
    first, second = trainer.history
    assert math.isfinite(first["train/policy_loss"]) and math.isfinite(second["train/policy_loss"])
    assert first["train/grad_norm"] > 0 and second["train/grad_norm"] > 0
    assert torch.equal(trainer.objective.router.weights, priors)  # both epochs trained inside the 3-epoch warm-up
    assert first["routing/weight_audio_sync"] == 2.0 and "routing/weight_video_audio_quality" not in first
    scales = [v for k, v in second.items() if k.startswith("routing/grad_scale_")]
    assert len(scales) == len(trainer.adapter.cross_modal_attention()) and all(0.25 <= v <= 4 for v in scales)
    assert trainer.objective.router.gram.abs().sum() > 0  # interactions were observed


def test_after_warmup_the_weights_move_but_keep_each_branchs_prior_mass(tiny_av_dir, tmp_path):
    trainer = Trainer(av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "routing.warmup=1"))
    trainer.train()
    w, priors = trainer.objective.router.weights, trainer.objective.router.priors
    assert torch.allclose(w.sum(1), priors.sum(1)) and torch.equal(w > 0, priors > 0)
    assert not torch.equal(w, priors)


def test_routing_needs_per_reward_advantages_an_av_family_and_known_components(tiny_av_dir, tmp_path, tiny_sd3_dir):
    with pytest.raises(ConfigError, match="routing.reweight"):
        av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "train.per_reward_advantages=false")
    with pytest.raises(ConfigError, match="routing.concerns"):
        av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "routing.concerns={loudness: [audio]}")
    with pytest.raises(ConfigError, match="routing.floor_gate.*none, all or conflicts"):
        av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "routing.floor_gate=sync")
    with pytest.raises(ConfigError, match="routing.floor_gate.*floor_strength > 0"):
        av_config(tiny_av_dir, tmp_path, "routing.reweight=true", "routing.floor_gate=all", "routing.floor_strength=0")
    with pytest.raises(ConfigError, match="audio-video"):
        Trainer(load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "tracker=none",
                                   "method=diffusion_nft", "routing.influence=true"]))


def test_layer_gradient_scales_reach_the_cross_modal_modules(tiny_av_dir, tmp_path):
    trainer = Trainer(av_config(tiny_av_dir, tmp_path, "routing.influence=true", "train.epochs=1",
                                "train.weight_decay=0.0"))  # decay would move a zero-gradient weight
    modules = trainer.adapter.cross_modal_attention()
    trainer.objective._layer_scales = {name: 0.0 for name in modules}  # a zero scale freezes a module's update
    cross = {id(p) for _, m in modules.values() for p in m.parameters() if p.requires_grad}
    before = {id(p): p.detach().clone() for p in trainer.params}
    trainer.train()
    moved = {i: not torch.equal(before[id(p)], p.detach()) for p in trainer.params for i in [id(p)]}
    assert cross and not any(moved[i] for i in cross)
    assert any(moved[i] for i in moved if i not in cross)


def test_rewards_of_another_modality_are_refused_before_the_model_loads(tiny_av_dir, tmp_path, tiny_sd3_dir):
    with pytest.raises(ConfigError, match=r"reward 'jpeg_compressibility' scores images, model family 'av_demo' "
                                          r"makes audio-videos"):
        Trainer(av_config(tiny_av_dir, tmp_path, "reward.name=jpeg_compressibility",
                          "reward.weights={jpeg_compressibility: 1.0}", "train.per_reward_advantages=false",
                          "routing.concerns={}"))
    with pytest.raises(ConfigError, match=r"reward 'audio_video' scores audio-videos, model family 'sd3' makes images"):
        Trainer(load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "tracker=none",
                                   "reward.name=audio_video", "reward.weights={sync: 1.0}"]))
    with pytest.raises(ConfigError, match="model.num_frames is for video and audio-video families"):
        Trainer(load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "tracker=none",
                                   "model.num_frames=8"]))
