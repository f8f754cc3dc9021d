"""The objective seam's contract, each check a case that once passed silently: per-reward advantages
into an objective that takes one advantage per sample, another method's options, an option name
declared twice, an objective registered after the config module, and the reference policy's
forward pass under FSDP with LoRA (it must run through the wrapper that holds the shards)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from helpers import tiny_config

from flowalign.config import ConfigError, load_config, option_owners, to_dict
from flowalign.domains import Annotated, above
from flowalign.group_generation import generate_groups
from flowalign.objectives import base
from flowalign.objectives.base import Context, Minibatch, register
from flowalign.objectives.forward_process import ForwardProcessObjective
from flowalign.preflight import validate
from flowalign.trainer import Trainer


# -- per-reward advantages ----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["gdro"])
def test_per_reward_advantages_are_refused_for_an_objective_that_takes_one_per_sample(method):
    config = load_config("configs/shapes_gdro.yaml", ["train.per_reward_advantages=true"])
    with pytest.raises(ConfigError, match=rf"train.per_reward_advantages: method '{method}' \(GDRO\) takes one "):
        validate(config, missing_ok=True)


@dataclass
class ThrowawayOptions:
    throwaway_temperature: Annotated[float, above(0)] = 1.0  # the options of a method registered after flowalign.config


@pytest.fixture
def throwaway_method():
    """A method written as docs/architecture.md shows (one file, no per-reward declaration),
    registered after flowalign.config was imported; removed again afterwards."""

    class RewardWeightedFM(ForwardProcessObjective):
        name, rollout = "test_rwfm", "ode"
        options = (*ForwardProcessObjective.options, ThrowawayOptions)

        def loss(self, mb, j):
            x0, x_t, _, t, eps = self.noised(mb, j)
            mse = base.flow_matching_error(self.ctx.predict(x_t, t, mb.traj.cond), eps - x0)
            return base.weighted_mean(mb.advantages.exp() * mse, mb.valid.float()), {}

    register(RewardWeightedFM)
    yield RewardWeightedFM
    base.OBJECTIVES.pop("test_rwfm")


def test_a_late_registered_method_s_option_is_held_to_its_domain(throwaway_method):
    with pytest.raises(ConfigError, match=r"override 'train.throwaway_temperature=-1': "
                                          r"train.throwaway_temperature must be > 0, got -1"):
        load_config(None, ["method=test_rwfm", "sampling.eta=0", "train.throwaway_temperature=-1"])


def test_an_option_without_a_domain_is_refused_at_registration():
    @dataclass
    class Undeclared:
        throwaway_rate: float = 0.5

    class Forgetful(ForwardProcessObjective):
        name, rollout = "test_forgetful", "ode"
        options = (Undeclared,)

    with pytest.raises(TypeError, match=r"method 'test_forgetful': option Undeclared declares train.throwaway_rate "
                                        r"without a domain"):
        register(Forgetful)
    assert "test_forgetful" not in base.OBJECTIVES


def test_a_method_registered_after_the_config_takes_its_options_and_refuses_per_reward_advantages(throwaway_method):
    config = load_config(None, ["method=test_rwfm", "sampling.eta=0", "train.throwaway_temperature=0.5"])
    assert config.train.throwaway_temperature == 0.5  # registration order does not matter
    validate(config, missing_ok=True)
    config = load_config(None, ["method=test_rwfm", "sampling.eta=0", "train.per_reward_advantages=true"])
    with pytest.raises(ConfigError, match=r"override 'train.per_reward_advantages=true': train.per_reward_advantages: "
                                          r"method 'test_rwfm' \(RewardWeightedFM\) takes one advantage per sample"):
        validate(config, missing_ok=True)


# -- options per method -------------------------------------------------------------------------
@pytest.mark.parametrize("override, owner", [("train.nft_beta=3", "diffusion_nft"), ("train.gdro_tau=9", "gdro"),
                                             ("train.awm_loss=ghuber", "awm"),
                                             ("train.nft_beta=1.0", "diffusion_nft")])  # its default, but set
def test_another_methods_option_is_an_error_naming_the_key_and_its_method(override, owner):
    with pytest.raises(ConfigError, match=rf"override '{override}': train\.{override.split('.')[1].split('=')[0]} "
                                          rf"is an option of method {owner}, not of flow_grpo"):
        load_config("configs/shapes_flow_grpo.yaml", [override])


def test_options_shared_by_methods_are_valid_for_each_of_them():
    for recipe in ("shapes_nft", "shapes_awm", "shapes_dgpo", "shapes_gdro"):  # train.noise_draws: all four
        assert load_config(f"configs/{recipe}.yaml", ["train.noise_draws=2"]).train.noise_draws == 2
    assert load_config("configs/chess_ddpo.yaml").train.entropy_coef == 0.01  # ddpo's masked-diffusion objective


def test_an_option_name_declared_twice_fails_naming_both():
    @dataclass
    class Clashing:
        clip_range: float = 0.2  # a general key

    with pytest.raises(TypeError, match=r"train.clip_range is declared twice: by Clashing \(method mine\) and by "
                                        r"the general train options"):
        option_owners({Clashing: ("mine",)})

    @dataclass
    class First:
        shared_name: int = 1

    @dataclass
    class Second:
        shared_name: int = 2

    with pytest.raises(TypeError, match=r"train.shared_name is declared twice: by Second \(method b\) and by "
                                        r"First \(method a\)"):
        option_owners({First: ("a",), Second: ("b",)})


def test_the_registered_options_do_not_collide():
    owners = option_owners(base.method_options())
    assert set(owners["noise_draws"].split(", ")) == {"diffusion_nft", "gdro", "awm", "dgpo", "online_dpo", "crd"}
    assert owners["clip_range"] == "general" and owners["entropy_coef"] == "ddpo"


def test_the_override_source_survives_a_copy():
    config = load_config("configs/shapes_flow_grpo.yaml", ["train.kl_beta=0.1"])
    copied = dataclasses.replace(config, output_dir="elsewhere")
    assert copied.sources == config.sources and "sources" not in to_dict(copied)
    copied.train.kl_beta = -1.0
    with pytest.raises(ConfigError, match=r"^override 'train.kl_beta=0.1': "):
        from flowalign.objectives.base import check

        check([("train.kl_beta", copied.train.kl_beta >= 0, "must be ≥ 0")], config=copied)


# -- the reference policy under FSDP with LoRA ----------------------------------------------------
class FSDPLayout:
    """The real Distributed of a one-process run, reporting FSDP: what ``Context`` reads to choose
    the module of the reference's forward pass."""

    fsdp = True

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)


