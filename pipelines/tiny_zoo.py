"""Offline builders for the newer families' pipelines (``pipelines/tiny.py`` holds the first ones):
small, randomly initialised, every part made in code from the real classes a checkpoint uses:

* Qwen-Image: ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``,
  ``Qwen2_5_VLForConditionalGeneration`` + ``Qwen2Tokenizer``, ``FlowMatchEulerDiscreteScheduler``
  with Qwen-Image's configuration (dynamic exponential shift);

Qwen tokenizers are byte-level BPEs (``build_qwen_tokenizer``) with Qwen's pre-tokenizer and chat
markers, in which every caption word and every word of the pipelines' prompt templates is one
token, so a template tokenizes into as many tokens as with the real tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the words of the pipelines' system prompts (QwenImagePipeline's template and its edit variants)
QWEN_TEMPLATE_TEXT = ("system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                      "spatial relationships of the objects and background:\nuser\nassistant\nDescribe the key features of "
                      "the input image (color, shape, size, texture, objects, background), then explain how the user's "
                      "text instruction should alter or modify the image. Generate a new image that meets the user's "
                      "requirements while maintaining consistency with the original input where appropriate.\n"
                      "Picture 1: \n\n")
# a chat template of Qwen3's form: the user turn, then the assistant's (an empty thinking block unless thinking)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def build_qwen_tokenizer(words: list[str]):
    """A real ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer, ``<|endoftext|>`` as pad, the
    chat markers as special tokens, a Qwen3-style chat template) whose merges make every word of
    ``words`` and of the prompt templates one token, with or without a leading space."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # Qwen's pre-tokenizer split

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=10_000, special_tokens=list(QWEN_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(words), " " + " ".join(words), QWEN_TEMPLATE_TEXT]
    bpe.train_from_iterator(text * 4, trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    learnt = bpe.get_vocab()
    # ids in a fixed order (the trainer's depend on hash order): special tokens first, then sorted
    ordered = list(QWEN_SPECIALS) + sorted(t for t in learnt if t not in QWEN_SPECIALS)
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(ordered)}, merges=merges,
                               additional_special_tokens=list(QWEN_SPECIALS[1:]))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


@dataclass
class TinyQwenImageSizes:
    """Sizes of a small Qwen-Image pipeline. Defaults are test-sized (fast on one CPU core).

    The VAE (Wan-style, causal 3-D convolutions) compresses 8× in space, as Qwen-Image's; the
    transformer sees 2×2 patches of its ``latent_channels`` (4× as many channels)."""

    vae_dim: int = 4
    latent_channels: int = 16
    text_hidden: int = 32  # Qwen2.5-VL's language model; its last hidden states are the conditioning
    text_layers: int = 2
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    rope_axes: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim


# Qwen-Image's scheduler_config.json
QWEN_IMAGE_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False,
                        "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
                        "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
                        "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
                        "use_karras_sigmas": False}


def _tiny_qwen25_vl(tokenizer, hidden: int, layers: int):
    """A ``Qwen2_5_VLForConditionalGeneration`` (its vision tower is built but only the edit
    pipelines run it, on their conditioning image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = tokenizer.get_vocab()
    head_dim = hidden // 2
    text = dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [head_dim // 8, head_dim // 8 * 1.5, head_dim // 8 * 1.5]},
                pad_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"], bos_token_id=None)
    text["rope_parameters"]["mrope_section"] = [int(s) for s in text["rope_parameters"]["mrope_section"]]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, out_hidden_size=hidden, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_qwen_image_pipeline(words: list[str], sizes: TinyQwenImageSizes = TinyQwenImageSizes(), seed: int = 0):
    """A randomly initialised ``QwenImagePipeline`` for captions made of ``words``."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer(words)
    vae = AutoencoderKLQwenImage(base_dim=sizes.vae_dim, z_dim=sizes.latent_channels, dim_mult=[1, 1, 1, 1],
                                 num_res_blocks=1, temperal_downsample=[False, True, True],
                                 latents_mean=[0.1 * i for i in range(sizes.latent_channels)],
                                 latents_std=[1.0 + 0.1 * i for i in range(sizes.latent_channels)])
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * sizes.latent_channels, out_channels=sizes.latent_channels,
        num_layers=sizes.layers, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.text_hidden, axes_dims_rope=sizes.rope_axes)
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae,
                             text_encoder=_tiny_qwen25_vl(tokenizer, sizes.text_hidden, sizes.text_layers),
                             tokenizer=tokenizer, transformer=transformer)


