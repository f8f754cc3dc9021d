"""Joint audio-video latents and decoded samples: the convention every audio-video family shares
(the LTX-2 adapter, the built-in audio-video model), so samplers, objectives and rewards see one.

Latents. The samplers step one tensor per sample. An audio-video denoiser reads two token
sequences, video tokens [B, N_v, C_v] and audio tokens [B, N_a, C_a] (each in the layout its
denoiser reads: LTX-2's packed patches, ...). The joint latent flattens each token-major and
concatenates them, video first (``JointLayout.pack``; ``unpack`` is its exact inverse):

    x = [video.flatten(1) | audio.flatten(1)]    [B, D],  D = N_v·C_v + N_a·C_a

so element j < N_v·C_v is channel j mod C_v of video token j // C_v, and element N_v·C_v + k
is channel k mod C_a of audio token k // C_a. Nothing is padded: every element is a latent the
denoiser reads, so a flow SDE's Gaussian log-prob over x (a mean or a sum over the D elements,
as the sampler's ``reduction`` says) is over both modalities, each element counted once. The
elementwise Euler / SDE steps on x are exactly the steps on the two modalities separately.

Which element is which: ``JointLayout.masks()`` bool [2, D] (row 0 video, row 1 audio; they
partition the elements: what ``flowalign/experimental/av_routing.py`` calls the branch masks),
``token_ids()`` long [D] (video tokens 0..N_v−1, audio tokens N_v..N_v+N_a−1), and
``expand_tokens`` turns per-token values (weights [B, N_v], [B, N_a]) into per-element ones [B, D].

Decoded samples: ``AudioVideoSamples`` (what an audio-video adapter's ``decode`` returns and its
rewards receive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

BRANCHES = ("video", "audio")  # the order of the joint latent's parts and of the mask rows


@dataclass(frozen=True)
class JointLayout:
    """The sizes of one sample's two token sequences, video [N_v, C_v] and audio [N_a, C_a], and
    the conversions between them and the joint latent [B, D] (module docstring)."""

    video_tokens: int
    video_channels: int
    audio_tokens: int
    audio_channels: int
    BRANCHES: ClassVar[tuple[str, str]] = BRANCHES

    @property
    def video_size(self) -> int:
        """N_v·C_v: the number of video elements, which come first."""
        return self.video_tokens * self.video_channels

    @property
    def audio_size(self) -> int:
        return self.audio_tokens * self.audio_channels

    @property
    def numel(self) -> int:
        """D = N_v·C_v + N_a·C_a: one sample's joint latent has shape [D]."""
        return self.video_size + self.audio_size

    def pack(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """video tokens [B, N_v, C_v], audio tokens [B, N_a, C_a] → joint latent [B, D] (audio cast to video's dtype)."""
        self._check(video, (self.video_tokens, self.video_channels), "video tokens")
        self._check(audio, (self.audio_tokens, self.audio_channels), "audio tokens")
        if len(video) != len(audio):
            raise ValueError(f"video and audio tokens must have the same batch, got {len(video)} and {len(audio)}")
        return torch.cat([video.flatten(1), audio.to(video.dtype).flatten(1)], dim=1)

    def unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint latent [B, D] → (video tokens [B, N_v, C_v], audio tokens [B, N_a, C_a]): views of x,
        the exact inverse of ``pack``."""
        self._check(x, (self.numel,), "a joint latent")
        video, audio = x.split([self.video_size, self.audio_size], dim=1)
        return (video.unflatten(1, (self.video_tokens, self.video_channels)),
                audio.unflatten(1, (self.audio_tokens, self.audio_channels)))

    def masks(self, device=None) -> torch.Tensor:
        """bool [2, D]: row 0 marks the video elements, row 1 the audio elements (``BRANCHES``)."""
        masks = torch.zeros(2, self.numel, dtype=torch.bool, device=device)
        masks[0, :self.video_size] = True
        masks[1, self.video_size:] = True
        return masks

    def token_ids(self, device=None) -> torch.Tensor:
        """long [D]: the token each element belongs to; video tokens 0..N_v−1, audio tokens N_v..N_v+N_a−1."""
        video = torch.arange(self.video_tokens, device=device).repeat_interleave(self.video_channels)
        audio = torch.arange(self.audio_tokens, device=device).repeat_interleave(self.audio_channels)
        return torch.cat([video, audio + self.video_tokens])

    def expand_tokens(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Per-token values video [B, N_v], audio [B, N_a] → per-element values [B, D] (each token's
        value on each of its channels), e.g. token weights for an elementwise loss."""
        self._check(video, (self.video_tokens,), "video token values")
        self._check(audio, (self.audio_tokens,), "audio token values")
        return torch.cat([video.repeat_interleave(self.video_channels, dim=1),
                          audio.repeat_interleave(self.audio_channels, dim=1)], dim=1)

    def _check(self, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(tensor.shape[1:]) != shape or tensor.ndim != len(shape) + 1:
            raise ValueError(f"{what} must have shape [B, {', '.join(map(str, shape))}] in {self}, "
                             f"got {tuple(tensor.shape)}")


@dataclass
class AudioVideoSamples:
    """Decoded audio-video samples, what audio-video rewards receive.

    * video: float [B, F, 3, H, W] in [0, 1], F frames in time order (the video families' layout);
    * audio: float [B, A, T] waveforms in [-1, 1], A channels (1 mono, 2 stereo), T samples;
    * sample_rate: audio samples per second; fps: video frames per second (so frame f starts at
      f / fps seconds and sample n at n / sample_rate: what sync rewards align).
    """

    video: torch.Tensor
    audio: torch.Tensor
    sample_rate: int
    fps: float

    def __post_init__(self):
        if self.video.ndim != 5 or self.audio.ndim != 3 or len(self.video) != len(self.audio):
            raise ValueError(f"AudioVideoSamples takes video [B, F, 3, H, W] and audio [B, A, T], got "
                             f"{tuple(self.video.shape)} and {tuple(self.audio.shape)}")

    def __len__(self) -> int:
        return len(self.video)

    @property
    def mono(self) -> torch.Tensor:
        """The waveforms averaged over their channels: float [B, T]."""
        return self.audio.mean(dim=1)

    def __getitem__(self, index) -> "AudioVideoSamples":
        """Select samples (an int tensor, slice or bool mask over the batch; an int keeps a batch of 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return AudioVideoSamples(self.video[index], self.audio[index], self.sample_rate, self.fps)

    def to(self, device) -> "AudioVideoSamples":
        return AudioVideoSamples(self.video.to(device), self.audio.to(device), self.sample_rate, self.fps)

    @staticmethod
    def cat(parts: list["AudioVideoSamples"]) -> "AudioVideoSamples":
        first = parts[0]
        if any((p.sample_rate, p.fps) != (first.sample_rate, first.fps) for p in parts):
            raise ValueError("cannot concatenate audio-video samples with different sample or frame rates")
        return AudioVideoSamples(torch.cat([p.video for p in parts]), torch.cat([p.audio for p in parts]),
                                 first.sample_rate, first.fps)
