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

Wan 2.2 TI2V-5B (``expand_timesteps``) conditions differently: the pipeline puts the input's VAE
latent (mode, normalised) in the first latent frame, gives its tokens timestep 0 and keeps it fixed
through every step. That frame is not sampled, so it is not in x: x is the *generated* latent
frames [B, C, F − 1, h, w], what the samplers, log-probs and objectives see. The conditioning is
then {"embeds", "first_frame" [B, C, 1, h, w]}; ``predict`` puts the frame before x (per-token
timesteps, 0 on its tokens) and returns the velocity of x's frames, and ``decode(x0, cond)``
decodes the input frame with the generated ones (``decodes_with_condition``;
``pipelines.base.decode_samples``). TI2V-5B's checkpoint is a ``WanPipeline`` folder; this family
loads it as ``WanImageToVideoPipeline`` (its text-to-video mode is the wan family).

The input is resized to the video's height × width. The negative branch of CFG sees the same
image. At η = 0 a rollout equals ``WanImageToVideoPipeline`` (with the Euler scheduler at the flow
shift) given the same image. Not supported: last-frame conditioning.
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
    also_loads = ("WanPipeline",)  # TI2V-5B's checkpoint folder names WanPipeline

    @property
    def first_frame_mode(self) -> bool:
        """Wan 2.2 TI2V-5B's image-to-video: the input is the first latent frame (module docstring)."""
        return bool(self.pipe.config.expand_timesteps)

    @property
    def decodes_with_condition(self) -> bool:
        return self.first_frame_mode

    def latent_shape(self) -> tuple[int, ...]:
        c, f, h, w = super().latent_shape()
        if self.first_frame_mode:
            if f < 2:
                raise ValueError(f"TI2V image-to-video generates the latent frames after the input's: num_frames must "
                                 f"be at least {self.pipe.vae_scale_factor_temporal + 1}, got {self.num_frames}")
            return (c, f - 1, h, w)  # the frames after the input's
        return (self.pipe.vae.config.z_dim, f, h, w)  # the transformer also takes the condition's channels

    def initial_noise(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """The pipeline's draw [B, C, F, h, w]; in TI2V mode without the input frame's share [B, C, F − 1, h, w]."""
        if not self.first_frame_mode:
            return super().initial_noise(batch, generator)
        c, f, h, w = self.latent_shape()
        return torch.randn((batch, c, f + 1, h, w), generator=generator, device=generator.device,
                           dtype=torch.float32)[:, :, 1:].to(self.device)

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
        if self.first_frame_mode:
            cond.tensors["first_frame"] = torch.cat([self._first_frame(p) for p in pictures])
            return cond
        cond.tensors["image_condition"] = torch.cat([self._image_condition(p) for p in pictures])
        if self.pipe.image_encoder is not None:
            cond.tensors["image_embeds"] = torch.cat([self.pipe.encode_image(p, self.device) for p in pictures])
        return cond

    def _normalised_latents(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels [1, 3, T, H, W] in [-1, 1] → VAE mode latents [1, C, T', h, w], normalised as the pipeline
        writes it: (latents − mean) · (1 / std) per channel."""
        vae = self.pipe.vae
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()
        config = vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        return (latents - torch.tensor(config.latents_mean).view(shape).to(latents)) * (
            1.0 / torch.tensor(config.latents_std).view(shape).to(latents))

    def _pixels(self, picture) -> torch.Tensor:
        image = self.pipe.video_processor.preprocess(picture, height=self.height, width=self.width)
        return image.to(self.device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]

    def _first_frame(self, picture) -> torch.Tensor:
        """One input image → its normalised latent frame [1, C, 1, h, w] (TI2V's ``prepare_latents``)."""
        return self._normalised_latents(self._pixels(picture))

    def _image_condition(self, picture) -> torch.Tensor:
        """One input image → [1, 4 + C, F, h, w]: the first-frame mask and the normalised latents of
        the image followed by black frames (``WanImageToVideoPipeline.prepare_latents``)."""
        image = self._pixels(picture)
        video = torch.cat([image, image.new_zeros(1, 3, self.num_frames - 1, self.height, self.width)], dim=2)
        latents = self._normalised_latents(video)
        _, frames, h, w = WanAdapter.latent_shape(self)
        temporal = self.pipe.vae_scale_factor_temporal
        mask = torch.zeros(1, 1, self.num_frames, h, w, device=self.device)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, frames, temporal, h, w).transpose(1, 2)
        return torch.cat([mask, latents], dim=1)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model=None) -> torch.Tensor:
        """``WanAdapter.predict``; in TI2V mode the velocity of x's frames (the input frame's is dropped)."""
        v = super().predict(x, t, cond, guidance_scale, model)
        return v[:, :, 1:] if self.first_frame_mode else v

    def token_timesteps(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """TI2V mode: t [B] → [B, tokens] for the input frame and x's frames, 0 on the input frame's
        tokens (the pipeline's mask · t)."""
        if not self.first_frame_mode:
            return super().token_timesteps(t, x)
        _, p_h, p_w = self.model.config.patch_size
        per_frame = (x.shape[3] // p_h) * (x.shape[4] // p_w)
        return torch.cat([torch.zeros(len(t), per_frame, dtype=t.dtype, device=t.device),
                          t[:, None].expand(len(t), x.shape[2] * per_frame)], dim=1)

    def model_inputs(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.first_frame_mode:
            if "first_frame" not in tensors:
                raise ValueError("image-to-video needs a conditioning image per prompt (prompt records with \"image\")")
            return {"hidden_states": torch.cat([tensors["first_frame"].to(x), x], dim=2),
                    "encoder_hidden_states": tensors["embeds"]}
        if "image_condition" not in tensors:
            raise ValueError("image-to-video needs a conditioning image per prompt (prompt records with \"image\")")
        inputs = {"hidden_states": torch.cat([x, tensors["image_condition"]], dim=1),
                  "encoder_hidden_states": tensors["embeds"]}
        if "image_embeds" in tensors:
            inputs["encoder_hidden_states_image"] = tensors["image_embeds"]
        return inputs

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, cond: Conditioning | None = None) -> torch.Tensor:
        """Latents [B, C, F, h, w] → frames [B, num_frames, 3, H, W] in [0, 1]; in TI2V mode x0 is
        [B, C, F − 1, h, w] and ``cond``'s "first_frame" is decoded before it."""
        if self.first_frame_mode:
            if cond is None or "first_frame" not in cond.tensors:
                raise ValueError("TI2V image-to-video samples decode with their conditioning (the input frame)")
            x0 = torch.cat([cond.tensors["first_frame"].to(x0), x0], dim=2)
        return super().decode(x0)
