"""Processes, shards and random streams: who draws what, and the collectives the loop needs.

The global batch is drawn as ``train.rng_shards`` shards (default: one per process); each shard
owns generators for prompt choice, initial noise / SDE noise and minibatch shuffling, seeded by
(seed, shard), and a process rolls out its shards one after another. The step plan uses a
generator shared by all processes, so every process trains the same steps. One process with S
shards thus samples what S processes sample (tests/test_distributed.py). The generator states
are checkpointed per shard (``rng-shard{s}.safetensors``), so a resumed run continues them.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import DistributedType

from flowalign.config import ConfigError, TrainConfig

STREAMS = ("prompts", "noise", "shuffle")


def local_shards(shards: int, processes: int, rank: int, groups_per_epoch: int, train_batch_size: int) -> list[int]:
    """The shards process ``rank`` rolls out: a contiguous run, so gathering in rank order keeps
    the shard order. Raises ConfigError when the numbers do not divide."""
    if shards % processes:
        raise ConfigError(f"config: train.rng_shards ({shards}) must be a multiple of the number of processes "
                          f"({processes})")
    per_process = shards // processes
    for key, value in (("train.groups_per_epoch", groups_per_epoch), ("train.train_batch_size", train_batch_size)):
        if value % per_process:
            raise ConfigError(f"config: {key} ({value}) must be a multiple of the shards per process ({per_process})")
    return list(range(rank * per_process, (rank + 1) * per_process))


def shard_generators(seed: int, shard: int) -> dict[str, torch.Generator]:
    """A shard's streams: prompt choice, initial and SDE noise, minibatch shuffling. Shard r is
    seeded as rank r was before shards existed, so one-shard-per-process runs are unchanged."""
    return {name: torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + offset)
            for offset, name in enumerate(STREAMS)}


class Distributed:
    """This process's shards and streams, and the gathers and FSDP helpers over an Accelerator."""

    def __init__(self, accelerator, train: TrainConfig):
        self.accelerator = acc = accelerator
        self.train_batch_size = train.train_batch_size
        self.shards = local_shards(train.rng_shards or acc.num_processes, acc.num_processes, acc.process_index,
                                   train.groups_per_epoch, train.train_batch_size)
        self.streams = [shard_generators(train.seed, shard) for shard in self.shards]
        self.plan_generator = torch.Generator().manual_seed(train.seed * 1_000_003 + 104_729)  # shared by processes

    @property
    def device(self):
        return self.accelerator.device

    @property
    def total_shards(self) -> int:
        return len(self.shards) * self.accelerator.num_processes

    @property
    def sharded(self) -> bool:
        """Each process holds only a part of the weights or of the optimizer state."""
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    @property
    def fsdp(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP

    def full_params(self, model, writeback: bool = False):
        """Under FSDP, the full weights on every process for the block (sampling, evaluation and
        state dicts use the unwrapped model); a no-op otherwise. Every process must enter it."""
        if not self.fsdp:
            return contextlib.nullcontext()
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(model, writeback=writeback)

    def across_processes(self, values: list[float]) -> torch.Tensor:
        """float64 [P, K]: every process's ``values`` (one gather; float64 keeps logged floats exact)."""
        acc = self.accelerator
        local = torch.tensor([values], dtype=torch.float64, device=acc.device)
        return (acc.gather(local) if acc.num_processes > 1 else local).cpu()

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any of them."""
        return bool(self.across_processes([float(flag)]).any())

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated in rank order, on the CPU."""
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def mine(self, n: int) -> slice:
        """This process's part of a gathered batch of ``n`` samples per process."""
        rank = self.accelerator.process_index
        return slice(rank * n, (rank + 1) * n)

    def clip_parameters(self, model, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        # FSDP clips on its wrapper (a collective over the shards) only when given all its parameters
        return list(model.parameters()) if self.fsdp else params

    def minibatches(self, n: int, unit: int = 1) -> list[torch.Tensor]:
        """Index sets [train_batch_size] of one inner epoch: each shard shuffles its own samples
        (in blocks of ``unit``: whole groups where an objective needs them) with its own stream and
        minibatch k takes the k-th slice of every shard, so one process with S shards trains on the
        minibatches S processes together train on."""
        shards, size = len(self.streams), self.train_batch_size // len(self.streams)
        per_shard = n // shards
        order = torch.stack([(torch.randperm(per_shard // unit, generator=streams["shuffle"])[:, None] * unit
                              + torch.arange(unit)).flatten() + k * per_shard
                             for k, streams in enumerate(self.streams)])
        return [order[:, lo:lo + size].flatten().to(self.device) for lo in range(0, per_shard, size)]

    def check_backend(self, accumulation: int, train: TrainConfig) -> None:
        """FSDP and DeepSpeed: settings the loop needs (untested here: no GPU, docs/distributed.md)."""
        acc = self.accelerator
        if acc.distributed_type == DistributedType.FSDP:
            if acc.is_fsdp2:
                raise ConfigError("FSDP2 (fsdp_version: 2) is not supported by the trainer yet; use fsdp_version: 1 "
                                  "(configs/accelerate/fsdp.yaml)")
            if not acc.state.fsdp_plugin.use_orig_params:
                raise ConfigError("FSDP needs fsdp_use_orig_params: true (only a subset of the weights trains)")
            if train.ema_decay > 0:
                raise ConfigError("train.ema_decay > 0 is not supported under FSDP (the average would be of "
                                  "sharded weights); set it to 0")
        if acc.distributed_type == DistributedType.DEEPSPEED:
            ds = acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = train.train_batch_size  # no dataloader to read it from
            ds["gradient_accumulation_steps"] = accumulation
            if ds.get("gradient_clipping", "auto") == "auto":
                ds["gradient_clipping"] = train.max_grad_norm

    # -- checkpointed state: one file per shard -------------------------------------------
    def shard_state(self, k: int) -> dict[str, torch.Tensor]:
        return {**{name: g.get_state() for name, g in self.streams[k].items()}, "plan": self.plan_generator.get_state()}

    def load_shard_state(self, k: int, state: dict[str, torch.Tensor]) -> None:
        for name, g in self.streams[k].items():
            g.set_state(state[name])
        if k == 0:
            self.plan_generator.set_state(state["plan"])
