"""The built-in joint audio-video denoiser: two token streams with bidirectional cross-attention.

Inputs: the clip itself as tokens, no VAE: video pixels [B, F, 3, H, W] scaled to [−1, 1] and the
waveform [B, T] as it is (the layout of ``reward_models.worlds.audio_video``), noised by rectified
flow; the joint latent of ``pipelines/joint.py`` is the two token sequences flattened. At
8 × 16 × 16 RGB + 512 samples a clip is 6,656 numbers: as tokens (below) that is 160 tokens, which
a small transformer attends over in full on a CPU; a VAE would add a second model to train and a
reconstruction error on top of rewards that are exact at the pixel and sample level (palette
colours, pure tones, onsets at sample 0 of a period).

Tokens: a video token is a ``patch`` × ``patch`` pixel patch of one frame (3·p² values; p = 4:
16 per frame, 128 in all); an audio token is ``audio_patch`` consecutive samples (16: 4 per frame
period, 32 in all). Each stream adds a learned embedding of the token's place within its frame
(patch row/column; sample window) and a fixed sinusoidal encoding of the token's *time* in frames
(video: the frame index; audio: the window's start), the same function for both streams, so that
cross-attention can match a beep to the frame it belongs to.

Conditioning: text hidden states [B, L, D_text] (cross-attention in both streams) and the pooled
text embedding [B, D_text], added to the timestep embedding (diffusers' ``Timesteps`` +
``TimestepEmbedding`` of t = 1000·σ); that vector modulates every block (adaLN: shift, scale and
gate of the self-attention and MLP of each stream, zero-initialised) and the output layer.

Every block, for each stream s ∈ {video, audio}: h_s += gate·self_attn(mod(LN h_s)); h_s +=
text_attn(LN h_s, text); then, both from the same states,

    h_v += audio_to_video_attn(h_v, h_a)   (video tokens query audio tokens)
    h_a += video_to_audio_attn(h_a, h_v)   (audio tokens query video tokens)

and h_s += gate·mlp(mod(LN h_s)). Output: velocity v ≈ ε − x0 per token, in the input layout.

Reading the cross-modal attention: ``with model.record_cross_modal(maps=True) as rec:`` around a
forward pass stores, per call of every ``audio_to_video_attn`` / ``video_to_audio_attn`` (names
like ``blocks.2.audio_to_video_attn``), a ``CrossModalRecord``: the attention probabilities
[B, heads, N_query, N_key] (with ``maps``), the norm of the module's output per query token and
of the residual stream it is added to [B, N_query] (detached). Recording computes the softmax
explicitly for those modules (cheap at these sizes); without a recorder they use SDPA.

All attention projections are ``nn.Linear`` named ``to_q``, ``to_k``, ``to_v``, ``to_out`` (peft
LoRA targets); ``cross_modal_modules()`` lists the cross-modal ones (for gradient scaling).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from pipelines.joint import JointLayout

CROSS_MODAL_NAMES = ("audio_to_video_attn", "video_to_audio_attn")


# --------------------------------------------------------------------------- recording


@dataclass
class CrossModalRecord:
    """One call of a cross-modal attention module. probs: [B, heads, N_query, N_key] (None
    without maps); output_norm, residual_norm: [B, N_query] (‖update‖ and ‖residual input‖ per
    query token)."""

    probs: torch.Tensor | None
    output_norm: torch.Tensor
    residual_norm: torch.Tensor

    @property
    def response_ratio(self) -> torch.Tensor:
        """u = ‖output‖ / ‖residual‖ per query token: [B, N_query]."""
        return self.output_norm / self.residual_norm.clamp(min=1e-6)

    @property
    def received_mass(self) -> torch.Tensor:
        """Mean attention each key token receives over the queries: [B, heads, N_key] (sums to 1
        over keys)."""
        if self.probs is None:
            raise ValueError("recorded without maps: use record_cross_modal(maps=True)")
        return self.probs.mean(2)


@dataclass
class AttentionRecorder:
    """records: module name → its calls in order (one per forward pass of the model)."""

    maps: bool = True
    records: dict[str, list[CrossModalRecord]] = field(default_factory=dict)

    def add(self, name: str, record: CrossModalRecord) -> None:
        self.records.setdefault(name, []).append(record)

    def last(self, name: str) -> CrossModalRecord:
        return self.records[name][-1]

    def clear(self) -> None:
        self.records.clear()


# --------------------------------------------------------------------------- layers


def time_encoding(times: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoids of a time in frames: times [N] → [N, dim], periods from 2 to 64 frames
    (geometric), sin and cos halves. Shared by both streams."""
    half = dim // 2
    periods = 2.0 * 32.0 ** (torch.arange(half, dtype=torch.float32, device=times.device) / max(half - 1, 1))
    angles = 2 * math.pi * times.float()[:, None] / periods[None]
    out = torch.cat([angles.sin(), angles.cos()], -1)
    return F.pad(out, (0, dim - 2 * half))


