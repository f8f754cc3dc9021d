"""Offline groups for GDRO: generate once with the reference model, train on them without sampling.

``flowalign generate-groups CONFIG`` writes ``data.offline_groups``::

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
import math
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from flowalign.config import ConfigError, RunConfig, to_dict


def generate_groups(config: RunConfig, groups: int) -> Path:
    """Sample ``groups`` prompt groups of ``train.group_size`` with the untrained policy (the
    reference: a fresh LoRA is the identity) and the config's sampler (the epoch sampler's flow
    rollouts, ``sampling.eta``: 0 is the ODE); score and save them."""
    if not config.data.offline_groups:
        raise ConfigError("config: data.offline_groups must name the folder to write the groups to")
    acc, sampler = _sampler(config)
    t = config.train
    out = Path(config.data.offline_groups)
    tmp = out.with_name(out.name + ".tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    chunks = math.ceil(groups / t.groups_per_epoch)
    start = time.time()
    k = t.group_size
    for chunk in tqdm(range(chunks), desc="groups", disable=not acc.is_main_process):
        batch = sampler.sample(0, "ode")
        g = len(batch.specs) // k
        tensors = {"samples": batch.traj.samples.reshape(g, k, *batch.traj.samples.shape[1:]).cpu().contiguous(),
                   "noise": batch.traj.latents[:, 0].reshape(g, k, *batch.traj.samples.shape[1:]).cpu().contiguous()}
        tensors.update({f"reward.{name}": v.reshape(g, k).contiguous() for name, v in batch.components.items()})
        name = f"part-r{acc.process_index}-{chunk:05d}"
        save_file(tensors, tmp / f"{name}.safetensors")
        records = [{key: v for key, v in batch.specs[i * k].items() if key != "group_id"} for i in range(g)]
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    acc.wait_for_everyone()
    if acc.is_main_process:
        index = {"groups": chunks * t.groups_per_epoch * acc.num_processes, "group_size": k,
                 "seconds": time.time() - start, "processes": acc.num_processes, "config": to_dict(config)}
        (tmp / "index.json").write_text(json.dumps(index, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    acc.wait_for_everyone()
    return out


def _sampler(config: RunConfig):
    """(Accelerator, EpochSampler) over the model a training run of ``config`` starts from."""
    from accelerate import Accelerator

    from flowalign.distributed import Distributed
    from flowalign.epoch_sampler import EpochSampler
    from flowalign.model_setup import build_model
    from flowalign.objectives.base import objective_class
    from flowalign.preflight import check_modality, check_reward_components, family_prediction, validate
    from flowalign.prompts import load_prompts
    from reward_models.base import build_reward

    validate(config)
    objective_cls = objective_class(config.method, config.model.family, family_prediction(config.model.family))
    acc = Accelerator(mixed_precision=config.train.mixed_precision, project_dir=config.output_dir)
    dist = Distributed(acc, config.train)
    specs = load_prompts(config.data.train_prompts)
    reward = build_reward(config.reward.name, **config.reward.kwargs)
    check_reward_components(config, reward)
    check_modality(config, reward, [])
    built = build_model(config, acc, objective_cls)
    return acc, EpochSampler(config, built.adapter, built.encode, reward, dist, specs)


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
