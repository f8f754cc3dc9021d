"""Offline builders for small real diffusers pipelines: no download, every part made in code.

Used by the tests (tiny random models) and by ``scripts/pretrain_shapes.py`` (the shipped demo
model is one of these, trained). The parts are the real classes a user's checkpoint uses:
``SD3Transformer2DModel``, ``AutoencoderKL``, two ``CLIPTextModelWithProjection`` with a
``CLIPTokenizer``, ``FlowMatchEulerDiscreteScheduler``; the T5 encoder is left out (SD3 allows
it: its slot is filled with zeros).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

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


def build_tiny_sd3_pipeline(words: list[str], sizes: TinySD3Sizes = TinySD3Sizes(), seed: int = 0) -> StableDiffusion3Pipeline:
    """A randomly initialised ``StableDiffusion3Pipeline`` for captions made of ``words``."""
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(words, sizes.max_prompt_tokens)
    vocab = tokenizer.get_vocab()

    def text_encoder():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=sizes.text_hidden, intermediate_size=4 * sizes.text_hidden,
            num_hidden_layers=sizes.text_layers, num_attention_heads=2, projection_dim=sizes.text_projection,
            max_position_embeddings=sizes.max_prompt_tokens, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
            pad_token_id=vocab[EOS],
        ))

    groups = min(sizes.vae_channels[0], 8)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=sizes.latent_channels,
        down_block_types=("DownEncoderBlock2D",) * len(sizes.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(sizes.vae_channels),
        block_out_channels=sizes.vae_channels, layers_per_block=1, norm_num_groups=groups,
        sample_size=sizes.image_size, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=1.0, shift_factor=0.0,
    )
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
        vae=vae, text_encoder=text_encoder(), tokenizer=tokenizer, text_encoder_2=text_encoder(),
        tokenizer_2=tokenizer, text_encoder_3=None, tokenizer_3=None,
    )
