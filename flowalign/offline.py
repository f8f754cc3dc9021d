"""Offline groups for GDRO: the folder ``flowalign generate-groups`` writes (``flowalign/group_generation.py``)
and the epoch sampler's "offline" rollouts read (``load_groups``). ``data.offline_groups``::

    index.json                  groups, group_size, seconds, what generated them (model, sampler, seed)
    part-r{rank}-{n}.safetensors  samples [g, k, ...] (final latents), noise [g, k, ...] (initial
                                noise: the "seed" of each sample, exactly), reward.<name> [g, k]
    part-r{rank}-{n}.jsonl        one prompt record per group

The folder is written as ``<folder>.tmp`` and renamed when complete, so a killed generation never
leaves a dataset that looks whole. Rewards are stored per component; the weights are applied when
training reads them (``reward.weights`` can change without regenerating).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowalign.errors import ConfigError


def load_groups(folder: str | Path | None, group_size: int) -> dict:
    """Every group of a ``generate-groups`` folder: {"samples": [G, k, ...], "components":
    {name: [G, k]}, "specs": G records, "index": index.json}. Errors name the folder."""
    if not folder:
        raise ConfigError("config: method gdro trains on pre-generated groups: set data.offline_groups and run "
                          "`flowalign generate-groups CONFIG` first")
    folder = Path(folder)
    if not (folder / "index.json").is_file():
        raise ConfigError(f"config: data.offline_groups={folder} holds no index.json (write it with "
                          "`flowalign generate-groups CONFIG`)")
    index = json.loads((folder / "index.json").read_text())
    if index["group_size"] != group_size:
        raise ConfigError(f"config: train.group_size={group_size}, but {folder} holds groups of {index['group_size']}")
    samples, components, specs = [], {}, []
    for part in sorted(folder.glob("part-*.safetensors")):
        tensors = load_file(part)
        samples.append(tensors["samples"])
        for key, value in tensors.items():
            if key.startswith("reward."):
                components.setdefault(key[len("reward."):], []).append(value)
        specs += [json.loads(line) for line in part.with_suffix(".jsonl").read_text().splitlines() if line]
    return {"samples": torch.cat(samples), "components": {k: torch.cat(v) for k, v in components.items()},
            "specs": specs, "index": index}
