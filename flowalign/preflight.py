"""Everything about a run that can be checked, and said, without loading or downloading a weight.

``validate(config)`` is what ``Trainer`` runs first and what ``flowalign train RECIPE --dry-run``
runs alone: the family exists and fits the method, ``model.kwargs`` are options its adapter takes,
the reward and the extra evaluation rewards are registered and take the given ``reward.kwargs``,
``reward.weights`` name components the reward returns. ``dry_run(config)`` adds what the run would
load (hub id or folder, components, LoRA or full, dtypes, attention, rewards and their weights,
prompt sets, derived batch totals) and the inputs missing on this machine, as text.

Nothing here calls ``from_pretrained`` or the network: a hub id is only looked up in the local
Hugging Face cache (``huggingface_hub.try_to_load_from_cache``), and rewards are inspected by their
constructor signatures, never built.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import torch

from flowalign.arguments import check_kinds
from flowalign.run_folder import check_ownership
from flowalign.untrusted import check_model_folder
from flowalign.config import ConfigError, RunConfig, check_values, source_of

def family_prediction(family: str) -> str | None:
    """The ``prediction`` of a family's adapter class (None for an unknown family: the error comes
    when the adapter is looked up)."""
    from pipelines import adapter_class

    try:
        return adapter_class(family).prediction
    except KeyError:
        return None


def check_objective(config: RunConfig, prediction: str):
    """The objective class of ``method`` for a family of ``prediction`` (ConfigError naming both
    when there is none), checked against the family's rules and the objective's contract: per-reward
    advantages only for an objective that takes them."""
    from flowalign.objectives.base import check, objective_class

    try:
        objective = objective_class(config.method, config.model.family, prediction)
    except ConfigError as error:  # name the override that set the method, when one did
        raise ConfigError(f"{source_of(config, 'method')}:{str(error).split(':', 1)[1]}") from None
    check(objective.validate_family(config), config=config)
    if config.train.per_reward_advantages and not objective.per_reward_advantages:
        raise ConfigError(f"{source_of(config, 'train.per_reward_advantages')}: train.per_reward_advantages: method "
                          f"{config.method!r} ({objective.__name__}) takes one advantage per sample, not one per "
                          f"reward; set it to false")
    return objective


def adapter_for(config: RunConfig):
    """The adapter class of ``model.family`` (ConfigError for an unknown family)."""
    from pipelines import FAMILIES, adapter_class

    if config.model.family not in FAMILIES:
        raise ConfigError(f"{source_of(config, 'model.family')}: model.family: unknown model family "
                          f"{config.model.family!r}; available: {', '.join(sorted(FAMILIES))}")
    return adapter_class(config.model.family)


def check_model(config: RunConfig):
    """Family, method, adapter options and switches; returns the adapter class."""
    from pipelines import check_adapter_options, check_folder_family

    m = config.model
    cls = adapter_for(config)
    try:
        check_folder_family(m.family, m.path)
    except ValueError as error:
        raise ConfigError(f"{source_of(config, 'model.family')}: model.family: {error}") from None
    prediction = cls.prediction
    check_objective(config, prediction)
    for key, value in m.kwargs.items():
        try:
            check_adapter_options(m.family, {key: value})
        except ValueError as error:
            raise ConfigError(f"{source_of(config, 'model.kwargs.' + key)}: model.kwargs.{key}: {error}") from None
    if m.gradient_checkpointing and not cls.supports_gradient_checkpointing:
        raise ConfigError(f"{source_of(config, 'model.gradient_checkpointing')}: model.gradient_checkpointing is not "
                          f"supported by the {m.family!r} family; set it to false")
    if config.sampling.move_schedule != "joint" and config.sampling.move_schedule not in cls.move_schedules:
        raise ConfigError(f"{source_of(config, 'sampling.move_schedule')}: sampling.move_schedule "
                          f"{config.sampling.move_schedule!r} needs a model with a best move (family chess); the "
                          f"{m.family!r} family has none: remove it")
    if config.explore.mode != "none" and prediction != "velocity":  # the explorer hook checks it again, loaded
        raise ConfigError(f"{source_of(config, 'explore.mode')}: explore.mode needs a flow model (its SDE steps); DDIM "
                          "has no exploration net")
    return cls


def reward_factory(name: str, key: str, where: str = "config"):
    """The registered factory of reward ``name`` (ConfigError naming ``key`` and ``where`` it was set
    when unknown, or when its optional package is not installed: the message has the pip line)."""
    from reward_models.base import MissingRewardPackage, available_rewards
    from reward_models.base import reward_factory as lookup

    try:
        return lookup(name)  # imports only this reward's module (or plug-in)
    except KeyError:
        raise ConfigError(f"{where}: {key}: unknown reward {name!r}; available: {', '.join(available_rewards())}") \
            from None
    except MissingRewardPackage as error:
        raise ConfigError(f"{where}: {key}: {error}") from None


def reward_arguments(factory, kwargs: dict, name: str, key: str,
                     where: str = "config") -> dict[str, tuple[object, bool]]:
    """``kwargs`` checked against the factory's signature → every argument: (value, given). A
    factory taking ``**kwargs`` accepts any name."""
    parameters = dict(inspect.signature(factory).parameters)
    parameters.pop("self", None)
    open_ended = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    named = {n: p for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for arg in kwargs:
        if arg not in named and not open_ended:
            raise ConfigError(f"{where}: {key}.{arg}: reward {name!r} takes no argument {arg!r}; it accepts: "
                              f"{', '.join(named) or 'none'}")
    check_kinds({n: p.default for n, p in named.items()}, kwargs, f"{where}: {key}", f"reward {name!r}")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ConfigError(f"{where}: {key}.{missing[0]}: reward {name!r} needs it (no default)")
    values = {n: (p.default, False) for n, p in named.items()}
    values.update({n: (v, True) for n, v in kwargs.items()})
    return values


def check_rewards(config: RunConfig, adapter_cls=None, given: bool = False) -> None:
    """The reward, its arguments and weights, the extra evaluation rewards; for a video family, no
    image-only reward (the trainer's own modality check, on the reward classes). ``given``: the
    reward is an object passed in Python (``flowalign.train(reward=...)``): only the extras are looked up."""
    r = config.reward
    factory = None
    if not given:
        if r.components:
            from flowalign.reward_components import check

            check(config)  # each component a registered reward with its own kwargs
        factory = reward_factory(r.name, "reward.name", source_of(config, "reward.name"))
        reward_arguments(factory, r.kwargs, r.name, "reward.kwargs", source_of(config, "reward.kwargs"))
        declared = getattr(factory, "components", ()) if isinstance(factory, type) else ()
        unknown = sorted(set(r.weights) - set(declared)) if declared else []
        if unknown:
            raise ConfigError(f"{source_of(config, 'reward.weights')}: reward.weights names {unknown}, but reward "
                              f"{r.name!r} returns {list(declared)}")
    extras = []
    for i, name in enumerate(config.eval.extra_rewards):
        extra = reward_factory(name, f"eval.extra_rewards[{i}]", source_of(config, "eval.extra_rewards"))
        reward_arguments(extra, {}, name, f"eval.extra_rewards[{i}] (no options can be given)")
        extras.append(extra)
    if adapter_cls is not None:
        # the trainer's check reads ``modality`` off the built rewards; a class carries the same attribute
        check_modality(config, factory, extras)


def check_reward_components(config: RunConfig, reward) -> None:
    """``reward.weights`` names only components the built reward declares (undeclared: any)."""
    declared = getattr(reward, "components", ())
    unknown = sorted(set(config.reward.weights) - set(declared)) if declared else []
    if unknown:
        raise ConfigError(f"config: reward.weights names {unknown}, but reward {config.reward.name!r} "
                          f"returns {list(declared)}")


def check_modality(config: RunConfig, reward, extra_rewards) -> None:
    """The model's output (the adapter class's ``modality``: image, video, audio_video) against
    ``model.num_frames`` (video and audio_video families only) and against each reward's declared
    ``modality`` (undeclared: accepted), before the model loads. An image reward on a video family
    is pointed to the per-frame wrapper that scores it on every frame."""
    from pipelines import adapter_class

    cfg = config
    made = adapter_class(cfg.model.family).modality
    if cfg.model.num_frames is not None and made == "image":
        raise ConfigError(f"config: model.num_frames is for video and audio-video families (wan, ltx2, "
                          f"av_demo); {cfg.model.family!r} makes single images: remove it")
    rewards = [("reward.name", cfg.reward.name, reward),
               *(("eval.extra_rewards", n, r) for n, r in zip(cfg.eval.extra_rewards, extra_rewards))]
    for key, name, reward in rewards:
        scores = getattr(reward, "modality", None)
        if scores is None or scores == made:
            continue
        hint = ""
        if scores == "image" and made == "video":
            hint = (f": score every frame with reward.name=per_frame and reward.kwargs={{reward: {name}}} "
                    "(reward_models/video.py)" if key == "reward.name" else
                    " (an extra reward takes no options, so it cannot be wrapped in per_frame: name a video reward)")
        label = f"reward {name!r}" if key == "reward.name" else f"eval.extra_rewards: {name!r}"
        raise ConfigError(f"config: {label} scores {scores.replace('_', '-')}s, model family "
                          f"{cfg.model.family!r} makes {made.replace('_', '-')}s{hint}")


def check_loaded_adapter(config: RunConfig, adapter, objective_cls) -> None:
    """What only the loaded adapter tells: its prediction fits the method, and a model that samples
    in an order only ODE rollouts follow (``pipelines.base.SamplingOrder``) is trained by an
    objective with ODE rollouts at η = 0."""
    from pipelines.base import ode_only

    m = config.model
    check_objective(config, adapter.prediction)
    if ode_only(adapter) and (objective_cls.rollout != "ode" or config.sampling.eta > 0):
        raise ConfigError(f"config: this {m.family} model samples video-first (its pipeline's sampling_order), "
                          f"which only DiffusionNFT with ODE rollouts trains (sampling.eta: 0); got method "
                          f"{config.method!r}, sampling.eta {config.sampling.eta}: use method: diffusion_nft "
                          f"with sampling.eta=0, or a model with sampling_order joint")
    from flowalign.rollout import AUTOCAST_REFUSAL, autocast_applies

    if config.sampling.autocast != "none" and not autocast_applies(objective_cls, config):
        raise ConfigError(f"{source_of(config, 'sampling.autocast')}: sampling.autocast "
                          f"{AUTOCAST_REFUSAL.format(f'{config.method} on model family {m.family!r}')}")
    for key, used, supported, seam in (
            ("detach_uncond", config.train.detach_uncond, adapter.detach_uncond_supported, "uncond_branch"),
            ("reuse_rollout_uncond", objective_cls.keeps_uncond(config), adapter.rollout_uncond_supported, "guided")):
        if used and not supported:
            raise ConfigError(f"{source_of(config, 'train.' + key)}: train.{key} is not supported by model family "
                              f"{m.family!r} (its guidance does not go through DenoiserAdapter.{seam}): set it to false")


def check_prompt_sets(config: RunConfig, missing_ok: bool = False, given=()) -> None:
    """``data.train_prompts`` and ``data.eval_prompts`` read (split names, file type, every JSON
    line) and hold at least one prompt; ``missing_ok``: a file absent on this machine passes (the
    dry run lists it as missing); ``given``: keys whose prompts were passed in Python (not read)."""
    from flowalign.prompts import load_prompts

    for key in ("data.train_prompts", "data.eval_prompts"):
        if key in given:
            continue
        source = getattr(config.data, key.split(".")[1])
        where = source_of(config, key)
        kind, _, split = source.partition(":")
        if kind == "chess" and split.split(":")[0] in ("train", "test"):
            continue  # the chess splits are read from the model folder and puzzle file: seconds, at load time
        try:
            records = load_prompts(source)
        except (ValueError, OSError) as error:  # a bad split, type or JSON line; a missing file
            if missing_ok and isinstance(error, FileNotFoundError) and not Path(source).expanduser().exists():
                continue  # the prompt file itself is not here (a conditioning image it names is)
            named = "" if Path(source).name in str(error) else f" {source}"  # a file's errors name it
            raise ConfigError(f"{where}: {key}{named}: {error}") from None
        if not any(str(r["prompt"]).strip() for r in records):
            raise ConfigError(f"{where}: {key}: {source} holds no prompts (empty, or blank lines only)")


def check_output_dir(config: RunConfig) -> None:
    """``output_dir`` is, or can become, a folder: neither it nor a folder above it is a file."""
    out = Path(config.output_dir).expanduser()
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{source_of(config, 'output_dir')}: output_dir: {blocking} is a file, not a folder; "
                          "name a folder (it is created when missing)")
    check_ownership(config, source_of(config, "output_dir"))  # a finished or started run there: resume or overwrite


def validate(config: RunConfig, missing_ok: bool = False, given=()) -> None:
    """Every check that needs no weights (raises ConfigError, or ModelNotFoundError for a missing
    local model folder or a name that is neither a built-in demo model nor a hub id).
    ``missing_ok``: prompt files absent on this machine pass (the dry run reports them). ``given``:
    what was passed as Python objects instead of names (``flowalign.train``): any of "reward",
    "data.train_prompts", "data.eval_prompts", "model" (a loaded adapter), not looked up here."""
    from pipelines.base import ModelNotFoundError, resolve_model_path

    from flowalign.outputs import check_launch_precision, check_tracker

    check_values(config)
    m = config.model
    if "model" not in given:  # a local folder's index, configs and weight headers; sizes it can make
        check_model_folder(m.path, f"{source_of(config, 'model.path')}: model.path", (m.height, m.width))
    check_tracker(config)
    check_launch_precision(config)
    cls = check_model(config)
    check_rewards(config, cls, given="reward" in given)
    check_prompt_sets(config, missing_ok, given)
    check_output_dir(config)
    from flowalign.model_setup import check_setup  # here: model_setup imports this module

    check_setup(config)  # model.init_lora's folder, train.optimizer's bitsandbytes
    if "model" in given:
        return
    try:
        resolve_model_path(config.model.path)  # a hub id passes; its download is tried when the model loads
    except ModelNotFoundError as error:
        raise ModelNotFoundError(f"{source_of(config, 'model.path')}: model.path: {error}") from None


# -- the dry run ----------------------------------------------------------------------------
def dry_run(config: RunConfig, recipe: str | None = None) -> str:
    """Validate ``config`` and say what training it would load and do (text, one fact a line)."""
    from flowalign.inputs import check_inputs
    from flowalign.memory_estimate import lines as memory_lines
    validate(config, missing_ok=True)
    cls = adapter_for(config)
    warnings: list[str] = []
    lines = [("recipe", recipe or "(defaults)"), ("method", _method_text(config, cls))]
    lines += _model_lines(config, cls, warnings)
    lines += memory_lines(config, cls)  # parameters, memory estimate, download, license (flowalign/memory_estimate.py)
    lines += _reward_lines(config, warnings)
    lines += _data_lines(config, warnings)
    lines += _batch_lines(config, cls)
    lines.append(("output", f"{config.output_dir} (checkpoints every {config.checkpoint_every or 'end'} "
                            f"epochs, {config.checkpoints_kept} kept; tracker {config.tracker})"))
    width = max(len(k) for k, _ in lines)
    out = [f"dry run: {recipe or 'the configuration'} is valid; nothing was downloaded or loaded"]
    out += [f"  {k.ljust(width)}  {v}" for k, v in lines]
    out += [f"  warning: {w}" for w in warnings]
    check_inputs(config, "\n".join(out))  # a file the run reads is missing: exit 2 after the report (flowalign/inputs.py)
    return "\n".join(out)


def _objective(config: RunConfig, cls):
    from flowalign.objectives.base import objective_class

    return objective_class(config.method, config.model.family, cls.prediction)


def _method_text(config: RunConfig, cls) -> str:
    objective = _objective(config, cls)
    return (f"{config.method} ({objective.__name__}, {objective.__module__.replace('.', '/')}.py), "
            f"{objective.sampler_text(config, cls.prediction)}; "
            f"{cls.__name__} ({cls.__module__.replace('.', '/')}.py, {cls.prediction} prediction)")


def _model_lines(config: RunConfig, cls, warnings: list[str]) -> list[tuple[str, str]]:
    from pipelines import adapter_options
    from pipelines.attention import resolve_attention, xformers_unavailable

    m = config.model
    source, index = _weights_source(m.path)
    lines = [("weights", source)]
    components = _components(cls, m.path, index)
    trained = _trained_text(cls, index)
    if m.lora_rank > 0 and m.init_lora:
        lines.append(("trains", f"LoRA on {trained}, started from {m.init_lora} with its own rank, alpha and "
                                f"targets (LoRA weights float32, base frozen in {m.dtype})"))
    elif m.lora_rank > 0:
        targets = ", ".join(m.lora_targets or cls.lora_targets)
        lines.append(("trains", f"LoRA on {trained}: r={m.lora_rank}, alpha={m.lora_alpha or m.lora_rank:g}, "
                                f"targets {targets} (LoRA weights float32, base frozen in {m.dtype})"))
    else:
        reference = " + a frozen reference copy for the KL" if config.train.kl_beta > 0 else ""
        lines.append(("trains", f"all of {trained} (full fine-tuning{reference}), weights in {m.dtype}"))
    lines.append(("components", components))
    lines.append(("precision", f"frozen weights {m.dtype}; mixed precision {config.train.mixed_precision}"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend, message = resolve_attention(m.attention, device, cls.supports_xformers)
    why = f": {xformers_unavailable(device, cls.supports_xformers)}" if backend == "sdpa" and m.attention in ("auto", "xformers") \
        else ": see the warning below" if message else ""
    lines.append(("attention", f"{m.attention} → {backend} on this machine ({device}{why})"))
    if message:
        warnings.append(message.removeprefix("flowalign: "))
    lines.append(("grad ckpt", "on" if m.gradient_checkpointing else "off"))
    size = "×".join(str(v) for v in (m.height, m.width)) if m.height or m.width else "the pipeline's default"
    if m.num_frames is not None:
        size += f", {m.num_frames} frames"
    lines.append(("size", size))
    options = adapter_options(m.family)
    shown = ", ".join(f"{k}={m.kwargs[k]!r}" if k in m.kwargs else f"{k}={d!r} (default)"
                      for k, (_, d) in options.items())
    lines.append(("model.kwargs", shown or "none (this family takes no options)"))
    return lines


def _trained_text(cls, index: dict | None) -> str:
    """Which denoisers train: ``model_folder``, and a further one (Wan 2.2 A14B's ``transformer_2``,
    ``possible_extra_folders``) when model_index.json lists it, or "if the checkpoint has one" when
    the index is not readable here (a hub id not in the local cache)."""
    first = cls.model_folder
    extra = cls.possible_extra_folders()
    present = {k: v for k, v in extra.items() if index is not None and (index.get(k) or [None])[0] is not None}
    if not extra or (index is not None and not present):
        return first
    boundary = (f" (switched at boundary_ratio {index['boundary_ratio']:g})" if index and "boundary_ratio" in index
                else "")
    roles = "; ".join(f"{k}: {v}" for k, v in extra.items())
    each = ("each expert with its own adapter, trained only on the steps it denoises; "
            + ", ".join(f"{k}'s saved to final/{k}_lora/" for k in extra))
    if present:
        return f"{first} and {', '.join(present)}{boundary} ({roles}; {each})"
    return f"{first}, and on {', '.join(extra)} if the checkpoint has one ({roles}; then {each})"


def _weights_source(path: str) -> tuple[str, dict | None]:
    """(what ``model.path`` names, its model_index.json when readable without the network)."""
    from pipelines.base import DEMO_MODELS_DIR, resolve_model_path

    resolved = resolve_model_path(path)
    folder = Path(resolved)
    if folder.is_dir():
        kind = "built-in demo model" if folder.parent == DEMO_MODELS_DIR else "local folder"
        index = folder / "model_index.json"
        return f"{kind} {folder.resolve()}", json.loads(index.read_text()) if index.is_file() else None
    cached = None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(path, "model_index.json")
        cached = hit if isinstance(hit, str) else None
    except Exception:  # noqa: BLE001  (a malformed id: from_pretrained will say so at training time)
        cached = None
    where = "in the local Hugging Face cache" if cached else "not in the local Hugging Face cache: downloaded " \
                                                             "on first use"
    return f"hub id {path} ({where})", json.loads(Path(cached).read_text()) if cached else None


def _components(cls, path: str, index: dict | None) -> str:
    """The pipeline parts that would load: from model_index.json when known, else the pipeline class."""
    pipeline = cls.pipeline_class
    skipped = {k for k, v in cls.pipeline_kwargs(path).items() if v is None}
    if index is not None:
        parts = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None]
        absent = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is None]
        text = f"{pipeline.__name__}: " + ", ".join(p for p in parts if p not in skipped)
        skipped |= set(absent)
    else:
        expected, _ = pipeline._get_signature_keys(pipeline)
        optional = set(getattr(pipeline, "_optional_components", [])) - skipped - {cls.model_folder}
        required = [k for k in expected if k not in optional and k not in skipped]
        text = f"{pipeline.__name__}: " + ", ".join(required)
        if optional:
            text += f" (+ {', '.join(sorted(optional))} if the repo has them)"
    if skipped:
        text += f"; not loaded: {', '.join(sorted(skipped))}"
    return text


def _reward_lines(config: RunConfig, warnings: list[str]) -> list[tuple[str, str]]:
    r = config.reward
    factory = reward_factory(r.name, "reward.name")
    lines = [("reward", f"{r.name} ({_qualname(factory)}): {_arguments_text(factory, r.kwargs, r.name, warnings)}"),
             ("reward weights", ", ".join(f"{k} × {v:g}" for k, v in r.weights.items()))]
    for name in config.eval.extra_rewards:
        extra = reward_factory(name, "eval.extra_rewards")
        lines.append(("eval extra", f"{name} ({_qualname(extra)}): {_arguments_text(extra, {}, name, warnings)}"))
    return lines


def _qualname(factory) -> str:
    return f"{factory.__module__}.{factory.__qualname__}"


def _arguments_text(factory, kwargs: dict, name: str, warnings: list[str]) -> str:
    values = reward_arguments(factory, kwargs, name, "reward.kwargs")
    parts = []
    for arg, (value, given) in values.items():
        parts.append(f"{arg}={value!r}" + ("" if given else " (default)"))
        local = isinstance(value, str) and value.startswith(("/", "./", "../", "~"))
        if local and not Path(value).expanduser().exists():
            warnings.append(f"reward {name!r}: {arg}={value!r} does not exist here (training would fail to load it)")
    return ", ".join(parts) or "no arguments"


def _data_lines(config: RunConfig, warnings: list[str]) -> list[tuple[str, str]]:
    d = config.data
    lines = [("train prompts", _prompt_text(d.train_prompts, warnings)),
             ("eval prompts", _prompt_text(d.eval_prompts, warnings) + f"; {config.eval.seeds} seed(s) each, "
                              f"{config.eval.num_steps or config.sampling.num_steps} ODE steps, "
                              + (f"every {config.eval.every} epochs" if config.eval.every else "at the start and end"))]
    if d.offline_groups:
        there = Path(d.offline_groups).is_dir()
        lines.append(("offline groups", f"{d.offline_groups} ({'present' if there else 'absent'})"))
        if not there and _objective(config, adapter_for(config)).rollout == "offline":
            warnings.append(f"data.offline_groups {d.offline_groups} does not exist: run `flowalign generate-groups` "
                            "with this recipe first")
    return lines


def _prompt_text(source: str, warnings: list[str]) -> str:
    from flowalign.prompts import load_prompts

    try:
        records = load_prompts(source)
    except FileNotFoundError as error:
        warnings.append(str(error))
        return f"{source} (not found here)"
    tags = {r.get("tag") for r in records if r.get("tag")}
    return f"{source} ({len(records)} prompts" + (f", {len(tags)} categories)" if tags else ")")


def _batch_lines(config: RunConfig, cls) -> list[tuple[str, str]]:
    from flowalign.samplers.steps import step_counts

    t, s = config.train, config.sampling
    samples = t.groups_per_epoch * t.group_size
    updates = math.ceil(samples / t.train_batch_size) * t.inner_epochs
    objective = _objective(config, cls)
    if objective.rollout == "unmasking":
        trained = f"{objective.num_terms(config)} unmasking steps trained per sample (those that unmask a position)"
    elif objective.rollout in ("ode", "offline"):
        trained = f"{objective.num_terms(config)} noising draws per sample (forward process)"
    else:
        trained = f"{step_counts(s)[1]} of {s.num_steps} steps trained per sample ({s.step_mode})"
    return [("per epoch", f"{t.groups_per_epoch} prompts × {t.group_size} samples = {samples} per process, rolled out "
                          f"{t.sample_batch_size} at a time; {updates} optimizer steps of {t.train_batch_size} samples "
                          f"× {t.inner_epochs} inner epoch(s); {trained}"),
            ("optimizer", f"{'8-bit AdamW (bitsandbytes)' if t.optimizer == 'adamw8bit' else 'AdamW'} "
                          f"lr {t.learning_rate:g}{', TF32 on CUDA' if t.allow_tf32 else ''}, "
                          f"weight decay {t.weight_decay:g}, "
                          + (f"clip range {t.clip_range:g}, " if "clipfrac" in objective.progress else "")
                          + f"KL β {t.kl_beta:g}, max grad norm {t.max_grad_norm:g}, "
                          f"{t.epochs} epochs" + (f", EMA {t.ema_decay:g}" if t.ema_decay else ""))]
