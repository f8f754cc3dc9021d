"""Offline builders for small real diffusers pipelines: no download, every part made in code.

Used by the tests (tiny random models) and by ``scripts/pretrain_shapes.py`` (the shipped demo
model is one of these, trained). The parts are the real classes a user's checkpoint uses:

* SD3: ``SD3Transformer2DModel``, ``AutoencoderKL``, two ``CLIPTextModelWithProjection`` with a
  ``CLIPTokenizer``, ``FlowMatchEulerDiscreteScheduler``; the T5 encoder is left out (SD3
  allows it: its slot is filled with zeros);
* SD1.x: ``UNet2DConditionModel``, ``AutoencoderKL``, ``CLIPTextModel``, ``DDIMScheduler`` with
  SD1.5's betas; no safety checker;
* SDXL: ``UNet2DConditionModel`` with the "text_time" added embedding, ``AutoencoderKL``,
  ``CLIPTextModel`` + ``CLIPTextModelWithProjection``, ``EulerDiscreteScheduler`` (what SDXL
  ships; the adapter samples with DDIM from its config).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from diffusers import (AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler,
                       SD3Transformer2DModel, StableDiffusion3Pipeline, StableDiffusionPipeline,
                       StableDiffusionXLPipeline, UNet2DConditionModel)
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def build_clip_tokenizer(words: list[str], max_length: int = 16) -> CLIPTokenizer:
    """A real ``CLIPTokenizer`` whose byte-pair merges turn every word in ``words`` into one token.

    The merges are learnt with the ``tokenizers`` BPE trainer (CLIP's ``</w>`` end-of-word
    suffix), so any other lowercase word still tokenizes, into pieces.
    """
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token=EOS))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=10_000, special_tokens=[BOS, EOS], end_of_word_suffix="</w>", show_progress=False,
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789"),
    )
    bpe.train_from_iterator(words * 4, trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    return CLIPTokenizer(vocab=bpe.get_vocab(), merges=merges, model_max_length=max_length)


@dataclass
class TinySD3Sizes:
    """Sizes of a small SD3 pipeline. Defaults are test-sized (fast on one CPU core)."""

    image_size: int = 16
    vae_channels: tuple[int, ...] = (8, 16)  # len − 1 downsamplings by 2
    latent_channels: int = 4
    text_hidden: int = 16  # per CLIP encoder; SD3 concatenates the two
    text_layers: int = 2
    text_projection: int = 16
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    patch_size: int = 2
    max_prompt_tokens: int = 16
    scheduler_shift: float = 1.0


def _clip_config(tokenizer: CLIPTokenizer, sizes: TinySD3Sizes | TinyUNetSizes) -> CLIPTextConfig:
    """A CLIP text encoder's config for ``tokenizer``'s vocabulary (a new one per encoder)."""
    vocab = tokenizer.get_vocab()
    return CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=sizes.text_hidden, intermediate_size=4 * sizes.text_hidden,
        num_hidden_layers=sizes.text_layers, num_attention_heads=2, projection_dim=sizes.text_projection,
        max_position_embeddings=sizes.max_prompt_tokens, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
    )


def _vae(channels: tuple[int, ...], latent_channels: int, image_size: int, **config) -> AutoencoderKL:
    """An ``AutoencoderKL`` downsampling by 2^(len(channels) − 1)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * len(channels), up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels, layers_per_block=1, norm_num_groups=min(channels[0], 8), sample_size=image_size,
        **config,
    )


