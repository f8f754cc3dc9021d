"""Training set-up options: starting from an existing LoRA (``model.init_lora``, diffusers' or
peft's folder), 8-bit AdamW (``train.optimizer: adamw8bit``, bitsandbytes) and the TF32 switch
(``train.allow_tf32``), each bad input refused before any model loads."""

import logging
import sys

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.model_setup import check_bitsandbytes, read_lora, set_tf32
from flowalign.trainer import Trainer
from helpers import tiny_config


def outputs(adapter) -> torch.Tensor:
    """The denoiser's prediction [B, C, h, w] on fixed inputs: what "the same model" means here."""
    generator = torch.Generator().manual_seed(1)
    cond = adapter.encode(["a red circle", "two blue squares"])
    x = torch.randn(2, *adapter.latent_shape(), generator=generator)
    with torch.no_grad():
        return adapter.predict(x, torch.tensor([0.7, 0.3]), cond)


@pytest.fixture(scope="module")
def trained_run(tiny_sd3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer = Trainer(tiny_config(tiny_sd3_dir, out, "train.epochs=1", "train.learning_rate=1e-2"))
    trainer.train()
    return trainer, out


def test_a_runs_final_lora_as_init_gives_the_trained_models_outputs_at_step_0(trained_run, tiny_sd3_dir, tmp_path):
    trained, out = trained_run
    want = outputs(trained.adapter)
    # lora_rank 8 asked for, the file's rank 4 used: the folder's config wins (and says so)
    fresh = Trainer(tiny_config(tiny_sd3_dir, tmp_path, f"model.init_lora={out / 'final'}", "model.lora_rank=8"))
    state = fresh.adapter.trained_state_dict()
    assert set(state) == set(trained.adapter.trained_state_dict())
    for key, value in trained.adapter.trained_state_dict().items():
        assert torch.equal(state[key], value), key
    assert all(p.requires_grad for p in fresh.params) and len(fresh.params) == len(state)
    torch.testing.assert_close(outputs(fresh.adapter), want, rtol=0, atol=0)
    untrained = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "plain"))  # the check can fail: a random LoRA differs
    assert not torch.allclose(outputs(untrained.adapter), want)
    fresh.train()  # and it trains on from there
    assert fresh.history[0]["reward/mean"] == fresh.history[0]["reward/mean"]


def test_a_peft_adapter_folder_as_init(trained_run, tiny_sd3_dir, tmp_path):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    trained, _ = trained_run
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer")
    meta = trained.adapter.lora_metadata()
    peft_model = get_peft_model(base, LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                                                 target_modules=list(meta["target_modules"])))
    loaded = set_peft_model_state_dict(peft_model, {f"base_model.model.{k}": v  # a PeftModel's naming
                                                    for k, v in trained.adapter.trained_state_dict().items()})
    assert not loaded.unexpected_keys
    peft_model.save_pretrained(tmp_path / "peft")  # peft's own layout: adapter_config.json + adapter_model.safetensors
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
    config, state = read_lora(tmp_path / "peft", "transformer")
    assert config["r"] == 4 and set(state) == set(trained.adapter.trained_state_dict())
    fresh = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "out", f"model.init_lora={tmp_path / 'peft'}"))
    torch.testing.assert_close(outputs(fresh.adapter), outputs(trained.adapter), rtol=0, atol=0)


def test_bad_init_lora_is_refused_before_any_model_loads(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=r"override 'model.init_lora=.*': model.init_lora: no folder"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, f"model.init_lora={tmp_path / 'nope'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"neither pytorch_lora_weights.safetensors .* nor adapter_config.json"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, f"model.init_lora={tmp_path / 'empty'}"))
    with pytest.raises(ConfigError, match=r"model.init_lora needs model.lora_rank > 0"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, f"model.init_lora={tmp_path / 'empty'}", "model.lora_rank=0"))


