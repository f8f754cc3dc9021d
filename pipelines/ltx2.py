"""Adapter for LTX-2 joint text-to-audio-video (``LTX2Pipeline``).

Latents x: the joint latent of ``pipelines/joint.py``, [B, D] with D = N_v·C_v + N_a·C_a: the
video tokens the transformer reads (``LTX2Pipeline._pack_latents`` of [B, C, F, h, w] latents:
N_v = F·h·w tokens of C_v = C channels, patch sizes 1 as LTX-2's) followed by the audio tokens
(``_pack_audio_latents`` of [B, C_a, L, M]: N_a = L latent time steps of C_a·M features), both
normalised as the pipeline keeps them while denoising. F = (num_frames − 1) / 8 + 1 and
h = H / 32 for LTX-2's VAE; L = round(num_frames / frame_rate · sample_rate / hop / 4).
``joint_layout`` and ``branch_masks()`` say which element is which. The transformer predicts
the velocity of both modalities at timestep t = 1000·σ (one σ for both, as the pipeline).

Schedule: what ``LTX2Pipeline`` sets: σ's linspace(1, 1/S, S) shifted with
mu = calculate_shift(N_v) (LTX-2's scheduler shifts dynamically, exponentially, with a terminal σ).

Guidance, as ``LTX2Pipeline`` does it, in x̂0 = x − σ·v space per modality: with CFG
x̂0 = x̂0_c + (g − 1)(x̂0_c − x̂0_u) against ``negative_prompt`` ("" by default), batched as
[negative, prompt]; the video scale is ``predict``'s ``guidance_scale``, the audio scale
``audio_guidance_scale`` (None: the same, as the pipeline's ``audio_guidance_scale or
guidance_scale``); CFG runs when either is > 1. ``modality_scale`` > 1 (and ``audio_modality_scale``)
adds the pipeline's modality-isolation term (s − 1)(x̂0_c − x̂0_iso), one more forward pass with the
audio↔video cross-attention switched off; ``guidance_rescale`` (and ``audio_guidance_rescale``)
is the pipeline's rescale of the guided x̂0. The defaults are plain CFG with one scale: no
modality guidance, no rescale (the pipeline's own call defaults are guidance 3 / audio 7, modality
3, rescale 0.7 and spatio-temporal guidance, which is not supported here: it needs a transformer
built with ``perturbed_attn``). An η = 0 rollout reproduces ``LTX2Pipeline`` called with the same
guidance arguments and ``stg_scale=0, audio_stg_scale=0`` (pass every ``audio_*`` one: the
pipeline's defaults for them are not None).

``decode`` returns ``AudioVideoSamples``: frames float [B, num_frames, 3, H, W] in [0, 1] (the
pipeline's ``output_type="pt"`` frames) and the vocoder's waveforms float [B, channels, T] at
``vocoder.config.output_sampling_rate``.

LoRA (peft) goes on the transformer's attention projections: video and audio self- and text
cross-attention and the per-block ``audio_to_video_attn`` / ``video_to_audio_attn``; it is saved
in the format ``LTX2Pipeline.load_lora_weights`` reads. ``cross_modal_attention()`` names the
cross-modal modules (for routing objectives that read their responses).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DenoiserAdapter
from pipelines.joint import BRANCHES, AudioVideoSamples, JointLayout


class LTX2Adapter(DenoiserAdapter):
    """An ``LTX2Pipeline`` as the RL core sees it (loading, LoRA, reference and saving: ``DenoiserAdapter``).

    ``num_frames``, ``height``, ``width``, ``frame_rate``: the clip (default: the pipeline's 121
    frames of 512×768 at 24 fps; the audio lasts num_frames / frame_rate seconds);
    ``max_sequence_length``: Gemma tokens (the pipeline's 1024); the guidance options: see the
    module docstring.
    """

    prediction = "velocity"
    family = "ltx2"
    rollout_uncond_supported = False  # its guidance combines three passes of its own (_guided)
    modality = "audio_video"  # decode gives AudioVideoSamples; x is a joint latent [B, D]
    branches = BRANCHES
    pipeline_class = LTX2Pipeline
    model_folder = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # every attention, the cross-modal ones included
    conditioning_frames = 0  # leading latent frames the conditioning fixes (image-to-audio-video: 1), not in x

    def __init__(self, pipe: LTX2Pipeline, *, device: str | torch.device = "cpu", num_frames: int = 121,
                 frame_rate: float = 24.0, max_sequence_length: int = 1024, negative_prompt: str = "",
                 audio_guidance_scale: float | None = None, modality_scale: float = 1.0,
                 audio_modality_scale: float | None = None, guidance_rescale: float = 0.0,
                 audio_guidance_rescale: float | None = None, height: int | None = None, width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"LTX2Adapter steps with LTX-2's FlowMatchEulerDiscreteScheduler schedule; this pipeline "
                             f"has a {type(pipe.scheduler).__name__}")
        if self.height % 32 or self.width % 32:
            raise ValueError(f"LTX-2 needs height and width divisible by 32, got {self.height}×{self.width}")
        temporal = pipe.vae_temporal_compression_ratio
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames − 1 must be a multiple of {temporal} (the VAE's temporal compression), "
                             f"got {num_frames}")
        config = self.model.config
        if (config.patch_size, config.patch_size_t, config.audio_patch_size, config.audio_patch_size_t) != (1, 1, 1, 1):
            raise ValueError("LTX2Adapter supports transformers with patch sizes 1 (as LTX-2's; the pipeline packs "
                             "latents one position per token)")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.num_frames = num_frames
        self.frame_rate = frame_rate
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.audio_guidance_scale = audio_guidance_scale
        self.modality_scale = modality_scale
        self.audio_modality_scale = audio_modality_scale or modality_scale  # the pipeline's `or`
        self.guidance_rescale = guidance_rescale
        self.audio_guidance_rescale = audio_guidance_rescale or guidance_rescale

        s = pipe.vae_spatial_compression_ratio
        self.latent_frames = (num_frames - 1) // temporal + 1
        self.latent_height, self.latent_width = self.height // s, self.width // s
        audio_vae = pipe.audio_vae
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        self.audio_frames = round(num_frames / frame_rate * per_second)  # the pipeline's audio_num_frames
        self.audio_mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        if self.latent_frames <= self.conditioning_frames:
            raise ValueError(f"num_frames {num_frames} makes {self.latent_frames} latent frame(s): nothing to generate "
                             f"after the {self.conditioning_frames} conditioning one; use at least "
                             f"{temporal * self.conditioning_frames + 1} frames")
        self.condition_tokens = self.conditioning_frames * self.latent_height * self.latent_width
        self.joint_layout = JointLayout(
            video_tokens=self.latent_frames * self.latent_height * self.latent_width - self.condition_tokens,
            video_channels=config.in_channels,
            audio_tokens=self.audio_frames, audio_channels=audio_vae.config.latent_channels * self.audio_mel_bins)
        if self.joint_layout.audio_channels != config.audio_in_channels:
            raise ValueError(f"the audio VAE's latent ({audio_vae.config.latent_channels} channels × "
                             f"{self.audio_mel_bins} bins) does not match the transformer's audio_in_channels "
                             f"{config.audio_in_channels}")

    def default_size(self) -> tuple[int, int]:
        return 512, 768  # LTX2Pipeline.__call__'s defaults

    def latent_shape(self) -> tuple[int, ...]:
        """(D,): one sample's joint latent (``joint_layout.numel``)."""
        return (self.joint_layout.numel,)

    def branch_masks(self) -> torch.Tensor:
        """bool [2, D] on the adapter's device: row 0 the video elements, row 1 the audio elements."""
        return self.joint_layout.masks(self.device)

    def cross_modal_attention(self) -> dict[str, tuple[str, nn.Module]]:
        """name → (the branch it writes into, module) for every ``audio_to_video_attn`` (video queries
        attend to audio: writes video) and ``video_to_audio_attn`` (writes audio) of the transformer."""
        writes = {"audio_to_video_attn": "video", "video_to_audio_attn": "audio"}
        return {name: (writes[name.rsplit(".", 1)[-1]], module) for name, module in self.model.named_modules()
                if name.rsplit(".", 1)[-1] in writes}

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → Gemma3's stacked hidden states through the connectors (``encode_embeds``)."""
        embeds, mask, _, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                     max_sequence_length=self.max_sequence_length, device=self.device)
        return self.encode_embeds(embeds, mask)

    @torch.no_grad()
    def encode_embeds(self, embeds: torch.Tensor, mask: torch.Tensor) -> Conditioning:
        """Precomputed text-encoder output (what ``LTX2Pipeline.encode_prompt`` returns: embeds
        [B, L, hidden·(layers + 1)], attention mask [B, L]) → {"video_embeds": [B, L', Dv],
        "audio_embeds": [B, L', Da], "mask": [B, L']}, the connectors' outputs the transformer reads.
        Lets a run keep Gemma off the device (prompt embeddings computed once, elsewhere)."""
        padding_side = getattr(self.pipe.tokenizer, "padding_side", "left") if self.pipe.tokenizer is not None else "left"
        video, audio, connector_mask = self.pipe.connectors(embeds.to(self.device), mask.to(self.device),
                                                            padding_side=padding_side)
        return Conditioning({"video_embeds": video, "audio_embeds": audio, "mask": connector_mask})


    # -- sampling ------------------------------------------------------------------------
    def initial_noise(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Joint latent [B, D] of the pipeline's draws from ``generator``: video noise [B, C, F, h, w]
        first, then audio noise [B, C_a, L, M], each packed to tokens."""
        pipe, device = self.pipe, generator.device
        video = torch.randn((batch, self.model.config.in_channels, self.latent_frames, self.latent_height,
                             self.latent_width), generator=generator, device=device, dtype=torch.float32)
        audio = torch.randn((batch, pipe.audio_vae.config.latent_channels, self.audio_frames, self.audio_mel_bins),
                            generator=generator, device=device, dtype=torch.float32)
        video = video[:, :, self.conditioning_frames:]  # the conditioning frame's draw is the pipeline's, unused
        return self.joint_layout.pack(pipe._pack_latents(video), pipe._pack_audio_latents(audio)).to(self.device)

    def schedule(self, num_steps: int) -> Schedule:
        """What ``LTX2Pipeline`` sets: σ's linspace(1, 1/S, S) shifted with mu = calculate_shift(every video
        token, the conditioning frame's included)."""
        config = self.scheduler.config
        video_tokens = self.latent_frames * self.latent_height * self.latent_width
        mu = calculate_shift(video_tokens, config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        return self.flow_schedule(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, D] of both modalities for the joint latent x [B, D] at timestep t = 1000·σ
        (scalar or [B]); guidance as the module docstring says."""
        model = self.denoiser if model is None else model
        audio_scale = self.audio_guidance_scale or guidance_scale
        cfg = guidance_scale > 1.0 or audio_scale > 1.0
        x_in, tensors = self.guidance_inputs(x, cond, 2.0 if cfg else 1.0)  # [negative, prompt] under CFG
        t_in = self.batch_timesteps(t, x_in.shape[0])
        video, audio = self._forward(model, x_in, t_in, tensors, isolate=False)
        if not cfg and self.modality_scale <= 1.0 and self.audio_modality_scale <= 1.0:
            return self.joint_layout.pack(video[:, self.condition_tokens:], audio)
        isolated = None
        if self.modality_scale > 1.0 or self.audio_modality_scale > 1.0:
            positive = {k: v.chunk(2)[1] for k, v in tensors.items()} if cfg else tensors
            isolated = self._forward(model, x, t_in[-len(x):], positive, isolate=True)
        sigma = t_in[-len(x):].float().view(-1, 1, 1) / self.scheduler.config.num_train_timesteps
        x_video, x_audio = self.joint_layout.unpack(x.float())
        x_video = self.video_tokens(x_video, cond.tensors)
        video = self._guided(x_video, video, sigma, cfg, guidance_scale, self.modality_scale, self.guidance_rescale,
                             None if isolated is None else isolated[0])
        audio = self._guided(x_audio, audio, sigma, cfg, audio_scale, self.audio_modality_scale,
                             self.audio_guidance_rescale, None if isolated is None else isolated[1])
        return self.joint_layout.pack(video[:, self.condition_tokens:], audio)

    def video_tokens(self, video: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The generated video tokens [N, N_v, C] of x → every video token the transformer reads
        [N, N_v + condition_tokens, C] (here the same; image-to-audio-video prepends the input's)."""
        return video

    def video_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """t [N] → the video timestep the transformer takes: [N] (one per sample); image-to-audio-video:
        [N, tokens] with 0 on the conditioning tokens, as its pipeline gives it."""
        return t

    def _forward(self, model, x, t, tensors, isolate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer pass: joint latent [N, D] → float velocities (video [N, condition_tokens + N_v,
        C_v]: every video token, the conditioning ones first; audio [N, N_a, C_a])."""
        dtype = self.model.dtype
        video, audio = self.joint_layout.unpack(x)
        video = self.video_tokens(video, tensors)
        v_video, v_audio = model(
            hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=tensors["video_embeds"].to(dtype),
            audio_encoder_hidden_states=tensors["audio_embeds"].to(dtype), timestep=self.video_timesteps(t),
            audio_timestep=t, sigma=t,
            encoder_attention_mask=tensors["mask"], audio_encoder_attention_mask=tensors["mask"],
            num_frames=self.latent_frames, height=self.latent_height, width=self.latent_width, fps=self.frame_rate,
            audio_num_frames=self.audio_frames, isolate_modalities=isolate,
            use_cross_timestep=True, return_dict=False)  # the pipeline's; both modalities share t here anyway
        return v_video.float(), v_audio.float()

    def _guided(self, x, v, sigma, cfg: bool, scale: float, modality_scale: float, rescale: float, v_isolated):
        """One modality's guided velocity, as ``LTX2Pipeline`` combines it: x [B, N, C]; v [2B or B, N, C]
        ([negative, prompt] under CFG); sigma [B, 1, 1]; v_isolated [B, N, C] or None. Under
        ``train.detach_uncond`` both reference branches (the negative prompt's and the isolated
        modality's) carry no gradient, so only the conditional prediction is trained through."""
        v_uncond, v_cond = v.chunk(2) if cfg else (None, v)
        x0_cond = x - v_cond * sigma
        x0 = x0_cond
        if cfg:
            x0 = x0 + (scale - 1) * (x0_cond - (x - self.uncond_branch(v_uncond) * sigma))
        if v_isolated is not None and modality_scale > 1.0:
            x0 = x0 + (modality_scale - 1) * (x0_cond - (x - self.uncond_branch(v_isolated) * sigma))
        if rescale > 0:
            x0 = rescale_noise_cfg(x0, x0_cond, guidance_rescale=rescale)
        return (x - x0) / sigma

    # -- decoding ------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x0: torch.Tensor, cond: Conditioning | None = None) -> AudioVideoSamples:
        """Joint latents [B, D] → ``AudioVideoSamples``: frames [B, num_frames, 3, H, W] in [0, 1] and
        waveforms [B, channels, T] at the vocoder's sample rate (the pipeline's "pt" outputs). ``cond``:
        the samples' conditioning, read by image-to-audio-video for its input frame."""
        pipe, vae, audio_vae = self.pipe, self.pipe.vae, self.pipe.audio_vae
        video, audio = self.joint_layout.unpack(x0.float())
        video = self.video_tokens(video, {} if cond is None else cond.tensors)
        video = pipe._unpack_latents(video, self.latent_frames, self.latent_height, self.latent_width)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        # a timestep-conditioned decoder gets the pipeline's default decode_timestep 0 (and no decode noise)
        timestep = torch.zeros(len(x0), device=self.device, dtype=vae.dtype) if vae.config.timestep_conditioning else None
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        frames = (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, self.audio_frames, num_mel_bins=self.audio_mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        waveform = pipe.vocoder(mel.to(pipe.vocoder.dtype)).float()
        return AudioVideoSamples(frames, waveform, int(pipe.vocoder.config.output_sampling_rate), self.frame_rate)
