"""Video rewards on constructed videos [B, F, 3, H, W] with closed-form scores: temporal
consistency, and an image reward averaged over frames."""

import pytest
import torch

from reward_models.base import Reward, available_rewards, build_reward, register_reward
from reward_models.jpeg import jpeg_kilobytes
from reward_models.video import PerFrame, TemporalConsistency, frame_indices


def video(frame_values, size=8) -> torch.Tensor:
    """One video [F, 3, size, size] whose frame f is the constant frame_values[f]."""
    return torch.tensor(frame_values, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, size, size).clone()


def consistency(videos, **kwargs) -> list[float]:
    scores = TemporalConsistency(**kwargs)(videos, ["p"] * len(videos), [{}] * len(videos))
    return scores["temporal_consistency"].tolist()


def test_temporal_consistency_is_one_minus_the_mean_consecutive_frame_difference():
    steps = video([0.0, 0.5, 0.5, 1.0])  # |Δ| = 0.5, 0, 0.5 → mean 1/3
    half = video([0.0, 0.0, 0.0, 0.0])
    half[1:, :, :, :4] = 1.0  # from frame 1 on the left half is white: |Δ| = 0.5, 0, 0 → mean 1/6
    still = video([0.3] * 4)
    scores = consistency(torch.stack([steps, half, still]))
    assert scores == pytest.approx([1 - 1 / 3, 1 - 1 / 6, 1.0], abs=1e-6)
    assert consistency(torch.stack([still]))[0] == 1.0  # the hacking risk: a still video is the maximum


def test_pooling_ignores_flicker_finer_than_the_pool_but_not_coarser_changes():
    checker = ((torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2).float().expand(3, 8, 8)
    flicker = torch.stack([checker, 1 - checker, checker])  # every pixel flips every frame
    assert consistency(flicker[None]) == pytest.approx([0.0])
    assert consistency(flicker[None], pool=2) == pytest.approx([1.0])  # each 2×2 block averages 0.5 throughout
    assert consistency(video([0.0, 1.0])[None], pool=4) == pytest.approx([0.0])


def test_temporal_consistency_refuses_what_is_not_a_video():
    reward = TemporalConsistency()
    with pytest.raises(ValueError, match=r"videos float \[B, F, 3, H, W\].*got \(2, 3, 8, 8\)"):
        reward(torch.zeros(2, 3, 8, 8), ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="at least 2 frames"):
        reward(torch.zeros(1, 1, 3, 8, 8), ["a"], [{}])
    with pytest.raises(ValueError, match="pool"):
        TemporalConsistency(pool=0)


@register_reward("test_signed_brightness")
class SignedBrightness(Reward):
    """Image brightness, negated for the prompt "dark": wrong prompt/frame pairing changes the score."""

    components = ("brightness",)
    modality = "image"

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, samples, prompts, metadata):
        assert samples.ndim == 4
        sign = torch.tensor([-1.0 if p == "dark" else 1.0 for p in prompts])
        return {"brightness": self.scale * sign * samples.mean(dim=(1, 2, 3))}


def test_per_frame_scores_each_video_by_the_mean_over_its_own_frames():
    videos = torch.stack([video([0.0, 0.3, 0.9]), video([1.0, 0.5, 0.0])])
    reward = build_reward("per_frame", reward="test_signed_brightness", reward_kwargs={"scale": 2.0})
    assert reward.components == ("brightness",)
    scores = reward(videos, ["light", "dark"], [{}, {}])["brightness"]
    torch.testing.assert_close(scores, torch.tensor([2 * 0.4, -2 * 0.5]))  # (0 + .3 + .9) / 3, (1 + .5 + 0) / 3
    first_and_last = PerFrame("test_signed_brightness", frames=2)(videos, ["light", "dark"], [{}, {}])["brightness"]
    torch.testing.assert_close(first_and_last, torch.tensor([0.45, -0.5]))


def test_per_frame_jpeg_is_the_frame_average_of_the_image_reward():
    generator = torch.Generator().manual_seed(0)
    videos = torch.rand(2, 3, 3, 16, 16, generator=generator)
    videos[0, 0] = 0.5  # one flat frame: a very different size from the noisy ones
    scores = PerFrame("jpeg_compressibility")(videos, ["a", "b"], [{}, {}])["jpeg_compressibility"]
    expected = torch.stack([-jpeg_kilobytes(v).mean() for v in videos])
    torch.testing.assert_close(scores, expected)


@register_reward("test_nan_on_frame_1")
class NanOnFrame1(Reward):
    """Brightness, but NaN for frame 1 of the sample whose metadata id is 0."""

    components = ("value",)

    def __call__(self, samples, prompts, metadata):
        value = samples.mean(dim=(1, 2, 3)).clone()
        value[[m["frame"] == 1 and m["id"] == 0 for m in metadata]] = float("nan")
        return {"value": value}


def test_a_frame_that_cannot_be_scored_drops_its_video_only():
    videos = torch.stack([video([0.2, 0.4]), video([0.6, 0.8])])
    scores = PerFrame("test_nan_on_frame_1")(videos, ["a", "b"], [{"id": 0}, {"id": 1}])["value"]
    assert torch.isnan(scores[0]) and scores[1].item() == pytest.approx(0.7)


def test_registry_names_the_video_rewards_and_per_frame_wraps_only_image_rewards():
    assert {"temporal_consistency", "per_frame"} <= set(available_rewards())
    assert build_reward("temporal_consistency", pool=2).pool == 2
    with pytest.raises(ValueError, match="already scores videos"):
        build_reward("per_frame", reward="temporal_consistency")
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        build_reward("per_frame", reward="nope")
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        PerFrame("jpeg_compressibility")(torch.zeros(1, 3, 8, 8), ["a"], [{}])


def test_frame_indices_spread_over_the_video_and_keep_its_ends():
    assert frame_indices(9, None).tolist() == list(range(9))
    assert frame_indices(9, 3).tolist() == [0, 4, 8]
    assert frame_indices(81, 5).tolist() == [0, 20, 40, 60, 80]
    assert frame_indices(4, 10).tolist() == [0, 1, 2, 3]
