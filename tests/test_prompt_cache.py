"""The prompt-embedding cache: same conditioning as encoding, each prompt encoded once, LRU bound."""

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.trainer import Trainer
from pipelines.base import Conditioning, PromptEmbeddingCache


class CountingEncode:
    def __init__(self, adapter):
        self.adapter, self.calls = adapter, []
        self.encode = adapter.encode

    def __call__(self, prompts):
        self.calls.append(list(prompts))
        return self.encode(prompts)


def _equal(a, b):
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_cache_returns_what_encode_returns_and_encodes_each_prompt_once(tiny_adapter):
    counting = CountingEncode(tiny_adapter)
    tiny_adapter.encode = counting
    cache = PromptEmbeddingCache(tiny_adapter, size=8)
    prompts = ["a photo of a red circle", "a photo of a blue square", "a photo of a red circle"]
    first = cache(prompts)
    assert counting.calls == [prompts[:1], prompts[1:2]]  # the duplicate is encoded once
    again = cache(list(reversed(prompts)) + ["a photo of a triangle"])
    assert counting.calls[2:] == [["a photo of a triangle"]]
    direct = Conditioning.cat([counting.encode([p]) for p in list(reversed(prompts)) + ["a photo of a triangle"]])
    assert _equal(again, direct) and len(first) == 3
    assert torch.equal(first.tensors[next(iter(first.tensors))][0], first.tensors[next(iter(first.tensors))][2])


def test_least_recently_used_prompts_leave_first(tiny_adapter):
    counting = CountingEncode(tiny_adapter)
    tiny_adapter.encode = counting
    cache = PromptEmbeddingCache(tiny_adapter, size=2, offload=True)
    cache(["a"]), cache(["b"]), cache(["a"]), cache(["c"])  # "b" is now the oldest and leaves
    assert list(cache.entries) == ["a", "c"]
    cache(["a", "b"])
    assert counting.calls[-1] == ["b"]
    assert all(next(m.parameters()).device.type == "cpu" for m in cache.encoders) and len(cache.encoders) == 2
    with pytest.raises(ValueError, match="size"):
        PromptEmbeddingCache(tiny_adapter, size=0)


def test_trainer_caches_by_default_and_offloading_needs_a_cache(tiny_sd3_dir, tmp_path):
    base = [f"output_dir={tmp_path}", f"model.path={tiny_sd3_dir}", "tracker=none"]
    assert isinstance(Trainer(load_config(None, base)).encode, PromptEmbeddingCache)
    assert not isinstance(Trainer(load_config(None, [*base, "model.prompt_cache_size=0"])).encode, PromptEmbeddingCache)
    with pytest.raises(ConfigError, match="model.offload_text_encoders"):
        load_config(None, [*base, "model.prompt_cache_size=0", "model.offload_text_encoders=true"])
