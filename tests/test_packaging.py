"""Packaging: optional rewards cost only themselves, the top-level names refuse to be shadowed, the
built-in recipes are found by name, the declared floors are the documented ones, and the dtype a
config asks for is the dtype that loads (diffusers < 0.40 ignored it)."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import flowalign
from flowalign.cli import main
from flowalign.config import ConfigError, load_config
from flowalign.recipes import builtin_recipes, find_recipe
from reward_models.base import BUILTIN_REWARDS, INSTALL, REWARD_PACKAGES, register_reward

pytestmark = pytest.mark.slow  # installs and subprocesses

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL = sorted({p for packages in REWARD_PACKAGES.values() for p in packages})


def run_python(code: str, *path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose sys.path starts with ``path`` then the work tree."""
    env = {"PYTHONPATH": ":".join([*map(str, path), str(ROOT)]), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=path[0] if path
                          else ROOT, timeout=300)


# --------------------------------------------------------------------------- optional rewards

BLOCKED_RUN = f"""
import json, sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError; find_spec says absent
import torch
import flowalign, flowalign.trainer, flowalign.preflight
from flowalign.config import ConfigError, load_config
from reward_models.base import MissingRewardPackage, available_rewards, build_reward

out = {{"available": available_rewards()}}
jpeg = build_reward("jpeg_compressibility")
out["jpeg"] = jpeg(torch.zeros(2, 3, 16, 16), ["a", "b"], [{{}}, {{}}])["jpeg_compressibility"].tolist()
out["missing"], out["config"] = {{}}, {{}}
for name in {sorted(REWARD_PACKAGES)!r}:
    try:
        build_reward(name)
        out["missing"][name] = "built"
    except MissingRewardPackage as error:
        out["missing"][name] = str(error)
    try:
        flowalign.preflight.check_rewards(load_config(None, [f"reward.name={{name}}"]))
        out["config"][name] = "passed"
    except ConfigError as error:
        out["config"][name] = str(error)
out["imported"] = sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None)
print(json.dumps(out))
"""


