"""The model card of a run on the built-in demo model: huggingface_hub reads its front matter
(license, base_model, pipeline_tag, tags, widget), its "Use" snippet runs as printed on the run's
output, and its run config repeats the run. Cards of real-model recipes (no weights loaded)
carry their base's license."""

import os
import re
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard

from flowalign.config import load_config, to_dict
from flowalign.model_card import card_data, use_snippet
from flowalign.trainer import Trainer


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "demo-card-run"
    Trainer(load_config("configs/shapes_nft.yaml", [
        f"output_dir={out}", "tracker=none", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=2",
        "train.sample_batch_size=4", "train.train_batch_size=4", "eval.seeds=1", "eval.grid_prompts=2",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0"])).train()
    return out


def test_the_front_matter_as_huggingface_hub_reads_it(demo_run):
    card = ModelCard.load(demo_run / "final" / "README.md")
    data = card.data
    assert data.license == "apache-2.0"  # the built-in demo ships under the repository's license
    assert data.base_model == "shapes-sd3" and "flowalign's built-in demo model" in card.text
    assert data.pipeline_tag == "text-to-image" and data.library_name == "diffusers"
    assert {"lora", "flowalign", "diffusion_nft", "sd3"} <= set(data.tags)
    prompt = (demo_run / "grids" / "after.txt").read_text().splitlines()[0].split(": ", 1)[1]
    assert data.widget == [{"text": prompt, "output": {"url": "before_after.png"}}]
    assert (demo_run / "final" / "before_after.png").is_file()
    assert "| accuracy |" in card.text and "THIS_REPO" not in card.text


def test_the_use_snippet_runs_as_printed_on_the_runs_output(demo_run, tmp_path):
    text = (demo_run / "final" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    code = blocks[0]
    assert f'pipe.load_lora_weights("{demo_run / "final"}")' in code and "dtype=torch.float32" in code
    assert "text_encoder_3=None, tokenizer_3=None" in code  # visibly: what the demo's model_index.json leaves out
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    from PIL import Image

    assert Image.open(tmp_path / "sample.png").size == (32, 32)


def test_the_shipped_config_repeats_the_run(demo_run):
    shipped = load_config(demo_run / "final" / "flowalign_config.yaml")
    original = load_config("configs/shapes_nft.yaml", [f"output_dir={demo_run}", "tracker=none"])
    assert to_dict(shipped)["train"]["epochs"] == 1 and to_dict(shipped)["model"] == to_dict(original)["model"]
    assert to_dict(shipped)["output_dir"] == str(demo_run)


def test_a_flux_dev_fine_tune_carries_its_non_commercial_license():
    config = load_config("configs/flux_dev_dance_grpo_hps.yaml")
    data = card_data(config, "a fox", with_grid=True)
    assert data.license == "other" and data.license_name == "flux-1-dev-non-commercial-license"
    assert data.license_link.endswith("FLUX.1-dev/blob/main/LICENSE.md")
    assert data.base_model == "black-forest-labs/FLUX.1-dev"
    assert "base_model:finetune:black-forest-labs/FLUX.1-dev" in data.tags  # DanceGRPO's recipe: full fine-tuning
    code = use_snippet(config, "me/flux-dance", "a fox")
    assert f'DiffusionPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", dtype=torch.{config.model.dtype})' in code
    assert 'from_pretrained("me/flux-dance", subfolder=\'transformer\'' in code
    lora = card_data(load_config("configs/sd35m_flow_grpo_pickscore.yaml"), None, False)
    assert lora.license_name == "stabilityai-ai-community" and "lora" in lora.tags
    assert "base_model:adapter:stabilityai/stable-diffusion-3.5-medium" in lora.tags


def test_model_license_overrides_and_an_unknown_base_says_so(tmp_path):
    config = load_config("configs/sd35m_flow_grpo_pickscore.yaml", ["model.license=mit"])
    assert card_data(config, None, False).license == "mit"
    unknown = load_config(None, ["model.path=someone/unknown-model"])
    assert card_data(unknown, None, False).license == "other"
    assert card_data(load_config("configs/wan21_t2v_flow_grpo_temporal.yaml"), None, False).pipeline_tag == \
        "text-to-video"


def test_the_pushed_card_loads_from_the_repo_and_names_no_base_the_hub_lacks(demo_run):
    from flowalign.hub import card_for_repo

    pushed = ModelCard(card_for_repo(demo_run / "final", "me/shapes-nft"))
    assert pushed.data.base_model is None  # the hub refuses a base_model that names no repository
    assert pushed.data.license == "apache-2.0" and "lora" in pushed.data.tags
    assert 'pipe.load_lora_weights("me/shapes-nft")' in pushed.text and str(demo_run) not in pushed.text
