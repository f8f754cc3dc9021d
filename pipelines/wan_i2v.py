"""Adapter for Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (a CLIP image
encoder, a 36-channel transformer) and Wan 2.2 I2V-A14B (two experts, no image encoder).
Everything is ``WanAdapter``'s (latents, Euler schedule at the flow shift, CFG, the two experts,
LoRA, decoding); the conditioning adds the input image as the pipeline makes it.

Conditioning: Wan's {"embeds"} plus, when ``encode`` is given images,

* "image_condition" [B, 4 + C, F, h, w]: the first-frame mask (1 on the latent frame of the
  input, 0 after, at the VAE's 4× temporal packing) and the VAE latents (mode, normalised) of the
  input image followed by black frames; ``predict`` concatenates it to x along channels;
* "image_embeds" [B, N, D] (Wan 2.1: the CLIP vision tower's second-to-last hidden states),
  passed as ``encoder_hidden_states_image``.

The input is resized to the video's height × width. The negative branch of CFG sees the same
image. At η = 0 a rollout equals ``WanImageToVideoPipeline`` (with the Euler scheduler at the flow
shift) given the same image. Not supported: Wan 2.2 TI2V-5B's image-to-video mode
(``expand_timesteps``: the first latent frame replaced by the image, timestep 0 on its tokens) and
last-frame conditioning.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline

from pipelines.base import Conditioning, load_condition_image
from pipelines.wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    """A ``WanImageToVideoPipeline`` as the RL core sees it; options as ``WanAdapter``'s."""

    family = "wan_i2v"
    pipeline_class = WanImageToVideoPipeline
    conditioning_image = True  # prompt records carry "image" (flowalign.prompts), encode(prompts, images=)

    def latent_shape(self) -> tuple[int, ...]:
        c, f, h, w = super().latent_shape()
        return (self.pipe.vae.config.z_dim, f, h, w)  # the transformer also takes the condition's channels

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """prompts: B strings, images: B paths or PIL images → Wan's conditioning plus "image_condition"
        [B, 4 + C, F, h, w] and, with an image encoder (Wan 2.1), "image_embeds" [B, N, D]."""
        cond = super().encode(prompts)
        if images is None:  # the text alone: CFG's negative branch (it shares the prompt's image)
            return cond
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} conditioning images")
        pictures = [load_condition_image(i, self.height, self.width) for i in images]
        cond.tensors["image_condition"] = torch.cat([self._image_condition(p) for p in pictures])
        if self.pipe.image_encoder is not None:
            cond.tensors["image_embeds"] = torch.cat([self.pipe.encode_image(p, self.device) for p in pictures])
        return cond

    def _image_condition(self, picture) -> torch.Tensor:
        """One input image → [1, 4 + C, F, h, w]: the first-frame mask and the normalised latents of
        the image followed by black frames (``WanImageToVideoPipeline.prepare_latents``)."""
        if self.pipe.config.expand_timesteps:
            raise ValueError("WanImageToVideoAdapter does not support Wan 2.2 TI2V-5B's image-to-video mode "
                             "(expand_timesteps); its text-to-video mode is the wan family")
        vae = self.pipe.vae
        image = self.pipe.video_processor.preprocess(picture, height=self.height, width=self.width)
        image = image.to(self.device, torch.float32).unsqueeze(2)
        video = torch.cat([image, image.new_zeros(1, 3, self.num_frames - 1, self.height, self.width)], dim=2)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()
        config = vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        latents = (latents - torch.tensor(config.latents_mean).view(shape).to(latents)) * (
            1.0 / torch.tensor(config.latents_std).view(shape).to(latents))
        _, frames, h, w = super().latent_shape()
        temporal = self.pipe.vae_scale_factor_temporal
        mask = torch.zeros(1, 1, self.num_frames, h, w, device=self.device)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, frames, temporal, h, w).transpose(1, 2)
        return torch.cat([mask, latents], dim=1)

    def model_inputs(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "image_condition" not in tensors:
            raise ValueError("image-to-video needs a conditioning image per prompt (prompt records with \"image\")")
        inputs = {"hidden_states": torch.cat([x, tensors["image_condition"]], dim=1),
                  "encoder_hidden_states": tensors["embeds"]}
        if "image_embeds" in tensors:
            inputs["encoder_hidden_states_image"] = tensors["image_embeds"]
        return inputs
