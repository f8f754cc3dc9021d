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
  ``T5TokenizerFast``, ``UniPCMultistepScheduler`` with flow sigmas (what Wan ships);
* LTX-2: ``LTX2VideoTransformer3DModel`` (audio↔video cross-attention), ``AutoencoderKLLTX2Video``,
  ``AutoencoderKLLTX2Audio``, ``LTX2Vocoder``, ``LTX2TextConnectors``, ``Gemma3ForConditionalGeneration``
  + ``GemmaTokenizer``, ``FlowMatchEulerDiscreteScheduler`` with LTX-2's configuration.

T5 tokenizers are Unigram models over the caption words (``build_t5_tokenizer``), the Gemma one a
BPE (``build_gemma_tokenizer``), not sentencepiece files: the pipelines only call them, and they
save and load as real ones.
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
    suffix), so any other lowercase word still tokenizes, into pieces. The trainer numbers its
    tokens in a hash-map order that changes from process to process (the same tokens, other ids,
    so a model built from the same seed would differ between runs): ids are reassigned here, the
    special tokens first, then the rest sorted.
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
    learnt = bpe.get_vocab()
    ordered = [BOS, EOS] + sorted(token for token in learnt if token not in (BOS, EOS))
    return CLIPTokenizer(vocab={token: i for i, token in enumerate(ordered)}, merges=merges,
                         model_max_length=max_length)


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


# --------------------------------------------------------------------------- LTX-2 (joint audio-video)

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>")  # Gemma's pad 0, eos 1, bos 2, unk 3; then the image markers


