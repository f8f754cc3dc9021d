"""The built-in audio-video family: ``AVPipeline`` (text → clip with sound) and its RL adapter.

Parts (all real classes, saved and loaded by ``save_pretrained`` / ``from_pretrained``):
``model`` an ``AVDiffusionModel`` (``pipelines/av_model.py``), ``text_encoder`` a small
``CLIPTextModel`` with its ``tokenizer`` (one token per caption word, ``pipelines.tiny``),
``scheduler`` a ``FlowMatchEulerDiscreteScheduler``. The shipped demo model is
``pipelines/demo_models/av-demo`` (``scripts/pretrain_av.py``).

Latents x: float [B, D], the joint latent of ``pipelines/joint.py``: the video's pixel-patch
tokens [128, 48] (pixels scaled to [−1, 1]) then the waveform's tokens [32, 16], flattened
(D = 6,144 + 512 for the world's clips); ``adapter.joint_layout`` and ``adapter.branch_masks()``
say which element is which. The model predicts the velocity v ≈ ε − x0 at timestep t = 1000·σ;
the pipeline takes Euler steps with its scheduler, so an η = 0 rollout of ``flowalign.rollout``
reproduces ``pipe(...)`` from the same initial noise. ``decode`` returns
``pipelines.joint.AudioVideoSamples``: video float [B, F, 3, H, W] in [0, 1], audio float
[B, 1, T] (mono) in [−1, 1], its sample_rate (512) and fps (8).

CFG (guidance_scale g > 1) is uncond + g·(cond − uncond) against the empty prompt, batched as
[negative, prompt]; pre-training drops 10 % of captions so that branch is trained.

**Sampling order** (``AVPipeline(sampling_order=…)``, saved in ``model_index.json``): ``"joint"``
denoises both streams together at one σ (the scheduler's steps). ``"video_first"`` samples
p(video | text) with the audio held at pure noise, then p(audio | video, text) with the video
finished: the beep of a wall touch is decided at σ_a ≳ 0.95, where a jointly denoised video is
still noise too, so only an audio that waits for its video can follow it (docs/audio_video.md).
Both phases are one Euler flow in a schedule time τ from 2 to 0 (``video_first_levels``):
τ ∈ (1, 2] moves the video (σ_v = τ − 1, σ_a = 1), τ ∈ [0, 1] the audio (σ_v = 0, σ_a = τ); the
velocity of the stream that waits is 0. ``num_inference_steps`` counts model evaluations, half
per phase; the RL rollouts run the same flow through the adapter (ODE only: a flow SDE's noise
schedule is defined for σ ≤ 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils import BaseOutput
from torch import nn
from transformers import CLIPTextModel, CLIPTokenizer

from pipelines.av_model import AVDiffusionModel
from pipelines.base import Conditioning, Schedule, load_with_hub_fallback
from pipelines.denoiser import DenoiserAdapter, load_trained_weights, torch_dtype
from pipelines.joint import BRANCHES, AudioVideoSamples, JointLayout
from pipelines.tiny import _clip_config, build_clip_tokenizer

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out")  # every attention projection, both streams and cross-modal
SAMPLING_ORDERS = ("joint", "video_first")


def video_first_schedule(sigmas: torch.Tensor) -> torch.Tensor:
    """One phase's σ's [N + 1] (1 → 0) → the video-first schedule time τ [2N + 1] (2 → 0): the
    video's σ's shifted by 1, then the audio's (module docstring)."""
    return torch.cat([1 + sigmas, sigmas[1:]])