def _tiny_qwen3(tokenizer, hidden: int, layers: int, causal_lm: bool):
    """A Qwen3 language model (``Qwen3ForCausalLM`` for FLUX.2 klein, ``Qwen3Model`` for Z-Image)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    vocab = tokenizer.get_vocab()
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=1024, pad_token_id=vocab["<|endoftext|>"],
                         eos_token_id=vocab["<|im_end|>"], bos_token_id=None, tie_word_embeddings=causal_lm)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)


@dataclass
class TinyFlux2Sizes:
    """Sizes of a small FLUX.2 klein pipeline. Defaults are test-sized (fast on one CPU core).

    The transformer sees the VAE's 2×2-patchified latents (4× its ``latent_channels``); its text
    input is three of Qwen3's hidden states concatenated (``text_out_layers``, klein: 9, 18, 27)."""

    image_size: int = 16
    vae_channels: tuple[int, ...] = (8, 16)  # len − 1 downsamplings by 2
    latent_channels: int = 8
    text_hidden: int = 16
    text_layers: int = 3
    text_out_layers: tuple[int, ...] = (1, 2, 3)
    layers: int = 1  # double-stream blocks
    single_layers: int = 1
    heads: int = 2
    head_dim: int = 16
    rope_axes: tuple[int, ...] = (4, 4, 4, 4)  # (T, H, W, L) coordinates; sums to head_dim


# FLUX.2 klein's scheduler_config.json (its σ shift is the pipeline's compute_empirical_mu)
FLUX2_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                   "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}


def build_tiny_flux2_klein_pipeline(words: list[str], sizes: TinyFlux2Sizes = TinyFlux2Sizes(), seed: int = 0,
                                    is_distilled: bool = False):
    """A randomly initialised ``Flux2KleinPipeline`` for captions made of ``words``: the base model's
    layout (true CFG against ""), or with ``is_distilled`` the step-distilled one (no CFG)."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer(words)
    channels = sizes.vae_channels
    vae = AutoencoderKLFlux2(latent_channels=sizes.latent_channels, block_out_channels=channels,
                             down_block_types=("DownEncoderBlock2D",) * len(channels),
                             up_block_types=("UpDecoderBlock2D",) * len(channels), layers_per_block=1,
                             norm_num_groups=min(channels[0], 8), sample_size=sizes.image_size)
    with torch.no_grad():  # the batch-norm statistics the pipeline normalises latents with: not the identity
        vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    transformer = Flux2Transformer2DModel(
        in_channels=4 * sizes.latent_channels, num_layers=sizes.layers, num_single_layers=sizes.single_layers,
        attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=len(sizes.text_out_layers) * sizes.text_hidden, timestep_guidance_channels=32,
        axes_dims_rope=sizes.rope_axes, guidance_embeds=False)
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                              text_encoder=_tiny_qwen3(tokenizer, sizes.text_hidden, sizes.text_layers, True),
                              tokenizer=tokenizer, transformer=transformer, is_distilled=is_distilled)


@dataclass
class TinyZImageSizes:
    """Sizes of a small Z-Image pipeline. Defaults are test-sized (fast on one CPU core)."""

    image_size: int = 16
    vae_channels: tuple[int, ...] = (8, 16)  # len − 1 downsamplings by 2
    latent_channels: int = 16  # as Z-Image's (FLUX.1's) VAE
    text_hidden: int = 16  # Qwen3; its second-to-last hidden states are the conditioning
    text_layers: int = 2
    dim: int = 32
    layers: int = 1
    refiner_layers: int = 1
    heads: int = 2
    rope_axes: tuple[int, int, int] = (4, 6, 6)  # sums to dim / heads


# Z-Image-Turbo's scheduler_config.json: a fixed shift 3 (its pipeline's calculate_shift mu is then unused)
Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def build_tiny_z_image_pipeline(words: list[str], sizes: TinyZImageSizes = TinyZImageSizes(), seed: int = 0):
    """A randomly initialised ``ZImagePipeline`` (Z-Image and its distilled Turbo share the layout)
    for captions made of ``words``."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from pipelines.tiny import _vae

    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer(words)
    vae = _vae(sizes.vae_channels, sizes.latent_channels, sizes.image_size, use_quant_conv=False,
               use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE factors
    transformer = ZImageTransformer2DModel(
        in_channels=sizes.latent_channels, dim=sizes.dim, n_layers=sizes.layers, n_refiner_layers=sizes.refiner_layers,
        n_heads=sizes.heads, n_kv_heads=sizes.heads, cap_feat_dim=sizes.text_hidden, axes_dims=list(sizes.rope_axes),
        axes_lens=[256, 64, 64])
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER), vae=vae,
                          text_encoder=_tiny_qwen3(tokenizer, sizes.text_hidden, sizes.text_layers, False),
                          tokenizer=tokenizer, transformer=transformer)


