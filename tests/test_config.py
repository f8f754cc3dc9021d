"""Typed YAML configs with command-line overrides: bad input names the key and the file."""

from pathlib import Path

import pytest

from flowalign.config import ConfigError, check_values, load_config, parse_override

DEMO = "configs/shapes_flow_grpo.yaml"
RECIPES = sorted(str(p) for p in Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_and_passes_the_value_checks(recipe):
    check_values(load_config(recipe), recipe)


def test_demo_config_loads_and_overrides_apply():
    config = load_config(DEMO, ["train.learning_rate=1e-4", "sampling.num_steps=8", "reward.weights={accuracy: 1}"])
    assert config.train.learning_rate == 1e-4 and isinstance(config.train.learning_rate, float)
    assert config.sampling.num_steps == 8
    assert config.reward.weights == {"accuracy": 1.0}
    assert config.model.path == "shapes-sd3"  # untouched values come from the file


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 1e-4\n")
    assert load_config(path).train.learning_rate == 1e-4


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learnig_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and "train.learnig_rate" in message and "train.learning_rate" in message


def test_wrong_type_names_key_and_override():
    with pytest.raises(ConfigError, match=r"override 'train.epochs=ten'.*train.epochs must be int"):
        load_config(DEMO, ["train.epochs=ten"])
    with pytest.raises(ConfigError, match="train.epochs must be int"):
        load_config(DEMO, ["train.epochs=true"])  # bools are not ints


def test_choices_and_cross_field_rules():
    with pytest.raises(ConfigError, match="sampling.step_mode must be one of"):
        load_config(DEMO, ["sampling.step_mode=sometimes"])
    with pytest.raises(ConfigError, match="sampling.eta must be > 0"):
        load_config(DEMO, ["sampling.eta=0"])
    with pytest.raises(ConfigError, match="train.train_batch_size"):
        load_config(DEMO, ["train.train_batch_size=1000"])
    with pytest.raises(ConfigError, match="threads must be ≥ 0"):
        load_config(DEMO, ["threads=-1"])


def test_missing_file_and_malformed_override(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("train.epochs")
    with pytest.raises(ConfigError, match="not a section"):
        load_config(DEMO, ["output_dir.x=1"])
