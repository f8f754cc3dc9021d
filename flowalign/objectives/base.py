"""The Objective protocol: what one method adds to the training loop, the Context an objective
sees (with the helpers every objective shares), and the registry of methods.

The trainer (``flowalign/trainer.py``) runs sample → score → advantages → update → end-epoch and
asks the objective, by this protocol only, for what differs between methods::

    name                the value of ``method``
    rollout             what the epoch sampler must produce: "sde" (stochastic steps with
                        log-probs), "ode" (final samples, any solver), "unmasking" (masked
                        discrete diffusion), "offline" (pre-generated groups; nothing sampled)
    tree_shape(config)  None, or the ``TreeShape`` (flowalign/samplers/tree.py) each prompt group is
                        sampled as: one tree from the group's shared noise, branching at chosen
                        steps, sharing prefixes, its leaves the group (``tree_rules``: the settings
                        a tree needs)
    keeps_uncond(config)  whether its rollouts keep CFG's unconditional prediction per step
                        (``Trajectory.uncond``) for its training forwards to reuse
    predictions         the adapter predictions it trains ("velocity", "epsilon", "logits")
    options             dataclasses of its own ``train.*`` options, joined into ``TrainConfig``
                        under the same keys and valid only when this method is selected
    per_reward_advantages  whether ``loss`` takes advantages [b, C] (one column per reward);
                        ``train.per_reward_advantages`` is refused before any model loads otherwise
    stateful            whether ``state_dict`` is checkpointed (under ``components()``' names)
    progress            ``train/*`` statistics the progress bar shows (e.g. ("clipfrac",))
    validate(config)    its own config rules, checked before any model loads (ConfigError
                        naming the key)
    validate_family(config)  rules once the family is known to be one it trains
    num_terms(config)   loss terms per minibatch (Accelerate's gradient accumulation), known
                        before the model loads
    sampler_text(config, prediction)  how its rollouts are sampled, in words (the dry run)
    unit                samples that must share a minibatch (whole groups for GDRO)
    terms(batch)        this epoch's term ids (trained steps, noising draws)
    sampling_weights()  the weights to sample with (DiffusionNFT's old policy swapped in)
    begin_update(batch) per-update draws, once per inner epoch (noising draws)
    loss(minibatch, term) → (loss, stats) of one term of a ``Minibatch`` (already sliced)
    after_step()        once per optimizer step actually taken (a skipped non-finite step: not)
    end_epoch(batch, epoch) → stats: end-of-epoch work (an old policy's decay)
    state_dict() / load_state_dict(state)   checkpointed under its name (flowalign.checkpoint)
    components()        the state to checkpoint, by name ({name: self} for a stateful objective)

What every objective shares is here once: the forward pass of the policy, the reference or a
copy of the weights through the right module (``Context.predict`` / ``Context.policy``), the
flow-matching error, the velocity KL, the weighted mean over training samples, the scalarisation
of per-reward advantages and the whole-groups rule. A method file holds only its own formula,
options, rules and state.

A method is one file beside its kernel that defines a class with these members (``BaseObjective``
has the defaults) and decorates it with ``@register``; ``flowalign/objectives/__init__.py``
imports the file (one line).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator, Literal, Protocol

import torch

from flowalign.errors import ConfigError

if TYPE_CHECKING:  # the config is built from this registry: imported for the annotations only
    from flowalign.config import RunConfig
    from flowalign.distributed import Distributed
    from flowalign.ema import EMA
    from flowalign.epoch_sampler import EpochBatch
    from flowalign.rollout import Trajectory
    from flowalign.samplers.tree import TreeShape
    from pipelines.base import Adapter, Conditioning
    from pipelines.unmasking import MaskedTrajectory

Rule = tuple[str, bool, str]  # (key, holds, message): ``check`` raises ConfigError on the first broken one
Policy = Literal["theta", "ref", "old"]


# -- what every objective computes the same way --------------------------------------------------
def flow_matching_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean over elements of (v − target)², the flow-matching (pre-training) error of a velocity
    prediction at x_σ = (1 − σ)·x0 + σ·ε, whose target is ε − x0. v, target: [B, ...] → float32 [B]."""
    return ((v.float() - target.float()) ** 2).flatten(1).mean(1)


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """mean over elements of ‖v − v_ref‖² (the velocity KL of AWM, DiffusionNFT, DGPO; v_ref
    detached). v, v_ref: [B, ...] → float32 [B]."""
    return ((v.float() - v_ref.detach().float()) ** 2).flatten(1).mean(1)


