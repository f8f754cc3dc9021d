"""Run configuration: YAML files validated into typed dataclasses, with ``key.sub=value`` overrides.

Every check happens before any model loads: an unknown key, a wrong type or a bad value raises
``ConfigError`` naming the key and the file (or the override that set it).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from flowalign.errors import ConfigError  # re-exported: every check raises it
from flowalign.hub import HubConfig  # the hub: section, defined beside what reads it
from flowalign.experimental.options import ExploreConfig, RoutingConfig
from flowalign.overrides import dotted_keys, numbers_as_floats, parse_override, set_path  # parse_override: re-exported
from flowalign.objectives.base import method_option_rules, method_options, option_owners  # loads the registry

from flowalign.domains import (CHOICES, COUNT, SEED, Annotated, above, at_least, between,  # the keys' domains
                               check_domains, finite)


@dataclass
class ModelConfig:
    family: str = "sd3"  # adapter family, see pipelines.FAMILIES
    path: str = "shapes-sd3"  # built-in demo name, local diffusers folder, or hub id
    dtype: str = "float32"  # weights of the frozen parts: float32 | bfloat16 | float16
    lora_rank: Annotated[int, at_least(0, "0 = full fine-tuning")] = 32  # 0 = full fine-tuning of the transformer
    lora_alpha: Annotated[Optional[float], above(0)] = None  # default: = rank
    lora_targets: Optional[list[str]] = None  # default: the attention projections
    # start from this LoRA instead of a random one: a run's final/ or checkpoint policy/ folder (diffusers'
    # pytorch_lora_weights.safetensors) or a peft adapter folder (adapter_config.json + adapter_model.safetensors);
    # its rank, alpha and targets replace lora_rank / lora_alpha / lora_targets (flowalign/model_setup.py)
    init_lora: Optional[str] = None
    # recompute each transformer block's activations in the backward pass (diffusers'
    # enable_gradient_checkpointing): less memory, more time (docs/memory.md measures both)
    gradient_checkpointing: bool = False
    # auto: xformers when it imports and the model is on CUDA, else PyTorch SDPA; sdpa; xformers; or a backend
    # of diffusers' attention dispatcher (flash, sage, _native_cudnn, ...; families whose attention goes through
    # it). One that cannot run falls back to sdpa with a one-line message. pipelines/attention.py
    attention: str = "auto"
    height: Annotated[Optional[int], above(0)] = None  # pixels; None: the pipeline's default size
    width: Annotated[Optional[int], above(0)] = None  # pixels; None: the pipeline's default size
    # video families (wan): frames per sample, 1 + a multiple of the VAE's temporal compression (Wan: 4k + 1);
    # None: the pipeline's default (Wan: 81). Rewards receive float [B, num_frames, 3, H, W] (reward_models/base.py)
    num_frames: Annotated[Optional[int], at_least(1)] = None
    # options of the family's adapter, checked by name and type before any weight loads
    # (pipelines.adapter_options), e.g. {max_sequence_length: 128} for sd3 / flux / wan, {true_cfg_scale: 4.0,
    # negative_prompt: "..."} for flux, {vae_tiling: true, vae_slicing: true} for any family with a VAE
    kwargs: dict[str, Any] = field(default_factory=dict)
    # prompt conditionings kept (LRU; 0 = encode every time): a fixed prompt set of at most this
    # many prompts is encoded once per run (pipelines.base.PromptEmbeddingCache)
    prompt_cache_size: Annotated[int, at_least(0, "0 = no cache")] = 1024
    # keep the frozen text encoders on the CPU, on the device only while encoding prompts the cache
    # lacks (needs prompt_cache_size > 0): frees their accelerator memory once the prompts are cached
    offload_text_encoders: bool = False
    # the model card's license (a hub license id, e.g. apache-2.0); None: the base model's when flowalign knows it
    # (flowalign/model_card.py: KNOWN_BASES, a built-in demo, the base folder's card), else "other" with a note
    license: Optional[str] = None


@dataclass
class SamplingConfig:
    num_steps: Annotated[int, at_least(2)] = 10  # denoising steps of a rollout
    eta: Annotated[float, at_least(0)] = 1.0  # SDE noise level of the trained steps
    # the stochastic step of velocity models: flow_grpo | cps | dance_grpo | dance_grpo_euler (DanceGRPO's
    # step without its score term, its code's sde_solver=False; flowalign.samplers.flow_sde);
    # ε-prediction models (sd, sdxl) always take the DDIM step
    sde: str = "flow_grpo"
    guidance_scale: Annotated[float, at_least(0)] = 1.0  # classifier-free guidance scale (1 = off; flux: dev's embedded guidance)
    step_mode: str = "all"  # all | fraction | window (flowalign.samplers.steps)
    fraction: Annotated[float, between(0, 1, low_open=True)] = 0.6  # step_mode fraction: the share of steps that are stochastic and trained
    window_size: Annotated[int, at_least(1)] = 2  # step_mode window: consecutive stochastic, trained steps
    window_start: Annotated[Optional[int], at_least(0)] = None  # None: random per rollout batch
    # [lo, hi]: a random window (window_start null) lies within steps lo..hi-1, Flow-GRPO's
    # sde_window_range (its CFG-free GenEval recipe: [0, num_steps // 2], the noisiest half); null: anywhere
    window_range: Annotated[Optional[list[int]], at_least(0)] = None
    # MixGRPO: > 0 slides the window window_stride steps later every window_shift_every epochs,
    # from window_start (or 0) on (flowalign.samplers.steps.sliding_window_start)
    window_shift_every: Annotated[int, at_least(0, "0 = no sliding window")] = 0
    window_stride: Annotated[int, at_least(1)] = 1  # steps the window moves each time it slides
    shared_group_noise: bool = False  # one initial noise per prompt group
    log_prob_reduction: str = "mean"  # mean | sum over latent elements
    # rollout steps whose log-prob no update rescores under torch.autocast on a merged LoRA (updates, evaluation:
    # as training); none; auto: bf16 where fast (AMX CPU, CUDA bf16), else none (docs/performance.md, "Sampling in bf16")
    autocast: str = "none"
    # masked discrete diffusion (model.family chess, pipelines/unmasking.py): how many
    # positions each of the num_steps steps unmasks (cosine | linear) and the sampling temperature
    # of the model's categoricals (training rescores at the same one); the log-prob is always the
    # sum over the newly unmasked positions, every step is stochastic and trained
    unmask_schedule: str = "cosine"
    temperature: Annotated[float, above(0)] = 1.0  # sampling temperature of masked diffusion's categoricals
    # chess: joint = the best move is unmasked at random steps with the board (what pre-training
    # masks); last = the steps unmask the board alone, then the move is chosen greedily at the
    # finished board (pipelines/chess.py), not a trained step
    move_schedule: str = "joint"


@dataclass
class DataConfig:
    # "shapes:<split>" (the built-in world: train | test | all), chess:<split>, av:<split>, a .txt / .jsonl /
    # .csv prompt file or a Hugging Face dataset (hf:PATH[:SPLIT]; flowalign/prompts.py). Relative paths in a
    # recipe are read from the recipe's folder, on the command line from the working directory
    train_prompts: str = "shapes:train"
    eval_prompts: str = "shapes:test"  # held-out prompts of every evaluation (same sources as train_prompts)
    # draw a category ("tag") uniformly, then a prompt in it; otherwise every prompt is equally likely
    balance_tags: bool = False
    # GDRO: the folder of pre-generated groups; `flowalign generate-groups` writes it, method=gdro reads it
    offline_groups: Optional[str] = None


@dataclass
class RewardConfig:
    name: str = "shapes"  # a registered reward (reward_models/, a plug-in, or register_reward in a script)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward's constructor arguments (checked)
    weights: Annotated[dict[str, float], finite()] = field(default_factory=lambda: {"score": 1.0})  # component → weight
    # deadline of one reward call (a batch), in seconds: a call still running then scores its batch
    # NaN (dropped and counted, like a remote server that is down); null = wait forever (flowalign/faults.py)
    timeout_s: Annotated[Optional[float], above(0, "null: no deadline")] = 120.0
    # a reward call that raises: raise (stop the run with one line naming the reward and the batch;
    # the last checkpoint is kept) | nan (score that batch NaN, say so in one line, go on)
    on_error: str = "raise"
    # several registered rewards trained together: {name: weight} or {name: {weight, kwargs, component}}; replaces
    # name / kwargs / weights (name becomes combined; each reward logged as reward/<name>; flowalign/reward_components.py)
    components: dict[str, Any] = field(default_factory=dict)


@dataclass
class _GeneralTrainConfig:
    epochs: Annotated[int, at_least(0)] = 60  # training epochs: sample → score → advantages → update
    max_minutes: Annotated[Optional[float], above(0, finite=False)] = None  # also stop (evaluated and saved as usual) after this much training time
    # also stop after this much training CPU time of this process (all its threads; evaluation excluded):
    # a budget that another job on the machine does not shrink, for benchmarks on shared cores
    max_cpu_minutes: Annotated[Optional[float], above(0, finite=False)] = None
    groups_per_epoch: Annotated[int, COUNT] = 8  # prompts per epoch per process
    group_size: Annotated[int, COUNT] = 8  # samples per prompt
    sample_batch_size: Annotated[int, COUNT] = 32  # rollout chunk
    train_batch_size: Annotated[int, COUNT] = 16  # samples per optimizer step
    inner_epochs: Annotated[int, COUNT] = 1  # passes over each epoch's samples
    learning_rate: Annotated[float, at_least(0)] = 3e-4  # AdamW learning rate (after warm-up)
    weight_decay: Annotated[float, at_least(0)] = 1e-4  # AdamW weight decay
    adam_betas: Annotated[list[float], between(0, 1, high_open=True, length=2)] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    max_grad_norm: Annotated[float, above(0)] = 1.0  # gradient-norm clipping of each optimizer step
    # adamw (torch) | adamw8bit (bitsandbytes' AdamW8bit: both moments in 8 bits, 2 bytes per weight instead of
    # 8, for full fine-tuning; pip install "flowalign[bnb]"; checked before any model loads)
    optimizer: str = "adamw"
    # CUDA only: float32 matmuls and convolutions in TF32 (torch.backends.cuda.matmul / cudnn allow_tf32),
    # faster on Ampere and later with a 10-bit mantissa; on CPU a no-op with a log line
    allow_tf32: bool = False
    # torch.compile of each denoiser (nn.Module.compile: in place, so weights and checkpoints keep their
    # names), for training and rollouts alike; the numbers match eager within float tolerance, not to the
    # last digit; the first steps pay the compilation (docs/performance.md: what it gives on CPU)
    compile: bool = False
    warmup_epochs: Annotated[int, at_least(0)] = 0  # epochs of linear learning-rate warm-up
    # constant (the warm-up, then constant) or a diffusers get_scheduler name: linear, cosine, cosine_with_restarts,
    # polynomial, constant_with_warmup; per epoch (flowalign/lr_schedule.py)
    lr_schedule: str = "constant"
    clip_range: Annotated[float, above(0)] = 1e-4  # PPO-style clip of the likelihood ratio: |ratio − 1| ≤ clip_range
    # CFG in the training forward (guidance_scale > 1): no gradient through the unconditional branch, as
    # Flow-GRPO's original train_sd3.py (its later scripts and ours by default train both branches); that
    # branch then runs as its own forward without a graph: a cheaper step (docs/performance.md)
    detach_uncond: bool = False
    kl_beta: Annotated[float, at_least(0)] = 0.0  # weight of the KL to the reference (untrained) policy; 0 = off
    advantage_clip: Annotated[float, above(0)] = 5.0  # advantages clipped to ±advantage_clip
    global_std: bool = False  # divide by the std over the whole batch instead of each group's
    # group: (r − group mean) / std (GRPO); leave_one_out: (r − mean of the group's other samples) / group
    # std (masked DDPO, flowalign/objectives/masked_ddpo.py)
    advantage_baseline: str = "group"
    # DanceGRPO: one advantage per weighted reward component, each with its own clipped objective
    per_reward_advantages: bool = False
    keep_extremes: Annotated[int, at_least(0)] = 0  # best-of-N: train only on each group's k best and k worst samples (0 = all)
    async_reward: bool = True  # score each sampling batch in a thread while the next one samples
    per_prompt_stats: bool = False  # DDPO-style per-prompt tracker instead of group statistics
    ema_decay: Annotated[float, between(0, 1, high_open=True, note="0 = off")] = 0.0  # 0 = off; evaluation uses the EMA weights when on
    # the EMA's warm-up (diffusers' EMAModel.get_decay): diffusers (min(decay, (1+n)/(10+n)), EMAModel's default)
    # | power (EMAModel's use_ema_warmup: 1 - (1+n)^(-2/3)) | none (a constant decay from the first step); flowalign/ema.py
    ema_warmup: str = "diffusers"
    # stop the run (an error, the last checkpoint kept) after this many consecutive epochs in which
    # every reward was NaN: a broken reward, not a bad batch; 0 = never stop
    max_nan_epochs: Annotated[int, at_least(0, "0 = never stop")] = 3
    mixed_precision: str = "no"  # no | fp16 | bf16 (Accelerate)
    seed: Annotated[int, SEED] = 0  # the run's seed: prompts, noise, LoRA init, shuffling (docs/distributed.md)
    # random streams: the global batch is drawn as this many shards, each with its own prompt, noise
    # and shuffling generators seeded by (seed, shard); a process rolls out its shards one after
    # another. Default (None): one shard per process. The same value on runs with different numbers
    # of processes (and the same global batch) makes them sample the same data (docs/distributed.md).
    rng_shards: Annotated[Optional[int], at_least(1)] = None


option_owners(method_options(), _GeneralTrainConfig)  # a name declared twice fails here, at import


@dataclass
class TrainConfig(*reversed(tuple(method_options())), _GeneralTrainConfig):
    """``train:``: the options above, then the methods' own (e.g. ``nft_beta``, ``gdro_tau``,
    ``noise_draws``, ``entropy_coef``), defined, documented and checked in their objective's file
    (the dataclasses its class names in ``options``) and joined here under the same keys. A
    method's options are valid only with that method (``method_option_rules``)."""