class Attention(nn.Module):
    """Multi-head attention of queries x [B, N, D] over context [B, M, D_ctx] (x itself when None)."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(context_dim or dim, dim)
        self.to_v = nn.Linear(context_dim or dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """mask: bool [N, M], True where a query may attend a key (None: everywhere) → (output
        [B, N, D], probabilities [B, heads, N, M] or None)."""
        context = x if context is None else context
        b, n, d = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (proj(context).view(b, context.shape[1], self.heads, -1).transpose(1, 2)
                for proj in (self.to_k, self.to_v))
        probs = None
        if return_probs:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out = probs @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d)), probs


class CrossModalAttention(Attention):
    """Pre-norm attention of one modality's tokens over the other's; records when a recorder is set."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)
        self.norm_q, self.norm_kv = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.recorder: AttentionRecorder | None = None
        self.record_name = ""

    def forward(self, h: torch.Tensor, other: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """h: the querying stream's residual [B, N, D]; other: the other stream [B, M, D]; mask: bool
        [N, M] (True: may attend) or None → update [B, N, D]."""
        recorder = self.recorder
        out, probs = super().forward(self.norm_q(h), self.norm_kv(other), mask=mask,
                                     return_probs=recorder is not None and recorder.maps)
        if recorder is not None:
            recorder.add(self.record_name, CrossModalRecord(
                None if probs is None else probs.detach(), out.detach().float().norm(dim=-1),
                h.detach().float().norm(dim=-1)))
        return out


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class StreamLayers(nn.Module):
    """One stream's self-attention, text attention and MLP in a block, with adaLN modulation."""

    def __init__(self, dim: int, heads: int, text_dim: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = Attention(dim, heads)
        self.norm_text = nn.LayerNorm(dim)
        self.text_attn = Attention(dim, heads, context_dim=text_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff_in, self.ff_out = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def attend(self, h: torch.Tensor, text: torch.Tensor, mod: list[torch.Tensor]) -> torch.Tensor:
        shift, scale, gate = mod[:3]
        h = h + gate[:, None] * self.self_attn(_modulate(self.norm1(h), shift, scale))[0]
        return h + self.text_attn(self.norm_text(h), text)[0]

    def mlp(self, h: torch.Tensor, mod: list[torch.Tensor]) -> torch.Tensor:
        shift, scale, gate = mod[3:]
        return h + gate[:, None] * self.ff_out(F.gelu(self.ff_in(_modulate(self.norm2(h), shift, scale))))


class AVBlock(nn.Module):
    """One joint block (module docstring)."""

    def __init__(self, dim: int, heads: int, text_dim: int, mlp_ratio: int):
        super().__init__()
        self.video = StreamLayers(dim, heads, text_dim, mlp_ratio)
        self.audio = StreamLayers(dim, heads, text_dim, mlp_ratio)
        self.audio_to_video_attn = CrossModalAttention(dim, heads)
        self.video_to_audio_attn = CrossModalAttention(dim, heads)

    def forward(self, hv, ha, text, cond_video, cond_audio, video_sees_audio=None, audio_sees_video=None):
        mv = self.video.modulation(F.silu(cond_video)).chunk(6, dim=-1)
        ma = self.audio.modulation(F.silu(cond_audio)).chunk(6, dim=-1)
        hv, ha = self.video.attend(hv, text, mv), self.audio.attend(ha, text, ma)
        hv, ha = (hv + self.audio_to_video_attn(hv, ha, video_sees_audio),
                  ha + self.video_to_audio_attn(ha, hv, audio_sees_video))
        return self.video.mlp(hv, mv), self.audio.mlp(ha, ma)


class OutputLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, out_dim)
        for layer in (self.modulation, self.proj):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, h, cond):
        shift, scale = self.modulation(F.silu(cond)).chunk(2, dim=-1)
        return self.proj(_modulate(self.norm(h), shift, scale))


# --------------------------------------------------------------------------- the model


class AVDiffusionModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Joint audio-video velocity model (module docstring).

    Config: ``frames``, ``height``, ``width``, ``samples_per_frame`` the clip layout; ``patch``
    (video, pixels) and ``audio_patch`` (samples) the token sizes; ``dim``, ``layers``,
    ``heads``, ``mlp_ratio`` the transformer; ``text_dim`` the text encoder's hidden size;
    ``cross_modal_window`` (frames, or None for full attention): a video token attends only to
    the audio tokens within that many frames of its own, and an audio token to those video tokens
    (0: the same frame), the temporally aligned cross-attention of LTX-2's audio-video blocks
    (there through a temporal RoPE; here a hard mask). It adds no weights, so
    ``set_cross_modal_window`` can switch a trained model.
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, frames: int = 8, height: int = 16, width: int = 16, samples_per_frame: int = 64,
                 patch: int = 4, audio_patch: int = 16, dim: int = 64, layers: int = 4, heads: int = 4,
                 mlp_ratio: int = 4, text_dim: int = 32, cross_modal_window: int | None = None):
        super().__init__()
        if height % patch or width % patch or samples_per_frame % audio_patch or dim % heads:
            raise ValueError(f"patch {patch} must divide {height}×{width}, audio_patch {audio_patch} must divide "
                             f"{samples_per_frame}, heads {heads} must divide dim {dim}")
        self.grid = (height // patch, width // patch)
        self.audio_tokens_per_frame = samples_per_frame // audio_patch
        self.video_in = nn.Linear(3 * patch * patch, dim)
        self.audio_in = nn.Linear(audio_patch, dim)
        self.video_place = nn.Parameter(torch.randn(self.grid[0] * self.grid[1], dim) * 0.02)
        self.audio_place = nn.Parameter(torch.randn(self.audio_tokens_per_frame, dim) * 0.02)
        self.time_proj = Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(dim, dim)
        self.pooled_embed = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(AVBlock(dim, heads, text_dim, mlp_ratio) for _ in range(layers))
        self.video_out = OutputLayer(dim, 3 * patch * patch)
        self.audio_out = OutputLayer(dim, audio_patch)
        frame_of_video = torch.arange(frames).repeat_interleave(self.grid[0] * self.grid[1])
        frame_of_audio = torch.arange(frames * self.audio_tokens_per_frame) / self.audio_tokens_per_frame
        self.register_buffer("video_time", time_encoding(frame_of_video, dim), persistent=False)
        self.register_buffer("audio_time", time_encoding(frame_of_audio, dim), persistent=False)
        self.register_buffer("video_frame", frame_of_video, persistent=False)
        self.register_buffer("audio_frame", frame_of_audio.floor().long(), persistent=False)
        self.set_cross_modal_window(cross_modal_window)

    def set_cross_modal_window(self, window: int | None) -> None:
        """Restrict cross-modal attention to tokens within ``window`` frames (None: no restriction);
        recorded in the config, so ``save_pretrained`` keeps it."""
        if window is not None and window < 0:
            raise ValueError(f"cross_modal_window must be ≥ 0 or None, got {window}")
        self.register_to_config(cross_modal_window=window)

    def cross_modal_masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(video sees audio: bool [N_v, N_a], audio sees video: [N_a, N_v]), None without a window."""
        window = self.config.cross_modal_window
        if window is None:
            return None, None
        near = (self.video_frame[:, None] - self.audio_frame[None]).abs() <= window
        return near, near.T

    @property
    def joint_layout(self) -> JointLayout:
        """The token sequences the model reads: video [F·(H/p)·(W/p), 3·p²], audio [T / a, a]
        (``pipelines/joint.py``: the joint latent is both flattened token-major, video first)."""
        c = self.config
        return JointLayout(video_tokens=c.frames * self.grid[0] * self.grid[1], video_channels=3 * c.patch ** 2,
                           audio_tokens=c.frames * self.audio_tokens_per_frame, audio_channels=c.audio_patch)

    # -- tokens ------------------------------------------------------------------------------
    def patchify_video(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels [B, F, 3, H, W] → tokens [B, F·(H/p)·(W/p), 3·p²] (frame-major, then patch row,
        column; within a token channel-major, then pixel row, column)."""
        b, f, c, h, w = video.shape
        p, (gh, gw) = self.config.patch, self.grid
        x = video.reshape(b, f, c, gh, p, gw, p).permute(0, 1, 3, 5, 2, 4, 6)
        return x.reshape(b, f * gh * gw, c * p * p)

    def unpatchify_video(self, tokens: torch.Tensor) -> torch.Tensor:
        """The inverse of ``patchify_video``: [B, N_v, 3·p²] → [B, F, 3, H, W]."""
        c = self.config
        b, p, (gh, gw) = tokens.shape[0], c.patch, self.grid
        x = tokens.reshape(b, c.frames, gh, gw, 3, p, p).permute(0, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, c.frames, 3, c.height, c.width)

    def patchify_audio(self, audio: torch.Tensor) -> torch.Tensor:
        """Waveform [B, T] → tokens [B, T / a, a] (consecutive samples)."""
        return audio.reshape(audio.shape[0], -1, self.config.audio_patch)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """video tokens [B, N_v, 3·p²], audio tokens [B, N_a, a] (noisy latents, ``joint_layout``);
        timestep [B] = 1000·σ, or [B, 2] = 1000·(σ_video, σ_audio) for streams noised to different
        levels (pre-training, ``scripts/pretrain_av.py --independent-noise``; each stream's adaLN
        then reads its own level); text [B, L, D_text]; pooled [B, D_text]. Returns the velocities
        in the same token layouts."""
        layout, b = self.joint_layout, video.shape[0]
        if (video.shape[1:] != (layout.video_tokens, layout.video_channels)
                or audio.shape[1:] != (layout.audio_tokens, layout.audio_channels)):
            raise ValueError(f"expected video tokens [B, {layout.video_tokens}, {layout.video_channels}] and audio "
                             f"tokens [B, {layout.audio_tokens}, {layout.audio_channels}], got {tuple(video.shape)}, "
                             f"{tuple(audio.shape)}")
        dtype = self.video_in.weight.dtype
        frames = self.config.frames
        per_stream = timestep.dim() == 2 and timestep.shape[1] == 2
        levels = timestep.unbind(1) if per_stream else (timestep.flatten().expand(b),) * 2
        text_cond = self.pooled_embed(pooled.to(dtype))
        cond_video, cond_audio = (self.time_embed(self.time_proj(t).to(dtype)) + text_cond for t in levels)
        hv = self.video_in(video.to(dtype)) + self.video_place.repeat(frames, 1) + self.video_time.to(dtype)
        ha = self.audio_in(audio.to(dtype)) + self.audio_place.repeat(frames, 1) + self.audio_time.to(dtype)
        text = text.to(dtype)
        masks = self.cross_modal_masks()
        for block in self.blocks:
            hv, ha = block(hv, ha, text, cond_video, cond_audio, *masks)
        return self.video_out(hv, cond_video), self.audio_out(ha, cond_audio)

    # -- cross-modal access ------------------------------------------------------------------
    def cross_modal_modules(self) -> dict[str, CrossModalAttention]:
        """Every ``audio_to_video_attn`` / ``video_to_audio_attn`` by module name, block order."""
        return {name: m for name, m in self.named_modules() if isinstance(m, CrossModalAttention)}

    @contextlib.contextmanager
    def record_cross_modal(self, maps: bool = True):
        """Record every cross-modal attention call inside the context (module docstring)."""
        recorder = AttentionRecorder(maps=maps)
        modules = self.cross_modal_modules()
        for name, module in modules.items():
            # peft may wrap the model: keep the name relative to this model ("blocks.0.…")
            module.recorder, module.record_name = recorder, name.split("base_model.model.")[-1]
        try:
            yield recorder
        finally:
            for module in modules.values():
                module.recorder = None

