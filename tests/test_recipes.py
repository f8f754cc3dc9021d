"""Every recipe in configs/ passes ``flowalign train RECIPE --dry-run`` without touching a weight or
the network; bad recipes fail naming the key; the real-model recipes carry the anchors' numbers."""

from pathlib import Path

import pytest
import yaml

from flowalign.cli import main
from flowalign.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
HUB_IDS = {"sd35m_flow_grpo_geneval.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_flow_grpo_ocr.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_gardo_ocr.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_flow_grpo_pickscore.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_flow_dppo_pickscore.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_online_dpo_pickscore.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "sd35m_crd_ocr.yaml": "stabilityai/stable-diffusion-3.5-medium",
           "flux_dev_dance_grpo_hps.yaml": "black-forest-labs/FLUX.1-dev",
           "flux_dev_branch_grpo_hps.yaml": "black-forest-labs/FLUX.1-dev",
           "flux_dev_pref_grpo_unifiedreward.yaml": "black-forest-labs/FLUX.1-dev",
           "wan21_t2v_flow_grpo_temporal.yaml": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
           "sd15_ddpo_aesthetic.yaml": "stable-diffusion-v1-5/stable-diffusion-v1-5",
           "sd15_ddpo_compressibility.yaml": "stable-diffusion-v1-5/stable-diffusion-v1-5",
           "qwen_image_flow_grpo_pickscore.yaml": "Qwen/Qwen-Image",
           "flux2_klein_flow_grpo_pickscore.yaml": "black-forest-labs/FLUX.2-klein-base-4B",
           "z_image_turbo_flow_grpo_fast_pickscore.yaml": "Tongyi-MAI/Z-Image-Turbo",
           "wan22_a14b_t2v_flow_grpo_temporal.yaml": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
           "flux_kontext_flow_grpo_counting_edit.yaml": "black-forest-labs/FLUX.1-Kontext-dev",
           "qwen_image_edit_flow_grpo_counting_edit.yaml": "Qwen/Qwen-Image-Edit",
           "wan21_i2v_flow_grpo_temporal.yaml": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
           "qwen_image_edit_plus_flow_grpo_counting_edit.yaml": "Qwen/Qwen-Image-Edit-2509",
           "wan22_ti2v_i2v_flow_grpo_temporal.yaml": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}


@pytest.fixture
def no_loading(monkeypatch):
    """Any weight load or hub download during a dry run fails the test."""
    import diffusers
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run tried to load or download: {args[:2]}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr("flowalign.trainer.train", refuse)


# image-conditioned recipes: their {"prompt", "image"} records are the user's to write
USER_PROMPTS = {"flux_kontext_flow_grpo_counting_edit.yaml", "qwen_image_edit_flow_grpo_counting_edit.yaml",
                "qwen_image_edit_plus_flow_grpo_counting_edit.yaml", "wan21_i2v_flow_grpo_temporal.yaml",
                "wan22_ti2v_i2v_flow_grpo_temporal.yaml"}


USER_FILES = {"sd15_ddpo_aesthetic.yaml"}  # the aesthetic predictor's weights: never downloaded


