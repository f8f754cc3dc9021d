"""Every numeric config key declares its domain with its annotation (flowalign/domains.py), and a
value outside it stops the run before any model loads, naming the key and where it came from."""

import dataclasses
import math
from typing import Optional

import pytest

from flowalign.config import ConfigError, RunConfig, load_config
from flowalign.domains import Annotated, above, fields_with_hints, numeric, undeclared_domains


undeclared = undeclared_domains


def test_every_numeric_key_declares_its_domain():
    keys = [key for key, hint in fields_with_hints(RunConfig) if numeric(hint)]
    assert len(keys) > 60  # the methods' options included
    # the sections and options defined beside what reads them: objectives, experimental extras, trackers, EMA, ...
    assert {"train.nft_beta", "train.gdro_tau", "explore.hidden", "routing.threshold", "tracker_samples",
            "tracker_samples_every", "train.max_cpu_minutes", "sampling.window_range", "train.ema_decay"} <= set(keys)
    assert undeclared(RunConfig) == []


def test_a_key_added_without_a_domain_is_found():
    @dataclasses.dataclass
    class Section:
        declared: Annotated[float, above(0)] = 1.0
        forgotten: Optional[int] = None
        words: list[str] = dataclasses.field(default_factory=list)

    assert undeclared(Section) == ["forgotten"]


@pytest.mark.parametrize("override, named", [
    ("train.max_grad_norm=-1", "train.max_grad_norm must be > 0"),
    ("train.advantage_clip=-1", "train.advantage_clip must be > 0"),
    ("reward.weights={score: .inf}", "reward.weights score: must be a finite number"),
    ("reward.weights={}", "reward.weights must name at least one entry"),
    ("sampling.fraction=1.5", "sampling.fraction must be in (0, 1]"),
    ("train.max_minutes=-1", "train.max_minutes must be > 0"),
    ("model.lora_alpha=0", "model.lora_alpha must be > 0"),
    ("train.adam_betas=[0.9]", "train.adam_betas must hold 2 numbers"),
    ("method=diffusion_nft|train.nft_beta=0", "train.nft_beta must be > 0"),  # a method's own option
    ("output_dir=", "output_dir must name a folder"),
    ("train.groups_per_epoch=1000000000", "samples per epoch"),
])
def test_a_value_outside_its_domain_names_the_key_and_the_override(override, named):
    with pytest.raises(ConfigError) as error:
        load_config(None, override.split("|"))  # method=M|its option
    last = override.split("|")[-1]
    assert str(error.value).startswith(f"override '{last}': ") and named in str(error.value)


def test_infinity_is_accepted_where_it_means_no_limit():
    assert math.isinf(load_config(None, ["train.max_minutes=.inf"]).train.max_minutes)


def test_an_empty_or_non_utf8_recipe_is_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="empty.yaml: the recipe is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "latin1.yaml").write_bytes("method: flow_grpo  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text, so not a YAML recipe \(byte 0xe9"):
        load_config(tmp_path / "latin1.yaml")