def test_a_lora_of_another_model_is_refused_naming_the_missing_weights(trained_run, tiny_sd3_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, out = trained_run
    with safe_open(str(out / "final" / "pytorch_lora_weights.safetensors"), "pt") as f:
        state, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    (tmp_path / "cut").mkdir()  # the same config (targets: every attention projection), block 0's weights gone
    save_file({k: v for k, v in state.items() if ".0." not in k}, tmp_path / "cut" / "pytorch_lora_weights.safetensors",
              metadata=metadata)
    with pytest.raises(ConfigError, match=r"does not fit this model: \d+ LoRA weights missing .*transformer_blocks.0"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path / "o", f"model.init_lora={tmp_path / 'cut'}"))


def test_adamw8bit_without_bitsandbytes_fails_before_the_model_loads(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes → ImportError
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=r"train.optimizer: adamw8bit needs bitsandbytes, which does not import "
                                          r".*pip install bitsandbytes"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "model.lora_rank=0", "train.optimizer=adamw8bit"))
    with pytest.raises(ConfigError, match=r"train.optimizer must be one of adamw, adamw8bit, got 'sgd'"):
        tiny_config(tiny_sd3_dir, tmp_path, "train.optimizer=sgd")


def test_a_bitsandbytes_that_imports_but_cannot_step_here_is_refused_naming_why(tiny_sd3_dir, tmp_path, monkeypatch):
    import types

    def no_kernel(*args, **kwargs):  # what a build without this device's kernels does on its first step
        raise RuntimeError("no 8-bit optimizer kernel for this device")

    fake = types.ModuleType("bitsandbytes")
    fake.__version__, fake.optim = "0.0-test", types.SimpleNamespace(AdamW8bit=no_kernel)
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=r"train.optimizer: bitsandbytes 0.0-test cannot run AdamW8bit on cpu here "
                                          r"\(RuntimeError: no 8-bit optimizer kernel .*\); use train.optimizer=adamw"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "model.lora_rank=0", "train.optimizer=adamw8bit"))


def test_adamw8bit_full_fine_tuning_step(tiny_sd3_dir, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    try:
        check_bitsandbytes()
    except ConfigError as error:
        pytest.skip(str(error))
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "model.lora_rank=0", "train.optimizer=adamw8bit",
                                  "train.epochs=1"))
    assert isinstance(trainer.optimizer.optimizer, bnb.optim.AdamW8bit)
    before = {k: v.clone() for k, v in trainer.adapter.trained_state_dict().items()}
    trainer.train()
    after = trainer.adapter.trained_state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    states = [s for s in trainer.optimizer.optimizer.state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # the big matrices' moments are 8-bit
    resumed = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "model.lora_rank=0", "train.optimizer=adamw8bit",
                                  "train.epochs=2", "resume=auto"))  # its 8-bit state saved and read back
    resumed.train()
    assert resumed.epoch == 2 and resumed.history[0] == trainer.history[0]  # epoch 1 restored, epoch 2 trained
    moments = {id(p): s for p, s in resumed.optimizer.optimizer.state.items()}
    assert any(s.get("state1") is not None and s["state1"].dtype == torch.uint8 for s in moments.values())


def test_tf32_is_set_on_cuda_and_a_logged_no_op_elsewhere(caplog):
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert set_tf32(False, "cpu") is None
    with caplog.at_level(logging.INFO, logger="flowalign"):
        line = set_tf32(True, "cpu")
    assert line == "train.allow_tf32: the run is on cpu, not CUDA; nothing to set" and line in caplog.text
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
    try:  # the flags are process-wide settings (no CUDA needed to set them): set, read back, restored
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert set_tf32(True, "cuda:0") == "train.allow_tf32: float32 matmuls and convolutions run in TF32"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_the_dry_run_says_where_the_lora_starts_and_which_optimizer(trained_run, capsys):
    from pathlib import Path

    from flowalign.cli import main

    _, out = trained_run
    recipe = Path(__file__).resolve().parents[1] / "configs" / "shapes_nft.yaml"
    assert main(["train", str(recipe), f"model.init_lora={out / 'final'}", "train.allow_tf32=true",
                 "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"started from {out / 'final'} with its own rank, alpha and targets" in text
    assert "AdamW lr 0.0003, TF32 on CUDA" in text