def test_the_real_model_recipes_exist():
    assert set(HUB_IDS) <= {p.name for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_passes_the_dry_run(recipe, no_loading, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # recipes name their prompt files relative to their own folder
    missing = recipe.name in USER_PROMPTS or recipe.name in USER_FILES
    assert main(["train", str(recipe), "--dry-run"]) == (2 if missing else 0)  # the report, then the missing files
    out, err = capsys.readouterr()
    if not missing:  # every other recipe ships its prompts (configs/prompts/SOURCES.md)
        assert "not found here" not in out and err == ""
    else:
        assert err.count("\n") == 1 and "missing here: " in err and "The recipe says: " in err
    assert "is valid; nothing was downloaded or loaded" in out
    for line in ("weights", "trains", "components", "attention", "reward", "train prompts", "per epoch"):
        assert f"  {line} " in out
    if recipe.name in HUB_IDS:
        assert f"hub id {HUB_IDS[recipe.name]}" in out
    else:
        assert "built-in demo model" in out


def _variant(tmp_path, recipe: str, edit) -> str:
    tree = yaml.safe_load((CONFIGS / recipe).read_text())
    edit(tree)
    path = tmp_path / recipe
    path.write_text(yaml.safe_dump(tree))
    return str(path)


@pytest.mark.parametrize("recipe, edit, expected", [
    ("flux_dev_dance_grpo_hps.yaml", lambda t: t["model"]["kwargs"].update(max_seq_len=256),
     ["model.kwargs.max_seq_len", "FluxAdapter", "max_sequence_length"]),
    ("flux_dev_dance_grpo_hps.yaml", lambda t: t["model"]["kwargs"].update(max_sequence_length="long"),
     ["model.kwargs.max_sequence_length", "must be int"]),
    ("wan21_t2v_flow_grpo_temporal.yaml", lambda t: t["model"]["kwargs"].update(num_frames=9),
     ["model.kwargs.num_frames", "its own setting: model.num_frames"]),
    ("sd35m_flow_grpo_pickscore.yaml", lambda t: t["train"].update(clip_rnage=0.1),
     ["unknown key 'train.clip_rnage'", "did you mean 'train.clip_range'"]),
    ("sd35m_flow_grpo_pickscore.yaml", lambda t: t["reward"].update(kwargs={"modle": "x"}),
     ["reward.kwargs.modle", "'pickscore' takes no argument"]),
    ("sd15_ddpo_aesthetic.yaml", lambda t: t["reward"].update(kwargs={}), ["reward.kwargs.mlp_path", "needs it"]),
    ("sd35m_flow_grpo_ocr.yaml", lambda t: t["reward"].update(name="ocr_v2"),
     ["reward.name", "unknown reward 'ocr_v2'"]),
    ("sd35m_flow_grpo_ocr.yaml", lambda t: t["reward"].update(weights={"accuracy": 1.0}),
     ["reward.weights names ['accuracy']", "returns ['ocr']"]),
    ("flux_dev_dance_grpo_hps.yaml", lambda t: t.update(method="ddpo"), ["method 'ddpo' does not apply", "'flux'"]),
    ("sd15_ddpo_aesthetic.yaml", lambda t: t.update(method="flow_grpo"), ["method 'flow_grpo' does not apply"]),
    ("wan21_t2v_flow_grpo_temporal.yaml", lambda t: t["reward"].update(name="pickscore", weights={"pickscore": 1}),
     ["scores images", "per_frame"]),
    ("sd35m_flow_grpo_pickscore.yaml", lambda t: t["model"].update(attention="flash-attn"),
     ["model.attention must be one of"]),
    ("sd35m_flow_grpo_pickscore.yaml", lambda t: t["model"].update(family="sd4"), ["unknown model family 'sd4'"]),
    ("chess_ddpo.yaml", lambda t: t["model"].update(gradient_checkpointing=True), ["model.gradient_checkpointing"]),
    ("sd35m_flow_grpo_pickscore.yaml", lambda t: t["eval"].update(extra_rewards=["aesthetic"]),
     ["eval.extra_rewards[0]", "mlp_path"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_recipe_fails_the_dry_run_naming_the_key(recipe, edit, expected, tmp_path, no_loading, capsys):
    assert main(["train", _variant(tmp_path, recipe, edit), "--dry-run"]) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err


def test_missing_local_inputs_and_a_missing_model_folder_are_errors(tmp_path, no_loading, capsys,
                                                                               monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)
    assert main(["train", "configs/sd15_ddpo_aesthetic.yaml", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "warning: reward 'aesthetic': mlp_path='./weights/sac+logos+ava1-l14-linearMSE.pth' does not exist" in out
    assert "reward.kwargs.mlp_path ./weights/sac+logos+ava1-l14-linearMSE.pth" in err  # the file, and where from:
    assert "christophschuhmann/improved-aesthetic-predictor" in err and err.count("\n") == 1
    bad = _variant(tmp_path, "shapes_flow_grpo.yaml", lambda t: t["model"].update(path=str(tmp_path / "nowhere")))
    assert main(["train", bad, "--dry-run"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_the_real_model_recipes_mirror_the_published_setups():
    flow = {name: load_config(CONFIGS / f"sd35m_flow_grpo_{name}.yaml") for name in ("geneval", "ocr", "pickscore")}
    for c in flow.values():  # yifan123/flow_grpo config/grpo.py + scripts/train_sd3.py
        assert (c.model.lora_rank, c.model.lora_alpha, c.train.learning_rate) == (32, 64.0, 3e-4)
        assert (c.sampling.num_steps, c.eval.num_steps, c.sampling.eta, c.sampling.guidance_scale) == (10, 40, 0.7, 4.5)
        assert (c.train.group_size, c.train.clip_range, c.model.height, c.model.kwargs) == (
            24, 1e-4, 512, {"max_sequence_length": 128})
    assert [flow[n].train.kl_beta for n in ("geneval", "ocr", "pickscore")] == [0.04, 0.04, 0.01]
    dance = load_config(CONFIGS / "flux_dev_dance_grpo_hps.yaml")  # DanceGRPO finetune_flux_grpo.sh
    assert (dance.model.lora_rank, dance.train.learning_rate, dance.sampling.num_steps, dance.sampling.eta,
            dance.train.group_size, dance.sampling.fraction, dance.sampling.guidance_scale) == (
        0, 1e-5, 16, 0.3, 12, 0.6, 3.5)
    wan = load_config(CONFIGS / "wan21_t2v_flow_grpo_temporal.yaml")  # flow_grpo general_ocr_wan2_1()
    assert (wan.model.num_frames, wan.model.height, wan.model.width, wan.sampling.num_steps, wan.eval.num_steps,
            wan.train.kl_beta, wan.train.clip_range, wan.reward.name) == (
        33, 240, 416, 20, 50, 0.004, 1e-3, "temporal_consistency")
    for name in ("aesthetic", "compressibility"):  # kvablack/ddpo-pytorch config/base.py, dgx.py
        ddpo = load_config(CONFIGS / f"sd15_ddpo_{name}.yaml")
        assert (ddpo.method, ddpo.sampling.num_steps, ddpo.sampling.eta, ddpo.sampling.guidance_scale,
                ddpo.train.clip_range, ddpo.train.per_prompt_stats) == ("ddpo", 50, 1.0, 5.0, 1e-4, True)