def build_gemma_tokenizer(words: list[str]):
    """A real ``GemmaTokenizer`` (byte-fallback BPE, spaces as "▁", ``<bos>`` prepended) whose merges
    make every word in ``words`` one token, with or without its leading "▁"; other lowercase words
    tokenize into pieces."""
    from transformers import GemmaTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=10_000, special_tokens=list(GEMMA_SPECIALS), show_progress=False,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789▁"))
    # each training item is one pre-token: merges never cross "▁", as Gemma's never cross a space
    bpe.train_from_iterator([w for word in words for w in (word, "▁" + word)] * 4, trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    return GemmaTokenizer(vocab=bpe.get_vocab(), merges=merges, add_bos_token=True)  # Gemma prepends <bos>


@dataclass
class TinyLTX2Sizes:
    """Sizes of a small LTX-2 text-to-audio-video pipeline. Defaults are test-sized (fast on one CPU core).

    The video VAE compresses 4× in space (its patch 2 × one 2× stage) and 2× in time; the audio
    VAE turns ``mel_bins`` mel bins into mel_bins / 4 latent bins of ``audio_latent_channels``
    (the transformer's audio token is one latent time step: channels × latent bins features).
    """

    video_latent_channels: int = 8
    vae_channels: int = 8
    audio_latent_channels: int = 2
    mel_bins: int = 8
    audio_vae_channels: int = 4  # = audio_latent_channels · mel_bins / 4 (the audio VAE's latent statistics)
    sample_rate: int = 16000
    hop_length: int = 160  # mel frames per second = sample_rate / hop_length; the vocoder upsamples by this
    text_hidden: int = 16  # Gemma3; also the connectors' width (LTX-2.0: connector width = caption channels)
    text_layers: int = 2
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    audio_heads: int = 2
    audio_head_dim: int = 4
    connector_registers: int = 8  # LTX-2's learnable registers; the prompt length must be a multiple
    max_prompt_tokens: int = 64  # Gemma's position table


# LTX-2's scheduler_config.json (diffusers' conversion script): dynamic exponential shift, σ_S-1 = 0.1
LTX2_SCHEDULER = {"base_image_seq_len": 1024, "base_shift": 0.95, "max_image_seq_len": 4096, "max_shift": 2.05,
                  "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.1, "time_shift_type": "exponential",
                  "use_dynamic_shifting": True}


def _tiny_gemma3(tokenizer, sizes: TinyLTX2Sizes):
    """A ``Gemma3ForConditionalGeneration`` (its SigLIP tower is built but never run: prompts are text)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vocab = tokenizer.get_vocab()
    text = Gemma3TextConfig(vocab_size=len(vocab), hidden_size=sizes.text_hidden, intermediate_size=2 * sizes.text_hidden,
                            num_hidden_layers=sizes.text_layers, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=sizes.text_hidden // 2, query_pre_attn_scalar=sizes.text_hidden // 2,
                            max_position_embeddings=sizes.max_prompt_tokens, sliding_window=8,
                            pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"], bos_token_id=vocab["<bos>"])
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab["<start_of_image>"],
        eoi_token_index=vocab["<end_of_image>"], image_token_index=vocab["<image_soft_token>"]))


def build_tiny_ltx2_pipeline(words: list[str], sizes: TinyLTX2Sizes = TinyLTX2Sizes(), seed: int = 0):
    """A randomly initialised ``LTX2Pipeline`` (LTX-2.0 layout: one text projection shared by the
    video and audio connectors) for captions made of ``words``: Gemma3 text encoder, connectors,
    ``LTX2VideoTransformer3DModel`` with audio↔video cross-attention, both VAEs, the vocoder and
    LTX-2's scheduler configuration."""
    # imported here: the LTX-2 modules pull in transformers' Gemma 3/4 classes, which the other builders do not need
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    if sizes.audio_vae_channels * 4 != sizes.audio_latent_channels * sizes.mel_bins:
        raise ValueError("audio_vae_channels must be audio_latent_channels · mel_bins / 4 (one audio token's features)")
    torch.manual_seed(seed)
    tokenizer = build_gemma_tokenizer(words)
    text_encoder = _tiny_gemma3(tokenizer, sizes)
    connector = dict(num_attention_heads=2, attention_head_dim=sizes.text_hidden // 2, num_layers=1,
                     num_learnable_registers=sizes.connector_registers)
    connectors = LTX2TextConnectors(
        caption_channels=sizes.text_hidden, text_proj_in_factor=sizes.text_layers + 1, connector_rope_base_seq_len=32,
        rope_type="split", **{f"{m}_connector_{k}": v for m in ("video", "audio") for k, v in connector.items()})
    audio_features = sizes.audio_latent_channels * sizes.mel_bins // 4
    transformer = LTX2VideoTransformer3DModel(
        in_channels=sizes.video_latent_channels, out_channels=sizes.video_latent_channels, patch_size=1,
        patch_size_t=1, num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
        cross_attention_dim=sizes.heads * sizes.head_dim, vae_scale_factors=(2, 4, 4),
        audio_in_channels=audio_features, audio_out_channels=audio_features, audio_num_attention_heads=sizes.audio_heads,
        audio_attention_head_dim=sizes.audio_head_dim, audio_cross_attention_dim=sizes.audio_heads * sizes.audio_head_dim,
        audio_sampling_rate=sizes.sample_rate, audio_hop_length=sizes.hop_length, num_layers=sizes.layers,
        caption_channels=sizes.text_hidden, rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=sizes.video_latent_channels,
        block_out_channels=(sizes.vae_channels,), decoder_block_out_channels=(sizes.vae_channels,),
        layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",), upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
        patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=sizes.audio_vae_channels, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=sizes.audio_latent_channels, norm_type="pixel",
        causality_axis="height", mid_block_add_attention=False, sample_rate=sizes.sample_rate,
        mel_hop_length=sizes.hop_length, is_causal=True, mel_bins=sizes.mel_bins,
    )
    factors = _upsample_factors(sizes.hop_length)
    vocoder = LTX2Vocoder(in_channels=2 * sizes.mel_bins, hidden_channels=8 * 2 ** len(factors), out_channels=2,
                          upsample_kernel_sizes=[2 * f for f in factors], upsample_factors=factors,
                          resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], output_sampling_rate=sizes.sample_rate)
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)


def _upsample_factors(hop: int) -> list[int]:
    """hop as a product of small factors (the vocoder's upsampling stages: one mel frame → hop samples)."""
    factors, rest = [], hop
    for f in (5, 4, 3, 2):
        while rest % f == 0 and rest > 1:
            factors.append(f)
            rest //= f
    if rest != 1:
        raise ValueError(f"hop_length {hop} must factor into 2, 3, 4 and 5 (the tiny vocoder's upsampling stages)")
    return factors
