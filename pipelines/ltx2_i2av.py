"""Adapter for LTX-2 image-to-audio-video (``LTX2ImageToVideoPipeline``: a clip with sound whose
first frame is the input image). Everything is ``LTX2Adapter``'s (joint latent, schedule, the
guidance in x̂0 space, decoding, LoRA); what differs is the first latent frame.

The pipeline puts the input image's VAE latent (its mode, normalised) in the first latent frame,
gives those tokens timestep 0, keeps them fixed through every step and decodes them with the
rest. That frame is not sampled, so it is not in x here: x is the joint latent of the *generated*
video frames (latent frames 1…F−1) and the audio, and the samplers, log-probs and objectives see
only what the policy generates. The conditioning adds "image_latents" [B, h·w, C] (the input's
packed latent frame); ``predict`` puts them before x's video tokens with timestep 0 (per-token
video timesteps [B, F·h·w], as the pipeline passes them; the audio timestep is t), combines the
guidance over every video token as the pipeline does (its rescale's statistics include the input
frame) and returns the velocity of x's tokens. ``decode(x0, cond)`` decodes the input frame with
the generated ones (``decodes_with_condition``; ``pipelines.base.decode_samples``).

Input image: resized to the clip's height × width (``load_condition_image``, then the pipeline's
video processor), and, as the pipeline does before encoding it, re-compressed as one H.264 frame at
``image_crf`` (None: the checkpoint's default, 33 for LTX-2.0 to 2.3, 18 for LTX-2.5; needs PyAV,
``pip install av``; 0: no re-compression). At η = 0 a rollout equals ``LTX2ImageToVideoPipeline``
given the same image and ``image_crf`` (and the guidance arguments of ``LTX2Adapter``'s docstring).
Initial noise: the pipeline's draws (the full video noise, then the audio noise), the input
frame's share dropped.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
from PIL import Image

from pipelines.base import Conditioning, load_condition_image
from pipelines.ltx2 import LTX2Adapter


class LTX2ImageToAudioVideoAdapter(LTX2Adapter):
    """An ``LTX2ImageToVideoPipeline`` as the RL core sees it; options as ``LTX2Adapter``'s, plus
    ``image_crf`` (module docstring)."""

    family = "ltx2_i2av"
    pipeline_class = LTX2ImageToVideoPipeline
    conditioning_image = True  # prompt records carry "image" (flowalign.prompts), encode(prompts, images=)
    decodes_with_condition = True  # x leaves out the input's latent frame; decode(x0, cond) puts it back
    conditioning_frames = 1

    def __init__(self, pipe: LTX2ImageToVideoPipeline, *, device: str | torch.device = "cpu", num_frames: int = 121,
                 frame_rate: float = 24.0, max_sequence_length: int = 1024, negative_prompt: str = "",
                 audio_guidance_scale: float | None = None, modality_scale: float = 1.0,
                 audio_modality_scale: float | None = None, guidance_rescale: float = 0.0,
                 audio_guidance_rescale: float | None = None, image_crf: int | None = None, height: int | None = None,
                 width: int | None = None):
        super().__init__(pipe, device=device, num_frames=num_frames, frame_rate=frame_rate,
                         max_sequence_length=max_sequence_length, negative_prompt=negative_prompt,
                         audio_guidance_scale=audio_guidance_scale, modality_scale=modality_scale,
                         audio_modality_scale=audio_modality_scale, guidance_rescale=guidance_rescale,
                         audio_guidance_rescale=audio_guidance_rescale, height=height, width=width)
        if image_crf is not None and image_crf < 0:
            raise ValueError(f"image_crf must be ≥ 0 (0: no re-compression), got {image_crf}")
        self.image_crf = resolve_default_image_crf(pipe.text_encoder) if image_crf is None else image_crf

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """prompts: B strings, images: B paths or PIL images → ``LTX2Adapter``'s conditioning plus
        "image_latents" [B, h·w, C]. Without images: the text alone (CFG's negative branch, which
        shares each sample's input frame)."""
        cond = super().encode(prompts)
        if images is None:
            return cond
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} conditioning images")
        cond.tensors["image_latents"] = torch.cat([self._image_latents(i) for i in images])
        return cond

    def _image_latents(self, image) -> torch.Tensor:
        """One input image → its packed, normalised latent frame [1, h·w, C] (``prepare_latents``)."""
        pipe, vae = self.pipe, self.pipe.vae
        picture = load_condition_image(image, self.height, self.width)
        if self.image_crf:
            picture = Image.fromarray(apply_image_conditioning_crf(np.array(picture), self.image_crf))
        pixels = pipe.video_processor.preprocess(picture, height=self.height, width=self.width)
        latents = vae.encode(pixels.to(self.device, vae.dtype).unsqueeze(2)).latent_dist.mode().float()
        latents = pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)  # scaling factor 1, as there
        return pipe._pack_latents(latents)

    def video_tokens(self, video: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "image_latents" not in tensors:
            raise ValueError("image-to-audio-video needs a conditioning image per prompt (prompt records with "
                             "\"image\"); its samples decode with their conditioning")
        return torch.cat([tensors["image_latents"].to(video), video], dim=1)

    def video_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        tokens = self.latent_frames * self.latent_height * self.latent_width
        timesteps = t[:, None].expand(len(t), tokens).clone()
        timesteps[:, :self.condition_tokens] = 0  # t · (1 − conditioning mask), the pipeline's
        return timesteps
