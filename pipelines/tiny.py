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
  ships; the adapter samples with DDIM from its config);
* FLUX.1: ``FluxTransformer2DModel``, ``AutoencoderKL`` (16 channels, FLUX's scaling and shift
  factors), ``CLIPTextModel`` + ``CLIPTokenizer``, ``T5EncoderModel`` + ``T5TokenizerFast``,
  ``FlowMatchEulerDiscreteScheduler`` configured as FLUX.1-dev's (guidance embedding, dynamic
  shifting) or FLUX.1-schnell's (neither);
* Wan 2.1: ``WanTransformer3DModel``, ``AutoencoderKLWan``, ``UMT5EncoderModel`` +
  ``T5TokenizerFast``, ``UniPCMultistepScheduler`` with flow sigmas (what Wan ships).

T5 tokenizers are Unigram models over the caption words (``build_t5_tokenizer``), not
sentencepiece files: the pipelines only call them, and they save and load as real ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from diffusers import (AutoencoderKL, AutoencoderKLWan, DDIMScheduler, EulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline,
                       UNet2DConditionModel, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel)
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5Config,
                          T5EncoderModel, T5TokenizerFast, UMT5Config, UMT5EncoderModel)

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


def build_t5_tokenizer(words: list[str]) -> T5TokenizerFast:
    """A real T5 tokenizer (Unigram, T5's ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, no sentinels) in which
    every word in ``words`` is one token; any other lowercase word tokenizes letter by letter."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -1.0) for w in sorted(set(words))]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


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


def _clip_config(tokenizer: CLIPTokenizer, sizes) -> CLIPTextConfig:
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


@dataclass
class TinyFluxSizes:
    """Sizes of a small FLUX.1 pipeline. Defaults are test-sized (fast on one CPU core)."""

    image_size: int = 16
    vae_channels: tuple[int, ...] = (8, 16)  # len − 1 downsamplings by 2; the image is a multiple of 2·that
    latent_channels: int = 16  # as FLUX's VAE; the transformer sees 2×2 patches: 4× as many channels
    text_hidden: int = 16  # CLIP: only its pooled output is used
    text_layers: int = 2
    text_projection: int = 16
    t5_hidden: int = 32
    t5_layers: int = 2
    layers: int = 1  # double-stream (MMDiT) blocks
    single_layers: int = 1
    heads: int = 2
    head_dim: int = 16
    rope_axes: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    max_prompt_tokens: int = 16


# FLUX.1-dev's and FLUX.1-schnell's scheduler_config.json
FLUX_DEV_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                      "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
FLUX_SCHNELL_SCHEDULER = {**FLUX_DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


def _t5_config(tokenizer: T5TokenizerFast, hidden: int, layers: int) -> dict:
    return dict(vocab_size=len(tokenizer), d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=layers,
                num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0)


def build_tiny_flux_pipeline(words: list[str], sizes: TinyFluxSizes = TinyFluxSizes(), seed: int = 0,
                             guidance_embeds: bool = True) -> FluxPipeline:
    """A randomly initialised ``FluxPipeline`` for captions made of ``words``: FLUX.1-dev-like with
    ``guidance_embeds`` (a guidance embedding, its dynamic-shifting scheduler), else FLUX.1-schnell-like."""
    torch.manual_seed(seed)
    clip_tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    t5_tokenizer = build_t5_tokenizer(words)
    vae = _vae(sizes.vae_channels, sizes.latent_channels, sizes.image_size, use_quant_conv=False,
               use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX's factors
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * sizes.latent_channels, num_layers=sizes.layers,
        num_single_layers=sizes.single_layers, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_hidden, pooled_projection_dim=sizes.text_hidden,
        guidance_embeds=guidance_embeds, axes_dims_rope=sizes.rope_axes,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**(FLUX_DEV_SCHEDULER if guidance_embeds else FLUX_SCHNELL_SCHEDULER))
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=CLIPTextModel(_clip_config(clip_tokenizer, sizes)),
        tokenizer=clip_tokenizer, text_encoder_2=T5EncoderModel(T5Config(**_t5_config(t5_tokenizer, sizes.t5_hidden,
                                                                                         sizes.t5_layers))),
        tokenizer_2=t5_tokenizer, transformer=transformer,
    )


@dataclass
class TinyWanSizes:
    """Sizes of a small Wan 2.1 text-to-video pipeline. Defaults are test-sized (fast on one CPU core)."""

    vae_dim: int = 4  # AutoencoderKLWan's base_dim; 8× spatial and 4× temporal compression as Wan's
    latent_channels: int = 16
    text_hidden: int = 32  # UMT5
    text_layers: int = 2
    layers: int = 2
    heads: int = 2
    head_dim: int = 12  # split into temporal / height / width rotary parts
    ffn_dim: int = 32
    flow_shift: float = 3.0  # Wan 2.1 at 480p


def build_tiny_wan_pipeline(words: list[str], sizes: TinyWanSizes = TinyWanSizes(), seed: int = 0) -> WanPipeline:
    """A randomly initialised ``WanPipeline`` (Wan 2.1 text-to-video) for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(words)
    vae = AutoencoderKLWan(base_dim=sizes.vae_dim, z_dim=sizes.latent_channels, dim_mult=[1, 1, 1, 1],
                           num_res_blocks=1, temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
        in_channels=sizes.latent_channels, out_channels=sizes.latent_channels, text_dim=sizes.text_hidden,
        freq_dim=32, ffn_dim=sizes.ffn_dim, num_layers=sizes.layers, rope_max_seq_len=32,
    )
    # what Wan 2.1 ships (its scheduler_config.json); the adapter steps with Euler at the same shift
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=sizes.flow_shift, num_train_timesteps=1000)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer, sizes.text_hidden, sizes.text_layers)))
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)
