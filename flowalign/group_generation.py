"""GDRO, phase 1: sample and score prompt groups once with the untrained model, through the epoch
sampler, and write them in the format of ``flowalign/offline.py`` (``flowalign generate-groups``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from safetensors.torch import save_file
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