def build_tiny_sd3_pipeline(words: list[str], sizes: TinySD3Sizes = TinySD3Sizes(), seed: int = 0) -> StableDiffusion3Pipeline:
    """A randomly initialised ``StableDiffusion3Pipeline`` for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    vae = _vae(sizes.vae_channels, sizes.latent_channels, sizes.image_size, use_quant_conv=False,
               use_post_quant_conv=False, scaling_factor=1.0, shift_factor=0.0)
    latent_size = sizes.image_size // 2 ** (len(sizes.vae_channels) - 1)
    inner = sizes.heads * sizes.head_dim
    transformer = SD3Transformer2DModel(
        sample_size=latent_size, patch_size=sizes.patch_size, in_channels=sizes.latent_channels,
        out_channels=sizes.latent_channels, num_layers=sizes.layers, attention_head_dim=sizes.head_dim,
        num_attention_heads=sizes.heads, joint_attention_dim=2 * sizes.text_hidden, caption_projection_dim=inner,
        pooled_projection_dim=2 * sizes.text_projection, pos_embed_max_size=latent_size // sizes.patch_size,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=sizes.scheduler_shift),
        vae=vae, text_encoder=CLIPTextModelWithProjection(_clip_config(tokenizer, sizes)), tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(tokenizer, sizes)), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
    )


@dataclass
class TinyUNetSizes:
    """Sizes of a small SD1.x or SDXL pipeline. Defaults are test-sized (fast on one CPU core)."""

    image_size: int = 16
    vae_channels: tuple[int, ...] = (8, 16)  # len − 1 downsamplings by 2
    latent_channels: int = 4
    unet_channels: tuple[int, ...] = (8, 16)  # one UNet level each; cross-attention in all but the last (as SD)
    heads: int = 2  # per attention layer (diffusers' legacy ``attention_head_dim`` of SD UNets)
    text_hidden: int = 16  # per CLIP encoder; SDXL concatenates the two
    text_layers: int = 2  # ≥ 2: SDXL reads the penultimate hidden states
    text_projection: int = 16  # SDXL: the pooled embedding of the second encoder
    time_id_dim: int = 4  # SDXL: the embedding width of each of the 6 size/crop ids
    max_prompt_tokens: int = 16


# SD1.5's and SDXL's noise schedule (their scheduler_config.json)
SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}


def _unet(sizes: TinyUNetSizes, cross_attention_dim: int, **config) -> UNet2DConditionModel:
    levels = len(sizes.unet_channels)
    return UNet2DConditionModel(
        sample_size=sizes.image_size // 2 ** (len(sizes.vae_channels) - 1), in_channels=sizes.latent_channels,
        out_channels=sizes.latent_channels, block_out_channels=sizes.unet_channels, layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        attention_head_dim=sizes.heads, cross_attention_dim=cross_attention_dim,
        norm_num_groups=min(sizes.unet_channels[0], 8), **config,
    )


def build_tiny_sd_pipeline(words: list[str], sizes: TinyUNetSizes = TinyUNetSizes(),
                           seed: int = 0) -> StableDiffusionPipeline:
    """A randomly initialised SD1.x-style ``StableDiffusionPipeline`` for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    return StableDiffusionPipeline(
        vae=_vae(sizes.vae_channels, sizes.latent_channels, sizes.image_size, scaling_factor=0.18215),
        text_encoder=CLIPTextModel(_clip_config(tokenizer, sizes)), tokenizer=tokenizer,
        unet=_unet(sizes, sizes.text_hidden),
        scheduler=DDIMScheduler(**SD_BETAS, clip_sample=False, set_alpha_to_one=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def build_tiny_sdxl_pipeline(words: list[str], sizes: TinyUNetSizes = TinyUNetSizes(),
                             seed: int = 0) -> StableDiffusionXLPipeline:
    """A randomly initialised ``StableDiffusionXLPipeline`` for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    unet = _unet(sizes, 2 * sizes.text_hidden, addition_embed_type="text_time",
                 addition_time_embed_dim=sizes.time_id_dim, use_linear_projection=True,
                 projection_class_embeddings_input_dim=6 * sizes.time_id_dim + sizes.text_projection)
    scheduler = EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading")
    # SDXL's shipped scheduler_config.json also carries these DDIM keys (Euler ignores them;
    # DDIMScheduler.from_config reads them, else it would clip x̂0 and set ᾱ to 1 after the last step)
    scheduler.register_to_config(clip_sample=False, set_alpha_to_one=False)
    return StableDiffusionXLPipeline(
        vae=_vae(sizes.vae_channels, sizes.latent_channels, sizes.image_size, scaling_factor=0.13025),
        text_encoder=CLIPTextModel(_clip_config(tokenizer, sizes)), tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(tokenizer, sizes)), tokenizer_2=tokenizer,
        unet=unet, scheduler=scheduler, add_watermarker=False,
    )