def plus_velocity_kl(loss: torch.Tensor, v: torch.Tensor, v_ref: torch.Tensor | None, beta: float,
                     weight: torch.Tensor, name: str = "kl_beta", target: str = "v_ref") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss + β·KL, KL) with KL the weighted mean of ``velocity_kl(v, v_ref)`` over the samples that
    train; (loss, 0) when β = 0. v, v_ref: [B, ...] (v_ref needed when β > 0; ``name`` and ``target``
    name β and v_ref in the error); weight: [B]."""
    if beta <= 0:
        return loss, torch.zeros((), device=v.device)
    if v_ref is None:
        raise ValueError(f"{name} > 0 needs {target}")
    kl = weighted_mean(velocity_kl(v, v_ref), weight)
    return loss + beta * kl, kl


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Σ values·weight / max(Σ weight, 1): the mean over the samples that train. [B], [B] → scalar."""
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def whole_groups_rule(config: RunConfig, why: str) -> Rule:
    """train.train_batch_size a multiple of train.group_size: a minibatch holds whole groups (``why``:
    which method or option needs it)."""
    t = config.train
    return ("train.train_batch_size", t.train_batch_size % t.group_size == 0,
            f"must be a multiple of train.group_size for {why} (a minibatch holds whole groups)")


def tree_rules(config: RunConfig, shape: TreeShape, why: str) -> list[Rule]:
    """What sampling each prompt group as one tree of ``shape`` needs (``why``: which method asks):
    the group is the tree's leaves, its rows share the root noise, rollout and training batches hold
    whole trees, and every branching step is stochastic."""
    t, s = config.train, config.sampling
    from flowalign.samplers.steps import plan_steps

    fixed = s.step_mode != "window" or s.window_start is not None or s.window_shift_every > 0
    plan = plan_steps(s.num_steps, 1, s.eta, s.step_mode, fraction=s.fraction, window_size=s.window_size,
                      window_start=s.window_start if s.window_start is not None else 0) if fixed else None
    return [("train.group_size", t.group_size == shape.leaves,
             f"must be the tree's {shape.leaves} leaves for {why} (branches per step {list(shape.branches)})"),
            ("sampling.shared_group_noise", s.shared_group_noise,
             f"must be true for {why}: a group is one tree, its rows share the root's noise"),
            ("train.sample_batch_size", t.sample_batch_size % t.group_size == 0,
             f"must be a multiple of train.group_size for {why} (a rollout batch holds whole trees)"),
            whole_groups_rule(config, why),
            ("sampling.step_mode", s.step_mode != "window" or s.window_start is not None,
             f"a random window (window_start null) is not allowed for {why}: the branching steps must be stochastic"),
            ("sampling.eta", plan is None or all(float(plan.noise_levels[i]) > 0 for i in shape.split_steps),
             f"must be > 0 at every branching step {list(shape.split_steps)} for {why} (the last step is always "
             "deterministic; under step_mode window the branching steps must lie in the window)")]


