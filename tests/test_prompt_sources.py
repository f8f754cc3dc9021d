"""Prompt sources: comment lines, CSV, Hugging Face datasets, recipe-relative paths, and the prompt
files the real-model recipes ship."""

import importlib.util
import logging
from pathlib import Path

import pytest
import yaml

from flowalign.config import ConfigError, load_config
from flowalign.preflight import check_prompt_sets
from flowalign.prompts import load_prompts, resolve_source

ROOT = Path(__file__).resolve().parents[1]
needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                    reason="datasets is not installed (pip install 'flowalign[datasets]')")


def recipe(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump({"data": data}))
    return path


def test_comment_lines_are_skipped_in_txt_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("# from somewhere, MIT\n  # indented comment\na red circle\n\nthe #1 square\n")
    assert load_prompts(str(tmp_path / "p.txt")) == [{"prompt": "a red circle"}, {"prompt": "the #1 square"}]
    (tmp_path / "p.jsonl").write_text('# provenance\n{"prompt": "a", "tag": "t"}\n')
    assert load_prompts(str(tmp_path / "p.jsonl")) == [{"prompt": "a", "tag": "t"}]


def test_csv_columns_become_record_keys(tmp_path):
    (tmp_path / "p.csv").write_text('prompt,tag\n"a cat, sitting",animals\na car,vehicles\n')
    assert load_prompts(str(tmp_path / "p.csv")) == [{"prompt": "a cat, sitting", "tag": "animals"},
                                                     {"prompt": "a car", "tag": "vehicles"}]


def test_a_recipes_relative_prompt_paths_are_read_from_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    (folder / "p").mkdir(parents=True)
    (folder / "p/train.txt").write_text("one\ntwo\n")
    path = recipe(folder, {"train_prompts": "p/train.txt", "eval_prompts": "shapes:test"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    assert config.data.train_prompts == str(folder / "p/train.txt")
    assert config.data.eval_prompts == "shapes:test"  # a built-in split is not a path
    assert [r["prompt"] for r in load_prompts(config.data.train_prompts)] == ["one", "two"]
    # an override is typed in a shell: relative to the working directory, as before
    assert load_config(path, ["data.train_prompts=q.txt"]).data.train_prompts == "q.txt"


def test_a_path_found_only_from_the_working_directory_still_works_with_a_warning(tmp_path, monkeypatch, caplog):
    path = recipe(tmp_path / "recipes", {"train_prompts": "data/train.txt"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data/train.txt").write_text("old layout\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flowalign"):
        config = load_config(path)
    assert config.data.train_prompts == "data/train.txt"
    assert "relative to the working directory" in caplog.text and "write ../data/train.txt" in caplog.text


def test_a_path_found_nowhere_is_reported_beside_the_recipe(tmp_path, monkeypatch):
    path = recipe(tmp_path / "recipes", {"train_prompts": "p/missing.txt"})
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    with pytest.raises(ConfigError, match=f"data.train_prompts.*tried {tmp_path / 'recipes/p/missing.txt'}"):
        check_prompt_sets(config)


def test_resolve_source_keeps_absolute_paths_splits_and_hub_ids(tmp_path):
    assert resolve_source("/abs/p.txt", tmp_path) == "/abs/p.txt"
    assert resolve_source("chess:train", tmp_path) == "chess:train"
    assert resolve_source("hf:org/prompts", tmp_path) == "hf:org/prompts"  # no such folder: a hub id
    (tmp_path / "ds").mkdir()
    assert resolve_source("hf:ds:test", tmp_path) == f"hf:{tmp_path / 'ds'}:test"


@needs_datasets
def test_a_saved_dataset_and_its_splits_are_prompt_sources(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = {"prompt": ["a red circle", "a blue square"], "tag": ["color", "shape"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "flat"))
    expected = [{"prompt": "a red circle", "tag": "color"}, {"prompt": "a blue square", "tag": "shape"}]
    assert load_prompts(str(tmp_path / "flat")) == expected  # a save_to_disk folder
    assert load_prompts(f"hf:{tmp_path / 'flat'}") == expected
    split = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                  "test": datasets.Dataset.from_dict({"prompt": ["held out"], "tag": ["x"]})})
    split.save_to_disk(str(tmp_path / "split"))
    assert load_prompts(f"hf:{tmp_path / 'split'}") == expected  # train by default
    assert load_prompts(f"hf:{tmp_path / 'split'}:test") == [{"prompt": "held out", "tag": "x"}]
    with pytest.raises(ValueError, match=r"no split 'dev'; it has \['train', 'test'\]"):
        load_prompts(f"hf:{tmp_path / 'split'}:dev")
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "p.parquet"))
    assert load_prompts(str(tmp_path / "p.parquet")) == expected  # a data file through load_dataset
    (tmp_path / "with_image").mkdir()
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "with_image/in.png")  # a conditioning image must decode
    datasets.Dataset.from_dict({"prompt": ["edit it"], "image": ["in.png"]}).save_to_disk(str(tmp_path / "with_image"))
    image = str(tmp_path / "with_image/in.png")  # an image path column, relative to the dataset's folder
    assert load_prompts(str(tmp_path / "with_image")) == [{"prompt": "edit it", "image": image}]
    datasets.Dataset.from_dict({"caption": ["x"]}).save_to_disk(str(tmp_path / "nocol"))
    with pytest.raises(ValueError, match=r"no \"prompt\" column \(columns: \['caption'\]\)"):
        load_prompts(f"hf:{tmp_path / 'nocol'}")


@needs_datasets
def test_a_recipe_names_a_dataset_relative_to_its_folder(tmp_path, monkeypatch):
    import datasets

    folder = tmp_path / "recipes"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                          "test": datasets.Dataset.from_dict({"prompt": ["c"]})}).save_to_disk(str(folder / "ds"))
    path = recipe(folder, {"train_prompts": "hf:ds", "eval_prompts": "hf:ds:test"})
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    check_prompt_sets(config)
    assert [r["prompt"] for r in load_prompts(config.data.eval_prompts)] == ["c"]


def test_without_datasets_a_dataset_source_says_how_to_install_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'flowalign\[datasets\]'"):
        load_prompts(f"hf:{tmp_path}")


def test_the_shipped_prompt_files_say_where_they_come_from_and_load():
    files = sorted((ROOT / "configs/prompts").rglob("*.txt")) + sorted((ROOT / "configs/prompts").rglob("*.jsonl"))
    assert len(files) == 9
    for path in files:
        head = path.read_text().splitlines()[:2]
        assert head[0].startswith("# ") and "scripts/make_recipe_prompts.py" in path.read_text()[:1500], path
        records = load_prompts(str(path))
        assert records and not any(r["prompt"].startswith("#") for r in records), path
    geneval = load_prompts(str(ROOT / "configs/prompts/geneval/train_metadata.jsonl"))
    test = {r["prompt"] for r in load_prompts(str(ROOT / "configs/prompts/geneval/test_metadata.jsonl"))}
    assert not test & {r["prompt"] for r in geneval}  # generated training records hold no test prompt
    assert {r["tag"] for r in geneval} == {"two_object", "counting", "colors", "position", "color_attr"}