REFERENCE_TERMS = {  # every objective with a reference term, with the settings that turn it on
    "flow_grpo": ("train.kl_beta=0.1",),
    "grpo_guard": ("method=grpo_guard", "train.kl_beta=0.1"),
    "diffusion_nft": ("method=diffusion_nft", "sampling.eta=0", "train.kl_beta=0.1", "train.noise_draws=2"),
    "awm": ("method=awm", "sampling.eta=0", "train.kl_beta=0.1", "train.noise_draws=2"),
    "dgpo": ("method=dgpo", "sampling.eta=0", "train.noise_draws=2"),
    "online_dpo": ("method=online_dpo", "sampling.eta=0", "train.noise_draws=2"),
    "gdro": ("method=gdro", "sampling.eta=0", "train.noise_draws=2"),
    "flow_dppo": ("method=flow_dppo", "train.kl_beta=0.1"),
}


@pytest.mark.parametrize("method", sorted(REFERENCE_TERMS))
def test_the_reference_runs_through_the_fsdp_wrapper_with_lora(method, tiny_sd3_dir, tmp_path, monkeypatch):
    overrides = [*REFERENCE_TERMS[method], "train.epochs=1"]
    if method == "gdro":
        overrides.append(f"data.offline_groups={tmp_path / 'groups'}")
        generate_groups(tiny_config(tiny_sd3_dir, tmp_path / "gen", *overrides), 2)
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "run", *overrides))
    trainer.sampler.prepare(trainer.objective.rollout)
    ctx = Context(trainer.config, trainer.adapter, trainer.model, trainer.params, FSDPLayout(trainer.dist))
    objective = type(trainer.objective)(ctx)
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)

    adapter, calls, inside = trainer.adapter, [], []
    predict, reference = adapter.predict, adapter.reference

    @contextlib.contextmanager
    def recorded_reference():
        with reference():
            inside.append(True)
            try:
                yield
            finally:
                inside.pop()

    def recorded_predict(*args, model=None, **kwargs):
        calls.append((bool(inside), model))
        return predict(*args, model=model, **kwargs)

    monkeypatch.setattr(adapter, "predict", recorded_predict)
    monkeypatch.setattr(adapter, "reference", recorded_reference)
    objective.begin_update(batch)
    idx = trainer.dist.minibatches(len(batch.specs), objective.unit)[0]
    valid = torch.isfinite(advantages)
    objective.loss(Minibatch.of(batch, idx, torch.nan_to_num(advantages), valid), objective.terms(batch)[0])
    modules = [model for in_reference, model in calls if in_reference]
    assert modules, f"{method}: no reference forward pass"
    assert all(model is trainer.model for model in modules), f"{method}: the reference ran through {modules}"