# Wan 2.2's published settings (the Wan-AI/Wan2.2-*-Diffusers model_index.json and scheduler configs)
WAN22_A14B_BOUNDARY = 0.875  # T2V-A14B: transformer (high noise) for t ≥ 875, transformer_2 below
WAN22_A14B_FLOW_SHIFT = 12.0  # T2V-A14B's sample shift
WAN22_TI2V_FLOW_SHIFT = 5.0  # TI2V-5B's


def build_tiny_wan22_pipeline(words: list[str], layout: str = "a14b", seed: int = 0):
    """A randomly initialised Wan 2.2 ``WanPipeline`` for captions made of ``words``: ``layout``
    "a14b" (two experts of Wan 2.1's tiny transformer, ``boundary_ratio`` 0.875, Wan 2.1's VAE) or
    "ti2v" (one transformer with per-token timesteps, ``expand_timesteps``, and the Wan 2.2 VAE: residual
    blocks, 2×2 patchified input, 16× spatial compression)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from pipelines.tiny import TinyWanSizes, _t5_config, build_t5_tokenizer

    if layout not in ("a14b", "ti2v"):
        raise ValueError(f"layout must be 'a14b' or 'ti2v', got {layout!r}")
    sizes = TinyWanSizes()
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(words)
    channels = sizes.latent_channels if layout == "a14b" else 8

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
            in_channels=channels, out_channels=channels, text_dim=sizes.text_hidden, freq_dim=32, ffn_dim=sizes.ffn_dim,
            num_layers=sizes.layers, rope_max_seq_len=32)

    if layout == "a14b":
        vae = AutoencoderKLWan(base_dim=sizes.vae_dim, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], is_residual=True, patch_size=2,
                               in_channels=12, out_channels=12,
                               scale_factor_spatial=16, latents_mean=[0.1 * i for i in range(channels)],
                               latents_std=[1.0 + 0.1 * i for i in range(channels)])
    shift = WAN22_A14B_FLOW_SHIFT if layout == "a14b" else WAN22_TI2V_FLOW_SHIFT
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                        num_train_timesteps=1000)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer, sizes.text_hidden, sizes.text_layers)))
    extra = ({"transformer_2": transformer(), "boundary_ratio": WAN22_A14B_BOUNDARY} if layout == "a14b"
             else {"expand_timesteps": True})
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer(), **extra)


def build_tiny_wan_i2v_pipeline(words: list[str], layout: str = "wan21", seed: int = 0):
    """A randomly initialised ``WanImageToVideoPipeline`` for captions made of ``words``: ``layout``
    "wan21" (Wan 2.1 I2V: a CLIP vision encoder whose features the transformer cross-attends) or
    "a14b" (Wan 2.2 I2V-A14B: two experts switched at boundary_ratio 0.9, no image encoder). The
    transformers take the latents, the first-frame mask and the image latents: 2C + 4 channels."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config,
                              UMT5EncoderModel)

    from pipelines.tiny import TinyWanSizes, _t5_config, build_t5_tokenizer

    if layout not in ("wan21", "a14b"):
        raise ValueError(f"layout must be 'wan21' or 'a14b', got {layout!r}")
    sizes = TinyWanSizes()
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(words)
    c = sizes.latent_channels
    image_dim = 16 if layout == "wan21" else None

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
            in_channels=2 * c + 4, out_channels=c, text_dim=sizes.text_hidden, freq_dim=32, ffn_dim=sizes.ffn_dim,
            num_layers=sizes.layers, rope_max_seq_len=32, image_dim=image_dim,
            added_kv_proj_dim=sizes.heads * sizes.head_dim if image_dim else None)

    vae = AutoencoderKLWan(base_dim=sizes.vae_dim, z_dim=c, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=sizes.flow_shift if layout == "wan21" else 5.0,
                                        num_train_timesteps=1000)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer, sizes.text_hidden, sizes.text_layers)))
    if layout == "wan21":
        encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=24, patch_size=8))
        processor = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
        extra = {"image_encoder": encoder, "image_processor": processor}
    else:  # Wan 2.2 I2V-A14B's model_index.json: boundary_ratio 0.9
        extra = {"transformer_2": transformer(), "boundary_ratio": 0.9}
    return WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                                   transformer=transformer(), **extra)


def build_tiny_qwen_image_edit_pipeline(words: list[str], sizes: TinyQwenImageSizes = TinyQwenImageSizes(),
                                        seed: int = 0, plus: bool = False):
    """A randomly initialised ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, several
    input images) for instructions made of ``words``: Qwen-Image's parts, and a ``Qwen2VLProcessor``
    whose image processor feeds the text encoder's vision tower at most 56 × 56 pixels per image (4
    image tokens; the real one allows far more)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    base = build_tiny_qwen_image_pipeline(words, sizes, seed)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 56 * 56}
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=base.tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**pixels),
                                 chat_template=base.tokenizer.chat_template)
    return (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(processor=processor, **base.components)