def video_first_levels(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Schedule time τ [B] → (σ_video [B], σ_audio [B], bool [B]: the video is the stream that moves)."""
    tau = tau.float()
    return (tau - 1).clamp(0, 1), tau.clamp(0, 1), tau > 1


@dataclass
class AVPipelineOutput(BaseOutput):
    """video float [B, F, 3, H, W] in [0, 1]; audio float [B, 1, T] in [−1, 1]; latents [B, D] the
    final joint latents; sample_rate and fps of the clip."""

    video: torch.Tensor
    audio: torch.Tensor
    latents: torch.Tensor
    sample_rate: int
    fps: float


class AVPipeline(DiffusionPipeline):
    """Generate short clips with sound from captions.

    >>> pipe = build_tiny_av_pipeline(["a", "ball"])
    >>> out = pipe(["a ball", "ball"], num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    >>> tuple(out.video.shape), tuple(out.audio.shape)
    ((2, 8, 3, 16, 16), (2, 1, 512))
    """

    model_cpu_offload_seq = "text_encoder->model"
    model: AVDiffusionModel

    def __init__(self, model: AVDiffusionModel, text_encoder: CLIPTextModel, tokenizer: CLIPTokenizer,
                 scheduler: FlowMatchEulerDiscreteScheduler, sampling_order: str = "joint"):
        super().__init__()
        self.register_modules(model=model, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)
        self.set_sampling_order(sampling_order)

    def set_sampling_order(self, order: str) -> None:
        """"joint" or "video_first" (module docstring); recorded in the config, so ``save_pretrained`` keeps it."""
        if order not in SAMPLING_ORDERS:
            raise ValueError(f"sampling_order must be one of {SAMPLING_ORDERS}, got {order!r}")
        self.register_to_config(sampling_order=order)

    @property
    def sampling_order(self) -> str:
        return self.config.sampling_order

    @property
    def joint_layout(self) -> JointLayout:
        return self.model.joint_layout

    @property
    def fps(self) -> float:
        return float(self.model.config.frames)  # a clip lasts one second (the world's convention)

    @property
    def sample_rate(self) -> int:
        return int(round(self.fps * self.model.config.samples_per_frame))

    def pack_clip(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Clean clips → joint latents x0 [B, D]: video float [B, F, 3, H, W] in [0, 1] (scaled to
        [−1, 1]), audio float [B, T] or [B, 1, T]."""
        return self.joint_layout.pack(self.model.patchify_video(video * 2 - 1), self.model.patchify_audio(audio.flatten(1)))

    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """B prompts → (hidden states [B, L, D_text], pooled [B, D_text]) of the CLIP text encoder."""
        ids = self.tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.text_encoder.device)
        out = self.text_encoder(ids)
        return out.last_hidden_state, out.pooler_output

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor,
                 model: nn.Module | None = None) -> torch.Tensor:
        """The model's velocity in the joint layout: latents [B, D], timestep [B] (or [B, 2] per
        stream: 1000·(σ_video, σ_audio)) → [B, D]."""
        video, audio = self.joint_layout.unpack(latents)
        v_video, v_audio = (model or self.model)(video, audio, timestep, text, pooled)
        return self.joint_layout.pack(v_video, v_audio)

    def video_first_velocity(self, latents: torch.Tensor, tau: torch.Tensor, text: torch.Tensor,
                             pooled: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """dx/dτ of the video-first flow at schedule time τ [B]: the moving stream's velocity, 0 on
        the waiting one. latents [B, D] → [B, D]."""
        sigma_video, sigma_audio, video_moves = video_first_levels(tau)
        v = self.velocity(latents, 1000 * torch.stack([sigma_video, sigma_audio], 1).to(latents.device), text,
                          pooled, model)
        return v * self.moving_elements(video_moves.to(latents.device))

    def moving_elements(self, video_moves: torch.Tensor) -> torch.Tensor:
        """bool [B] (the video is the stream that moves) → bool [B, D]: the moving stream's elements."""
        video_mask, audio_mask = self.joint_layout.masks(video_moves.device)
        return torch.where(video_moves[:, None], video_mask[None], audio_mask[None])

    def decode_latents(self, latents: torch.Tensor) -> AudioVideoSamples:
        """Joint latents [B, D] → ``AudioVideoSamples``: video (x + 1) / 2 clamped to [0, 1]
        [B, F, 3, H, W], audio clamped to [−1, 1] [B, 1, T]."""
        video, audio = self.joint_layout.unpack(latents.float())
        video = ((self.model.unpatchify_video(video) + 1) / 2).clamp(0, 1)
        return AudioVideoSamples(video, audio.flatten(1)[:, None].clamp(-1, 1), self.sample_rate, self.fps)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], *, num_inference_steps: int = 16, guidance_scale: float = 1.0,
                 negative_prompt: str = "", generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None, return_dict: bool = True):
        """prompt: one or B captions; latents: initial noise [B, D] (default: standard normal from
        ``generator``, drawn on its device)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        b, device = len(prompts), self.model.device
        text, pooled = self.encode_prompt(prompts)
        if guidance_scale > 1.0:
            neg_text, neg_pooled = self.encode_prompt([negative_prompt])
            text = torch.cat([neg_text.expand(b, -1, -1), text])
            pooled = torch.cat([neg_pooled.expand(b, -1), pooled])
        if latents is None:
            latents = torch.randn((b, self.joint_layout.numel), generator=generator,
                                  device=generator.device if generator is not None else "cpu", dtype=torch.float32)
        latents = latents.to(device, torch.float32)

        def guided(v: torch.Tensor) -> torch.Tensor:
            if guidance_scale <= 1.0:
                return v
            uncond, cond = v.chunk(2)
            return uncond + guidance_scale * (cond - uncond)

        doubled = (lambda x: torch.cat([x, x])) if guidance_scale > 1.0 else (lambda x: x)
        if self.sampling_order == "video_first":
            if num_inference_steps % 2:
                raise ValueError(f"video_first sampling splits its steps between two phases: "
                                 f"num_inference_steps must be even, got {num_inference_steps}")
            self.scheduler.set_timesteps(num_inference_steps // 2, device=device)
            taus = video_first_schedule(self.scheduler.sigmas.float())
            for tau, tau_next in self.progress_bar(list(zip(taus[:-1], taus[1:]))):
                x = doubled(latents)
                v = guided(self.video_first_velocity(x.to(self.model.dtype), tau.expand(len(x)), text, pooled))
                latents = latents + (tau_next - tau) * v.float()
        else:
            self.scheduler.set_timesteps(num_inference_steps, device=device)
            for t in self.progress_bar(self.scheduler.timesteps):
                x = doubled(latents)
                v = guided(self.velocity(x.to(self.model.dtype), t.expand(len(x)), text, pooled))
                latents = self.scheduler.step(v, t, latents, return_dict=False)[0]
        samples = self.decode_latents(latents)
        out = AVPipelineOutput(samples.video, samples.audio, latents, samples.sample_rate, samples.fps)
        return out if return_dict else (out.video, out.audio)


# --------------------------------------------------------------------------- builder


@dataclass
class TinyAVSizes:
    """Sizes of an ``AVPipeline``. Defaults are test-sized (fast on one CPU core); the shipped
    demo's are ``scripts/pretrain_av.py``'s ``DEMO_SIZES``."""

    dim: int = 16
    layers: int = 1
    heads: int = 2
    mlp_ratio: int = 2
    text_hidden: int = 16
    text_layers: int = 1
    text_projection: int = 16  # unused by CLIPTextModel; _clip_config asks for it
    max_prompt_tokens: int = 16
    scheduler_shift: float = 1.0


def build_tiny_av_pipeline(words: list[str], sizes: TinyAVSizes = TinyAVSizes(), seed: int = 0) -> AVPipeline:
    """A randomly initialised ``AVPipeline`` in the audio-video world's layout (8 frames of
    16 × 16, 64 samples per frame) for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    model = AVDiffusionModel(dim=sizes.dim, layers=sizes.layers, heads=sizes.heads, mlp_ratio=sizes.mlp_ratio,
                             text_dim=sizes.text_hidden)
    return AVPipeline(model=model, text_encoder=CLIPTextModel(_clip_config(tokenizer, sizes)), tokenizer=tokenizer,
                      scheduler=FlowMatchEulerDiscreteScheduler(shift=sizes.scheduler_shift))