@dataclass
class Minibatch:
    """One minibatch of the epoch, sliced: idx long [b] (its samples' positions in the epoch, for
    per-update draws indexed by sample), traj (the sliced trajectory), advantages [b] (or [b, C]
    for an objective that takes per-reward advantages; 0 where invalid), valid bool [b] (the
    sample has a finite advantage), rewards [b] (NaN = dropped)."""

    idx: torch.Tensor
    traj: Trajectory | MaskedTrajectory
    advantages: torch.Tensor
    valid: torch.Tensor
    rewards: torch.Tensor

    @classmethod
    def of(cls, batch: EpochBatch, idx: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> Minibatch:
        return cls(idx, batch.traj[idx], advantages[idx], valid[idx], batch.rewards.to(advantages.device)[idx])

    def select(self, rows: torch.Tensor) -> Minibatch:
        """The minibatch's samples ``rows`` (long [k], positions in this minibatch)."""
        return Minibatch(self.idx[rows.to(self.idx.device)], self.traj[rows], self.advantages[rows],
                         self.valid[rows], self.rewards[rows])


@dataclass
class Context:
    """What an objective sees of the run: the config, the adapter, the prepared model (the DDP /
    FSDP wrapper), the trained parameters and the processes / streams."""

    config: RunConfig
    adapter: Adapter
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    dist: Distributed

    @property
    def reward_weights(self) -> torch.Tensor:
        """[C] the configured reward weights, in the order of the per-reward advantage columns."""
        return torch.tensor(list(self.config.reward.weights.values()), dtype=torch.float32)

    def scalarise(self, advantages: torch.Tensor) -> torch.Tensor:
        """[b] advantages: per-reward ones [b, C] summed with the reward weights, [b] as they are."""
        return advantages @ self.reward_weights.to(advantages) if advantages.ndim == 2 else advantages

    @property
    def reference_model(self) -> torch.nn.Module | None:
        """The module the reference policy's forward pass runs through: under FSDP a LoRA's
        reference (adapters off) must run through the wrapper that holds the shards; otherwise
        the adapter's own module (None)."""
        return self.model if self.dist.fsdp and self.config.model.lora_rank > 0 else None

    @contextlib.contextmanager
    def policy(self, which: Policy = "theta", weights: EMA | None = None) -> Iterator[torch.nn.Module | None]:
        """The module to pass as ``model=`` for a forward pass of ``which`` policy, chosen here once:
        "theta" the trained weights through the training wrapper (with grad); "ref" the reference
        (``adapter.reference()``, through ``reference_model``; no grad); "old" the copy ``weights``
        swapped in (an old / rollout / EMA policy; no grad). Swap before θ's forward: swapping
        weights in later would break its graph."""
        if which == "theta":
            yield self.model
            return
        with torch.no_grad():
            if which == "ref":
                with self.adapter.reference():
                    yield self.reference_model
            elif which == "old":
                if weights is None:
                    raise ValueError("policy 'old' needs the weights to swap in")
                with weights.swapped_in():
                    yield self.model
            else:
                raise ValueError(f"policy must be theta, ref or old, got {which!r}")

    def predict(self, x: torch.Tensor, t: torch.Tensor | None, cond: Conditioning, guidance_scale: float = 1.0, *,
                policy: Policy = "theta", weights: EMA | None = None) -> torch.Tensor:
        """``adapter.predict`` under ``policy`` (see ``policy``): [B, ...] like x (logits: [B, L, V])."""
        with self.policy(policy, weights) as model:
            return self.adapter.predict(x, t, cond, guidance_scale, model=model)


class Objective(Protocol):
    """Every member the training loop, the preflight and the checkpoints use (module docstring)."""

    name: ClassVar[str]
    rollout: ClassVar[str]
    predictions: ClassVar[tuple[str, ...]]
    options: ClassVar[tuple[type, ...]]
    per_reward_advantages: ClassVar[bool]
    progress: ClassVar[tuple[str, ...]]
    stateful: bool
    unit: int

    @classmethod
    def validate(cls, config: RunConfig) -> list[Rule]: ...

    @classmethod
    def validate_family(cls, config: RunConfig) -> list[Rule]: ...

    @classmethod
    def num_terms(cls, config: RunConfig) -> int: ...

    @classmethod
    def sampler_text(cls, config: RunConfig, prediction: str) -> str: ...

    @classmethod
    def tree_shape(cls, config: RunConfig) -> TreeShape | None: ...

    @classmethod
    def keeps_uncond(cls, config: RunConfig) -> bool: ...

    def terms(self, batch: EpochBatch) -> list[int]: ...

    def sampling_weights(self) -> contextlib.AbstractContextManager: ...

    def begin_update(self, batch: EpochBatch) -> None: ...

    def loss(self, mb: Minibatch, term: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def after_step(self) -> None: ...

    def end_epoch(self, batch: EpochBatch, epoch: int) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def components(self) -> dict: ...


class BaseObjective:
    """Defaults for the optional members: one sample per unit, one advantage per sample, current
    weights, nothing per update or step, nothing at the end of an epoch, no state."""

    name: ClassVar[str]
    rollout: ClassVar[str]
    unit = 1
    predictions: ClassVar[tuple[str, ...]] = ("velocity",)
    options: ClassVar[tuple[type, ...]] = ()
    per_reward_advantages: ClassVar[bool] = False
    progress: ClassVar[tuple[str, ...]] = ()
    stateful = False  # True: state_dict() is checkpointed under the objective's name

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.config = ctx.config

    @classmethod
    def validate(cls, config: RunConfig) -> list[Rule]:
        """Rules (key, holds, message) of this method's options; ``check`` raises on the first broken one."""
        return []

    @classmethod
    def validate_family(cls, config: RunConfig) -> list[Rule]:
        """Rules that hold once the family is known to be one this objective trains."""
        return []

    @classmethod
    def sampler_text(cls, config: RunConfig, prediction: str) -> str:
        """How the epoch's samples are made, in words (``train --dry-run``)."""
        s = config.sampling
        if cls.rollout == "offline":
            return f"no sampling (pre-generated groups of data.offline_groups, {s.num_steps}-step schedule)"
        if prediction == "epsilon":
            step = f"DDIM steps with log-probs, η={s.eta:g}"
        elif cls.rollout == "ode" and s.eta == 0:
            step = "ODE (Euler) steps"
        elif cls.rollout == "ode":
            step = f"{s.sde} SDE steps, η={s.eta:g} (log-probs unused)"
        else:
            step = f"{s.sde} SDE steps with log-probs, η={s.eta:g}"
        return f"{step}, {s.num_steps} steps, CFG {s.guidance_scale:g}"

    @classmethod
    def tree_shape(cls, config: RunConfig) -> TreeShape | None:
        """None: each group's rows are independent rollouts; a ``TreeShape``: one tree per group."""
        return None

    @classmethod
    def keeps_uncond(cls, config: RunConfig) -> bool:
        return False

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin_update(self, batch: EpochBatch) -> None:
        pass

    def after_step(self) -> None:
        pass

    def end_epoch(self, batch: EpochBatch, epoch: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def components(self) -> dict:
        """Checkpointed state by name (flowalign/checkpoint.py)."""
        return {self.name: self} if self.stateful else {}


OBJECTIVES: dict[str, list[type]] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` the objective of ``method: cls.name`` for its predictions.
    TypeError for a numeric option declared without its domain (flowalign/domains.py): a method
    registered by a plug-in, after the config module, is held to the same rule as the built-in ones."""
    from flowalign.domains import undeclared_domains

    for option in cls.options:
        if missing := undeclared_domains(option):
            raise TypeError(f"method {cls.name!r}: option {option.__name__} declares "
                            f"{', '.join('train.' + k for k in missing)} without a domain: annotate it, e.g. "
                            "`Annotated[float, above(0)]` (flowalign/domains.py)")
    OBJECTIVES.setdefault(cls.name, []).append(cls)
    return cls


def _registry() -> dict[str, list[type]]:
    import flowalign.objectives  # noqa: F401  (the registry lines)

    return OBJECTIVES


def method_options() -> dict[type, tuple[str, ...]]:
    """The registered objectives' option dataclasses, each once → the methods it belongs to."""
    found: dict[type, list[str]] = {}
    for name, classes in _registry().items():
        for cls in classes:
            for option in cls.options:
                owners = found.setdefault(option, [])
                if name not in owners:
                    owners.append(name)
    return {option: tuple(owners) for option, owners in found.items()}


def option_owners(options: dict[type, tuple[str, ...]], general: type | None = None) -> dict[str, str]:
    """``train.*`` key → who declares it ("general": the dataclass ``general``; else the methods of
    the option dataclass that does; ``options``: ``method_options()``). TypeError (at import, from
    flowalign.config) when two option dataclasses, or one and the general options, declare the same
    name: one would silently replace the other's default for every method."""
    if general is None:  # the general train options (flowalign.config passes them while it is imported)
        from flowalign.config import _GeneralTrainConfig as general
    owners = {f.name: "general" for f in dataclasses.fields(general)}
    declared_by = {f.name: "the general train options" for f in dataclasses.fields(general)}
    for option, owner_methods in options.items():
        for f in dataclasses.fields(option):
            if f.name in owners:
                raise TypeError(f"train.{f.name} is declared twice: by {option.__name__} (method "
                                f"{', '.join(owner_methods)}) and by {declared_by[f.name]}; option names must be unique")
            owners[f.name] = ", ".join(owner_methods)
            declared_by[f.name] = f"{option.__name__} (method {owners[f.name]})"
    return owners


def method_option_rules(config: RunConfig, owners: dict[str, str]) -> list[Rule]:
    """A method's own ``train.*`` options are valid only when it is selected: one set by the file or
    an override, or different from its default, under another method is an error naming the key
    and the methods it belongs to (``owners``: ``option_owners``)."""
    keys = config.sources["keys"] if config.sources is not None else set()
    rules = []
    for f in dataclasses.fields(config.train):
        methods = owners.get(f.name, "general")
        if methods == "general" or config.method in methods.split(", "):
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"train.{f.name}"
        rules.append((key, key not in keys and getattr(config.train, f.name) == default,
                      f"is an option of method {methods}, not of {config.method}: remove it, or choose that method"))
    return rules


def methods() -> tuple[str, ...]:
    return tuple(_registry())


def objective_class(method: str, family: str, prediction: str | None) -> type:
    """The objective of ``method`` for a family of ``prediction``; ConfigError naming both otherwise."""
    registry = _registry()
    if method not in registry:
        raise ConfigError(f"config: method must be one of {', '.join(registry)}, got {method!r}")
    for cls in registry[method]:
        if prediction in cls.predictions:
            return cls
    fitting = [name for name, classes in registry.items() if any(prediction in c.predictions for c in classes)]
    raise ConfigError(f"config: method {method!r} does not apply to model family {family!r} ({prediction} "
                      f"prediction): use {' / '.join(fitting)} for it")


def check(rules: list[Rule], where: str = "config", config: RunConfig | None = None) -> None:
    """ConfigError for the first failed (key, ok, message) rule, naming the override that set the
    key when ``config`` knows one (``flowalign.config.source_of``), else ``where``."""
    for key, ok, message in rules:
        if not ok:
            if config is not None:
                from flowalign.config import source_of

                where = source_of(config, key, where)
            raise ConfigError(f"{where}: {key} {message}")