def test_missing_optional_packages_cost_only_their_own_rewards():
    """With chess, scipy, open_clip and pytesseract all absent, the whole training stack imports,
    every reward name is listed, other rewards build and score, and each affected reward names its
    package and the pip line (from build_reward and from the config check). A top-level import of
    any of them coming back anywhere on these paths makes the subprocess fail."""
    done = run_python(BLOCKED_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert set(BUILTIN_REWARDS) <= set(out["available"])
    assert len(out["jpeg"]) == 2 and all(v < 0 for v in out["jpeg"])  # minus the JPEG size in kB
    for name, packages in REWARD_PACKAGES.items():
        for message in (out["missing"][name], out["config"][name]):
            assert f"reward {name!r} needs the Python package {packages[0]!r}" in message
            assert INSTALL[packages[0]].split("  ")[0] in message  # the pip line
        assert out["config"][name].startswith("override 'reward.name=")  # names where the reward was set
    assert out["imported"] == []


def test_every_registered_builtin_reward_is_in_the_lazy_table():
    """``BUILTIN_REWARDS`` lists each ``@register_reward`` of reward_models/ with its module: a new
    reward missing from the table would never be found by name."""
    found = {}
    for path in (ROOT / "reward_models").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for name in re.findall(r'^@register_reward\("([^"]+)"\)', path.read_text(), re.M):
            found[name] = module
    assert found == BUILTIN_REWARDS


def test_a_builtin_reward_name_cannot_be_taken_before_it_loads():
    def shapes(samples, prompts, metadata):
        return samples.mean((1, 2, 3))

    with pytest.raises(ValueError, match="'shapes' is a built-in"):
        register_reward("shapes")(shapes)


def test_clip_is_an_extra_and_no_dependency_is_capped():
    deps = PYPROJECT["project"]["dependencies"]
    assert not any("open-clip" in d or "open_clip" in d for d in deps)
    assert any(d.startswith("open-clip-torch>=") for d in PYPROJECT["project"]["optional-dependencies"]["clip"])
    assert not any("<" in d.split(";")[0] for d in deps), "no upper caps: a newer torch must not be downgraded"


# --------------------------------------------------------------------------- top-level names

@pytest.mark.parametrize("name", ["pipelines", "reward_models"])
def test_a_shadowing_top_level_package_is_refused_by_name(tmp_path, name):
    """flowalign checks at import (every command and the Python API import it first); pipelines and
    reward_models import nothing of flowalign (tests/test_layering.py), so they do not check."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("OTHER = True\n")
    done = run_python("import flowalign", tmp_path)
    assert done.returncode != 0
    assert "ShadowedPackageError" in done.stderr
    assert f"another {name!r} hides flowalign's" in done.stderr
    assert str(tmp_path / name / "__init__.py") in done.stderr and str(ROOT / name) in done.stderr


def test_our_own_layout_imports_without_loading_torch(tmp_path):
    (tmp_path / "unrelated").mkdir()  # a folder of another name changes nothing
    done = run_python("import sys, flowalign; print('torch' in sys.modules, flowalign.__version__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", flowalign.__version__]


# --------------------------------------------------------------------------- recipes by name

def test_every_recipe_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipes = builtin_recipes()
    assert set(recipes) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert find_recipe("shapes_nft").read_text() == (ROOT / "configs/shapes_nft.yaml").read_text()
    assert find_recipe("shapes_nft.yaml") == find_recipe("shapes_nft")
    config = load_config("sd35m_flow_grpo_pickscore", ["train.epochs=3"])
    assert config.train.epochs == 3
    folder = recipes["sd35m_flow_grpo_pickscore"].parent
    assert Path(config.data.train_prompts) == folder / "prompts/pickscore/train.txt"
    with pytest.raises(ConfigError, match=r"'shapes_nft' is a built-in recipe: use the name alone \(shapes_nft\)"):
        load_config("configs/shapes_nft.yaml")  # a path is a path: not found from this folder
    with pytest.raises(ConfigError, match="built-in recipes \\(flowalign recipes\\): av_nft, chess_ddpo"):
        load_config("no_such_recipe")


def test_a_file_wins_over_a_recipe_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shapes_nft").write_text("train: {epochs: 7}\n")
    assert load_config("shapes_nft").train.epochs == 7


def test_flowalign_recipes_lists_and_shows(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^shapes_nft +The README's demo: DiffusionNFT on the built-in shapes world", out, re.M)
    assert f"{len(builtin_recipes())} recipes in" in out
    assert main(["recipes", "--show", "shapes_flow_grpo"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs/shapes_flow_grpo.yaml").read_text()


def test_the_wheel_declares_license_types_and_recipes():
    project, setuptools = PYPROJECT["project"], PYPROJECT["tool"]["setuptools"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    for package in ("flowalign", "pipelines", "reward_models"):
        assert (ROOT / package / "py.typed").is_file() and "py.typed" in setuptools["package-data"][package]
    assert "configs/*.yaml" in setuptools["package-data"]["flowalign"]
    assert (ROOT / "flowalign/configs/shapes_nft.yaml").is_file()  # the link the wheel copies


def test_every_floor_is_in_the_install_doc():
    """docs/install.md's table of verified floors says what pyproject.toml declares."""
    doc = (ROOT / "docs/install.md").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for requirement in [*PYPROJECT["project"]["dependencies"], *extras["clip"], *extras["datasets"]]:
        name, floor = re.match(r"([A-Za-z0-9_.\-]+)>=([^,;\s]+)", requirement).groups()
        assert re.search(rf"^\| {re.escape(name)} \| {re.escape(floor)} \|", doc, re.M), f"{name}>={floor}"


# --------------------------------------------------------------------------- the diffusers floor

def test_the_dtype_asked_for_is_the_dtype_loaded(tiny_sd3_dir):
    """diffusers 0.37-0.39 took ``dtype=`` silently and loaded float32 (hence diffusers>=0.40)."""
    from pipelines import load_adapter

    adapter = load_adapter("sd3", str(tiny_sd3_dir), dtype="bfloat16")
    for part in ("transformer", "vae", "text_encoder"):
        assert next(getattr(adapter.pipe, part).parameters()).dtype == torch.bfloat16, part