# --------------------------------------------------------------------------- adapter


class AVDemoAdapter(DenoiserAdapter):
    """An ``AVPipeline`` as the RL core sees it (module docstring).

    It shares ``DenoiserAdapter``'s noise, CFG batching and training half (``add_lora``,
    ``enable_full_finetune``, ``trainable``, ``reference``, ``trained_state_dict``), which act on
    ``self.model``; there is no VAE. Besides the protocol it offers what the audio-video routing
    objective reads, named as in ``pipelines/ltx2.py``: ``joint_layout``, ``branch_masks()``
    (bool [2, D]: video, audio), ``cross_modal_attention()`` (name → (branch written, module)),
    and ``record_cross_modal()`` (the attention recorder of ``pipelines/av_model.py``).
    """

    prediction = "velocity"
    family = "av_demo"
    modality = "audio_video"  # decode gives AudioVideoSamples; x is a joint latent [B, D]
    pipeline_class = AVPipeline
    model_folder = "model"
    lora_targets = LORA_TARGETS
    supports_xformers = False  # its attention calls torch's scaled_dot_product_attention directly
    branches = BRANCHES

    def __init__(self, pipe: AVPipeline, *, device: str | torch.device = "cpu"):
        # Not DenoiserAdapter.__init__: it reads image sizes off a VAE this family does not have.
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = torch.device(device)
        self.model: AVDiffusionModel = pipe.model
        self.denoiser: nn.Module = self.model
        self.joint_layout = self.model.joint_layout
        self.lora = False
        self._frozen_reference: nn.Module | None = None
        self._negative: Conditioning | None = None
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
        for part in (pipe.model, pipe.text_encoder):
            part.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        trained: str | Path | None = None, height: int | None = None, width: int | None = None,
                        num_frames: int | None = None, **kwargs):
        """A built-in demo name ("av-demo"), a local pipeline folder or a hub id; ``trained``: a
        ``save_trained`` folder. ``height``, ``width``, ``num_frames`` must be unset or equal the
        model's: its clip size is fixed."""
        pipe = load_with_hub_fallback(AVPipeline.from_pretrained, name_or_path, dtype=torch_dtype(dtype))
        c = pipe.model.config
        for name, value, own in (("height", height, c.height), ("width", width, c.width),
                                 ("num_frames", num_frames, c.frames)):
            if value is not None and value != own:
                raise ValueError(f"the av_demo model makes clips of {c.frames} frames of {c.height}×{c.width}; "
                                 f"model.{name}={value} cannot change that: leave it unset")
        if trained is not None:
            load_trained_weights(pipe, trained, cls.model_folder, pipe.model.dtype)
        return cls(pipe, device=device, **kwargs)

    # -- conditioning and sampling ---------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """B prompts → {"text": [B, L, D_text], "pooled": [B, D_text]}."""
        text, pooled = self.pipe.encode_prompt(prompts)
        return Conditioning({"text": text.float(), "pooled": pooled.float()})

    def negative(self) -> Conditioning:
        """The empty prompt's conditioning [1, ...] (the CFG branch), cached."""
        if self._negative is None:
            self._negative = self.encode([""])
        return self._negative

    def default_size(self) -> tuple[int, int]:
        return self.model.config.height, self.model.config.width

    def latent_shape(self) -> tuple[int, ...]:
        """(D,): one sample's joint latent (``joint_layout.numel``)."""
        return (self.joint_layout.numel,)

    @property
    def sampling_order(self) -> str:
        """The pipeline's "joint" or "video_first" (``AVPipeline``; saved with the model)."""
        return self.pipe.sampling_order

    @property
    def ode_only(self) -> bool:
        """Video-first schedules run τ from 2 to 0, where the flow SDEs' noise schedules are undefined."""
        return self.sampling_order == "video_first"

    def schedule(self, num_steps: int) -> Schedule:
        """The σ's and timesteps the pipeline's scheduler sets for ``num_steps``; video-first: the
        schedule time τ [num_steps + 1] from 2 to 0 and timesteps 1000·τ (``video_first_schedule``,
        half the steps per phase, as ``AVPipeline`` samples)."""
        if self.sampling_order == "joint":
            return self.flow_schedule(num_steps)
        if num_steps % 2:
            raise ValueError(f"video_first sampling splits its steps between two phases: sampling.num_steps "
                             f"must be even, got {num_steps}")
        taus = video_first_schedule(self.flow_schedule(num_steps // 2).sigmas)
        return Schedule(sigmas=taus, timesteps=1000 * taus[:-1])

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, D] at joint latents x [B, D], timestep t (scalar or [B]); CFG when g > 1.
        Video-first: t = 1000·τ and the velocity is dx/dτ (the waiting stream's is 0)."""
        model = self.denoiser if model is None else model

        def forward(x, tensors):
            tt = self.batch_timesteps(t, x.shape[0])
            if self.sampling_order == "video_first":
                v = self.pipe.video_first_velocity(x.to(self.model.dtype), tt / 1000, tensors["text"],
                                                   tensors["pooled"], model=model)
            else:
                v = self.pipe.velocity(x.to(self.model.dtype), tt, tensors["text"], tensors["pooled"], model=model)
            return v.float()

        return self.guided(forward, x, cond, guidance_scale)

    def forward_noised(self, x0: torch.Tensor, noise: torch.Tensor,
                       sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A forward-process draw at schedule level σ [B] (the schedule's σ, or τ when video-first)
        of samples x0 [B, D] with noise [B, D] → (the x0 the loss compares x̂0 = x_t − σ_m·v with,
        x_t, σ_m [B]). Joint: (x0, (1 − σ)·x0 + σ·ε, σ). Video-first: each stream at its own level
        (``video_first_levels``), σ_m the moving stream's; the waiting stream's x0 is replaced by
        its x_t (its velocity is 0, so x̂0 = x_t there), so the loss trains the moving stream only."""
        s = sigma.float().to(x0.device)
        if self.sampling_order == "joint":
            return x0, (1 - s[:, None]) * x0 + s[:, None] * noise, s
        sigma_video, sigma_audio, video_moves = video_first_levels(s)
        video_mask = self.joint_layout.masks(x0.device)[0]
        levels = torch.where(video_mask[None], sigma_video[:, None], sigma_audio[:, None])
        x_t = (1 - levels) * x0 + levels * noise
        moving = self.pipe.moving_elements(video_moves)
        return torch.where(moving, x0, x_t), x_t, torch.where(video_moves, sigma_video, sigma_audio)

    # -- what the routing objective reads ----------------------------------------------------
    def branch_masks(self) -> torch.Tensor:
        """bool [2, D]: row 0 the video elements, row 1 the audio elements of a joint latent."""
        return self.joint_layout.masks(self.device)

    def cross_modal_attention(self) -> dict[str, tuple[str, nn.Module]]:
        """name → (the branch it writes into, module) for every ``audio_to_video_attn`` (video
        tokens query audio: writes video) and ``video_to_audio_attn`` (writes audio)."""
        writes = {"audio_to_video_attn": "video", "video_to_audio_attn": "audio"}
        return {name: (writes[name.rsplit(".", 1)[-1]], module) for name, module in self.model.cross_modal_modules().items()}

    def record_cross_modal(self, maps: bool = True, model: nn.Module | None = None):
        """Context recording the cross-modal attention of ``model`` (default: the policy's
        denoiser; a peft-wrapped or accelerate-wrapped model is searched for its
        ``AVDiffusionModel``). Yields an ``AttentionRecorder``."""
        target = self.denoiser if model is None else model
        inner = next((m for m in target.modules() if isinstance(m, AVDiffusionModel)), None)
        if inner is None:
            return contextlib.nullcontext(None)
        return inner.record_cross_modal(maps=maps)

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> AudioVideoSamples:
        """Joint latents [B, D] → ``AudioVideoSamples`` (video [B, F, 3, H, W] in [0, 1], audio [B, 1, T])."""
        return self.pipe.decode_latents(x0)

    def enable_vae_tiling(self, **tile_sizes) -> None:
        raise NotImplementedError("the av_demo model has no VAE")

    enable_vae_slicing = enable_vae_tiling

    # -- training --------------------------------------------------------------------------
    def enable_gradient_checkpointing(self) -> None:
        raise NotImplementedError("the av_demo model is small: gradient checkpointing is not implemented")

    def enable_xformers(self) -> None:
        raise NotImplementedError("the av_demo model uses torch's scaled_dot_product_attention; xformers does not apply")