_TRAIN_CLASSES: dict[tuple[type, ...], type] = {}


def train_config_class() -> type:
    """``TrainConfig``, or a subclass of it joining the option dataclasses of objectives registered
    after this module was imported (so the order of registration does not matter)."""
    options = tuple(method_options())
    later = tuple(o for o in options if not issubclass(TrainConfig, o))
    if not later:
        return TrainConfig
    if later not in _TRAIN_CLASSES:
        option_owners(method_options(), _GeneralTrainConfig)
        _TRAIN_CLASSES[later] = dataclass(type("TrainConfig", (*reversed(later), TrainConfig),
                                               {"__doc__": TrainConfig.__doc__, "__module__": __name__}))
    return _TRAIN_CLASSES[later]


@dataclass
class EvalConfig:
    every: Annotated[int, at_least(0, "0 = only before and after")] = 10  # epochs; 0 = only before and after
    seeds: Annotated[int, COUNT] = 4  # samples per held-out prompt
    batch_size: Annotated[int, COUNT] = 64  # held-out samples per sampling batch
    grid_prompts: Annotated[int, COUNT] = 12  # rows (held-out prompts) of each evaluation grid
    grid_seeds: Annotated[int, COUNT] = 4  # columns (seeds) of each evaluation grid
    num_steps: Annotated[Optional[int], at_least(1)] = None  # ODE steps of the held-out samples; None: sampling.num_steps
    # rewards scored at every evaluation but never optimised (a reward-hacking check), e.g. [jpeg_compressibility]
    extra_rewards: list[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    """``wandb:``: the W&B run when ``tracker: wandb`` (``wandb.init``'s arguments; flowalign/outputs.py)."""

    project: Optional[str] = None  # None: the name of output_dir
    entity: Optional[str] = None  # team or user; None: W&B's default entity
    name: Optional[str] = None  # the run's display name; None: W&B's generated one
    tags: list[str] = field(default_factory=list)  # W&B tags of the run


@dataclass
class RunConfig:
    output_dir: str = "runs/shapes-flow-grpo"  # the run's folder: checkpoints, grids, metrics.json, final/
    method: str = "flow_grpo"  # flow_grpo | dance_grpo | ddpo | diffusion_nft | gdro (flowalign/objectives/)
    # tensorboard | wandb | none, or another Accelerate tracker (aim, trackio, comet_ml, mlflow, clearml, dvclive,
    # swanlab): metrics every epoch; TensorBoard and W&B also get the evaluation and training-sample grids as images.
    # A tracker's package must import (refused before any model loads otherwise); wandb reads the wandb: section
    tracker: str = "tensorboard"
    # every this many epochs (0 = never) a grid of the epoch's first tracker_samples rollouts, each captioned with
    # its prompt and reward, goes to the tracker as the image train/samples (flowalign/sample_log.py)
    tracker_samples_every: Annotated[int, at_least(0, "0 = never")] = 10
    tracker_samples: Annotated[int, COUNT] = 16  # rollouts in that grid (this process's first, in group order)
    # torch CPU threads of each process, set when the run starts. Floating-point sums are split across
    # threads, so the numbers of a run depend on this count (and on torch's version and the CPU's
    # instruction set, both recorded in metrics.json), never on what else runs on the machine.
    # 1 by default: on the 2-core machine the demo was built on, a second thread made its epochs 2.1x
    # faster when the machine was free but 3.7x slower beside one CPU-bound job (threads wait on a
    # descheduled one), where one thread lost nothing (scripts/benchmark_busy_machine.py, README).
    # 0 = torch's own default (one per core: results then differ between machines).
    threads: Annotated[int, at_least(0, "0 = torch's default")] = 1
    checkpoint_every: Annotated[int, at_least(0, "0 = only at the end")] = 10  # epochs; 0 = only at the end
    checkpoints_kept: Annotated[int, at_least(0, "0 = keep every one")] = 2  # checkpoints kept in output_dir/checkpoints; 0 = keep every one
    resume: Optional[str] = None  # "auto" (latest in output_dir), a checkpoint folder, or None
    overwrite: bool = False  # start afresh in an output_dir holding another run: its outputs are deleted first
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=lambda: train_config_class()())
    eval: EvalConfig = field(default_factory=EvalConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    # where each value came from (load_config): {"file", "overrides": [(key, text)], "keys": keys the
    # file or an override set}; read by source_of. Not a setting: no file or override can set it.
    sources: Optional[dict] = field(default=None, repr=False, compare=False, metadata={"internal": True})


def settings(cls) -> list[dataclasses.Field]:
    """The fields of a config dataclass a file can set (``sources`` is not one)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str, where: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted as floats."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, where)
    if tp is Any:
        return value
    if tp is TrainConfig:
        tp = train_config_class()
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a mapping of settings, got {value!r}")
        return _build(tp, value, key, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a mapping, got {type(value).__name__} {value!r}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}", where) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{where}: {key} must be a number, got NaN")
    if tp is bool and not isinstance(value, bool) or tp in (int, float) and isinstance(value, bool) \
            or not isinstance(value, tp):
        raise ConfigError(f"{where}: {key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, values: dict, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in settings(cls)]
    kwargs = {}
    for key, value in values.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {full!r}{hint}; valid keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], full, where)
        if full in CHOICES and kwargs[key] not in CHOICES[full]:
            raise ConfigError(f"{where}: {full} must be one of {', '.join(CHOICES[full])}, got {kwargs[key]!r}")
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML file (optional; a path, or a built-in recipe's name: flowalign/recipes.py), apply
    ``key=value`` overrides, validate. Raises ConfigError. Relative prompt paths in the file are read
    from the file's folder (flowalign.prompts.resolve_source); those of overrides from the working
    directory."""
    from flowalign.recipes import find_recipe, read_recipe

    tree: dict = {}
    where = "defaults"
    if path is not None:
        path = find_recipe(path)
        where = str(path)
        loaded = read_recipe(path)  # a mapping with at least one setting (flowalign/recipes.py)
        tree = numbers_as_floats(loaded)
        _resolve_prompt_paths(tree, path.parent)
    config = _build(RunConfig, tree, "", where)  # the file alone must be valid
    set_by = []
    for text in overrides:
        key, value = parse_override(text)
        tree = copy.deepcopy(tree)
        set_path(tree, key, value)  # replaces the value at key, a mapping included
        config = _build(RunConfig, tree, "", f"override {text!r}")
        set_by.append((key, f"override {text!r}"))
    config.sources = {"file": where, "overrides": set_by, "keys": set(dotted_keys(tree))}
    check_values(config, where)
    return config


def _resolve_prompt_paths(tree: dict, folder: Path) -> None:
    """``data.train_prompts`` / ``data.eval_prompts`` of a recipe, relative to its ``folder``."""
    from flowalign.prompts import resolve_source

    data = tree.get("data")
    if not isinstance(data, dict):
        return  # _build names the problem
    for key in ("train_prompts", "eval_prompts"):
        if isinstance(data.get(key), str):
            data[key] = resolve_source(data[key], folder)


def source_of(config: RunConfig, key: str, default: str = "config") -> str:
    """Where ``key``'s value came from: the last override that set it (or a section holding it, or
    a key inside it), else the YAML file; ``default`` for a config not made by ``load_config``."""
    sources = config.sources
    if sources is None:
        return default
    for set_key, text in reversed(sources["overrides"]):
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
            return text
    return sources["file"]


def check_types(config: RunConfig, where: str = "RunConfig") -> None:
    """A config built in Python (``RunConfig(train=TrainConfig(epochs=2), ...)``) checked as a YAML
    file is: every section the dataclass it names, every value of its annotated type, every choice
    one of CHOICES. Raises ConfigError naming the key."""
    if not isinstance(config, RunConfig):
        raise ConfigError(f"{where}: expected a RunConfig (flowalign.load_config or RunConfig(...)), "
                          f"got {type(config).__name__}")
    hints = typing.get_type_hints(RunConfig)
    for f in settings(RunConfig):
        section = hints[f.name]
        if dataclasses.is_dataclass(section) and not isinstance(getattr(config, f.name), section):
            raise ConfigError(f"{where}: {f.name} must be a {section.__name__} (flowalign.config), got "
                              f"{type(getattr(config, f.name)).__name__}")
    _build(RunConfig, to_dict(config), "", where)


def check_values(config: RunConfig, where: str = "config") -> None:
    """Types (``check_types``: a config built in Python gets the checks of a file), then cross-field
    checks that types alone cannot express. A failure names the key and where its value came from
    (``source_of``: the override that set it, else ``where``)."""
    check_types(config, where if config.sources is not None else "RunConfig")
    from flowalign.reward_components import expand

    expand(config, where)  # reward.components → reward.name combined, its kwargs and weights
    t, s, e = config.train, config.sampling, config.eval
    rules = [
        ("checkpoint_every", config.checkpoint_every >= 0, "must be ≥ 0 (0 = only at the end)"),
        ("checkpoints_kept", config.checkpoints_kept >= 0, "must be ≥ 0 (0 = keep every checkpoint)"),
        ("eval.every", e.every >= 0, "must be ≥ 0 (0 = only before and after)"),
        ("eval.seeds", e.seeds >= 1, "must be ≥ 1"),
        ("eval.batch_size", e.batch_size >= 1, "must be ≥ 1"),
        ("eval.grid_prompts", e.grid_prompts >= 1, "must be ≥ 1"),
        ("eval.grid_seeds", e.grid_seeds >= 1, "must be ≥ 1"),
        ("train.inner_epochs", t.inner_epochs >= 1, "must be ≥ 1 (0 would train nothing)"),
        ("train.learning_rate", math.isfinite(t.learning_rate) and t.learning_rate >= 0,
         "must be a finite number ≥ 0"),
        ("train.max_nan_epochs", t.max_nan_epochs >= 0, "must be ≥ 0 (0 = never stop)"),
        ("train.max_cpu_minutes", t.max_cpu_minutes is None or t.max_cpu_minutes > 0, "must be > 0 (or null)"),
        ("reward.timeout_s", config.reward.timeout_s is None or config.reward.timeout_s > 0,
         "must be > 0 seconds (or null: no deadline)"),
        ("train.group_size", t.group_size >= 2 or t.per_prompt_stats, "must be ≥ 2 for group advantages"),
        ("train.groups_per_epoch", t.groups_per_epoch >= 1, "must be ≥ 1"),
        ("train.train_batch_size", 1 <= t.train_batch_size <= t.groups_per_epoch * t.group_size,
         "must be between 1 and groups_per_epoch × group_size"),
        ("train.sample_batch_size", t.sample_batch_size >= 1, "must be ≥ 1"),
        ("train.epochs", t.epochs >= 0, "must be ≥ 0"),
        ("threads", config.threads >= 0, "must be ≥ 0 (0 = torch's default: one per core)"),
        ("train.clip_range", t.clip_range > 0, "must be > 0"),
        ("train.ema_decay", 0 <= t.ema_decay < 1, "must be in [0, 1)"),
        ("train.rng_shards", t.rng_shards is None or t.rng_shards >= 1, "must be ≥ 1 (or null: one per process)"),
        ("sampling.num_steps", s.num_steps >= 2, "must be ≥ 2 (the last step is never trained)"),
        ("eval.num_steps", config.eval.num_steps is None or config.eval.num_steps >= 1, "must be ≥ 1 (or null)"),
        ("sampling.eta", s.eta >= 0, "must be ≥ 0"),
        ("model.prompt_cache_size", config.model.prompt_cache_size >= 0, "must be ≥ 0 (0 = no cache)"),
        ("model.offload_text_encoders", not config.model.offload_text_encoders or config.model.prompt_cache_size > 0,
         "needs model.prompt_cache_size > 0 (without a cache every step would move the encoders)"),
        ("sampling.window_shift_every", s.window_shift_every >= 0, "must be ≥ 0 (0 = no sliding window)"),
        ("sampling.window_stride", s.window_stride >= 1, "must be ≥ 1"),
        ("sampling.window_range", s.window_range is None or (
            len(s.window_range) == 2 and 0 <= s.window_range[0]
            and s.window_range[0] + s.window_size <= s.window_range[1] <= s.num_steps - 1),
         f"must be [lo, hi] with 0 ≤ lo, lo + window_size ≤ hi ≤ num_steps − 1 = {s.num_steps - 1}"),
        ("sampling.window_range", s.window_range is None or (s.step_mode == "window" and s.window_start is None
                                                             and not s.window_shift_every),
         "places a random window: needs step_mode window, no window_start and no sliding window"),
        ("train.keep_extremes", t.keep_extremes >= 0 and 2 * t.keep_extremes <= t.group_size,
         "must be between 0 and group_size / 2"),
        ("train.per_reward_advantages", not (t.per_reward_advantages and t.per_prompt_stats),
         "cannot be combined with train.per_prompt_stats"),
        ("model.lora_rank", config.model.lora_rank >= 0, "must be ≥ 0 (0 = full fine-tuning)"),
        ("model.init_lora", config.model.init_lora is None or config.model.lora_rank > 0,
         "needs model.lora_rank > 0 (a LoRA to start from; lora_rank 0 is full fine-tuning)"),
        ("sampling.temperature", s.temperature > 0, "must be > 0"),
        ("train.advantage_baseline", t.advantage_baseline == "group" or not (t.per_prompt_stats or t.global_std),
         "leave_one_out cannot be combined with train.per_prompt_stats or train.global_std"),
        ("sampling.autocast", s.autocast == "none" or t.mixed_precision == "no", f"must be none under "
         f"train.mixed_precision {t.mixed_precision}: Accelerate already runs every forward at that precision"),
    ]
    from flowalign import experimental
    from flowalign.objectives.base import OBJECTIVES, methods
    from flowalign.rollout import AUTOCAST_REFUSAL, autocast_applies

    if config.method not in methods():
        raise ConfigError(f"{source_of(config, 'method', where)}: method must be one of {', '.join(methods())}, got {config.method!r}")
    rules += method_option_rules(config, option_owners(method_options(), _GeneralTrainConfig))
    rules.append(("sampling.autocast", s.autocast == "none" or any(
        autocast_applies(cls, config) for cls in OBJECTIVES[config.method]), AUTOCAST_REFUSAL.format(config.method)))
    for cls in OBJECTIVES[config.method]:  # each method's own rules, then the experimental extras'
        rules += cls.validate(config)
    rules += experimental.rules(config)
    for key, ok, message in rules:
        if not ok:
            raise ConfigError(f"{source_of(config, key, where)}: {key} {message}")
    check_domains(config, lambda key: source_of(config, key, where))  # every key's own domain (flowalign/domains.py)


def to_dict(config) -> dict:
    """The settings as plain data (``sources`` left out; of the methods' ``train.*`` options only the
    selected method's, so that the result loads back as a valid recipe)."""
    out = {f.name: dataclasses.asdict(getattr(config, f.name)) if dataclasses.is_dataclass(getattr(config, f.name))
           else copy.deepcopy(getattr(config, f.name)) for f in settings(config)}
    owners = option_owners(method_options(), _GeneralTrainConfig)
    out["train"] = {k: v for k, v in out["train"].items()
                    if owners.get(k, "general") == "general" or config.method in owners[k].split(", ")}
    return out
