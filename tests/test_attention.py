"""Memory settings: the attention backend (auto | sdpa | xformers, with its one-line CPU fallback),
gradient checkpointing and ``model.kwargs``, through the one loader every command uses."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowalign.cli import main
from flowalign.config import ConfigError, load_config
from pipelines import adapter_options, check_adapter_options, load_adapter
from pipelines.attention import resolve_attention, uses_sdpa


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Counts calls of torch's scaled_dot_product_attention (diffusers' processors look it up per call)."""
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def _forward(adapter, calls: list):
    """One denoiser pass; ``calls`` holds only its SDPA calls (not the text encoders')."""
    x = adapter.initial_noise(1, torch.Generator().manual_seed(0))
    cond = adapter.encode(["a red square"])
    calls.clear()
    with torch.no_grad():
        return adapter.predict(x, adapter.schedule(2).timesteps[0], cond)


def test_resolution_rules(monkeypatch):
    assert resolve_attention("sdpa", "cpu") == ("sdpa", None)
    assert resolve_attention("auto", "cpu") == ("sdpa", None)  # the expected case on a CPU: silent
    backend, message = resolve_attention("xformers", "cpu")
    assert backend == "sdpa" and "falling back to sdpa" in message and "\n" not in message
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "xformers is not installed" in resolve_attention("xformers", "cuda")[1]
    assert "no xformers attention path" in resolve_attention("xformers", "cpu", family_supports=False)[1]
    with pytest.raises(ValueError, match="auto, sdpa, xformers"):
        resolve_attention("flash_attention_9", "cpu")  # not a backend (diffusers dispatcher names are)


def test_xformers_on_cpu_falls_back_to_sdpa_with_one_line(tiny_sd3_dir, capsys, sdpa_calls):
    adapter = load_adapter("sd3", str(tiny_sd3_dir), attention="xformers")
    lines = [line for line in capsys.readouterr().err.splitlines() if "attention" in line]  # not the progress bars
    assert len(lines) == 1 and lines[0].startswith("flowalign: attention: xformers requested but")
    assert "falling back to sdpa" in lines[0]
    assert adapter.attention == "sdpa" and uses_sdpa(adapter.model)
    _forward(adapter, sdpa_calls)
    assert len(sdpa_calls) == adapter.model.config.num_layers  # every joint-attention block called SDPA


def test_sdpa_and_auto_are_silent_and_use_sdpa(tiny_sd3_dir, capsys):
    for attention in ("sdpa", "auto"):
        adapter = load_adapter("sd3", str(tiny_sd3_dir), attention=attention)
        assert adapter.attention == "sdpa" and uses_sdpa(adapter.model) and uses_sdpa(adapter.pipe.vae)
    assert "attention" not in capsys.readouterr().err


def test_uses_sdpa_tells_the_unfused_processor_apart(tiny_sd3_dir):
    from diffusers.models.attention_processor import AttnProcessor

    adapter = load_adapter("sd3", str(tiny_sd3_dir))
    adapter.pipe.vae.set_attn_processor(AttnProcessor())
    assert uses_sdpa(adapter.model) and not uses_sdpa(adapter.pipe.vae)


def test_model_kwargs_reach_the_adapter_and_bad_ones_are_named(tiny_sd3_dir):
    assert set(adapter_options("sd3")) == {"max_sequence_length", "vae_tiling", "vae_slicing"}
    assert "true_cfg_scale" in adapter_options("flux") and "negative_prompt" in adapter_options("wan")
    assert adapter_options("chess") == {}
    adapter = load_adapter("sd3", str(tiny_sd3_dir), options={"max_sequence_length": 7, "vae_slicing": True})
    assert adapter.max_sequence_length == 7 and adapter.pipe.vae.use_slicing
    with pytest.raises(ValueError, match="'max_seq_len' is not an option of SD3Adapter.*max_sequence_length"):
        load_adapter("sd3", str(tiny_sd3_dir), options={"max_seq_len": 7})
    with pytest.raises(ValueError, match="'true_cfg_scale' of FluxAdapter must be float"):
        check_adapter_options("flux", {"true_cfg_scale": "4"})
    check_adapter_options("flux", {"true_cfg_scale": 4})  # an int is a float here, as in the config


def tiny_config(model, out, *overrides):
    return load_config(None, [
        f"output_dir={out}", f"model.path={model}", "model.lora_rank=4", "tracker=none", "sampling.num_steps=4",
        "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
        "train.train_batch_size=8", "eval.seeds=1", "eval.every=0", "checkpoint_every=0", *overrides])


def test_the_trainer_wires_attention_checkpointing_and_kwargs(tiny_sd3_dir, tmp_path, capsys):
    from flowalign.trainer import Trainer

    config = tiny_config(tiny_sd3_dir, tmp_path, "model.attention=xformers", "model.gradient_checkpointing=true",
                         "model.kwargs={max_sequence_length: 5}")
    trainer = Trainer(config)
    assert trainer.adapter.model.is_gradient_checkpointing
    assert trainer.adapter.max_sequence_length == 5 and trainer.adapter.attention == "sdpa"
    assert capsys.readouterr().err.count("falling back to sdpa") == 1
    with pytest.raises(ConfigError, match="model.kwargs.max_seq_len"):  # before any weight loads
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, "model.kwargs={max_seq_len: 5}"))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_sd3_dir):
    """One flow-matching step through the transformer, with and without checkpointing."""
    grads = []
    for checkpointing in (False, True):
        adapter = load_adapter("sd3", str(tiny_sd3_dir))
        adapter.model.requires_grad_(True)
        if checkpointing:
            adapter.enable_gradient_checkpointing()
        adapter.model.train()
        g = torch.Generator().manual_seed(1)
        x0, noise = adapter.initial_noise(2, g), adapter.initial_noise(2, g)
        sigma = torch.tensor([0.3, 0.8]).view(-1, 1, 1, 1)
        v = adapter.predict((1 - sigma) * x0 + sigma * noise, sigma.flatten() * 1000, adapter.encode(["a", "b"]))
        F.mse_loss(v, noise - x0).backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter.model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_sampling_commands_take_the_model_settings(tiny_sd3_dir, tmp_path, capsys):
    assert main(["sample", "--model", str(tiny_sd3_dir), "--model-kwargs", "{max_seq_len: 3}", "x",
                 "--out", str(tmp_path / "s.png")]) == 2
    assert "model.kwargs.max_seq_len" in capsys.readouterr().err
    recipe = Path(__file__).resolve().parents[1] / "configs" / "sd15_ddpo_aesthetic.yaml"
    assert main(["grid", "--config", str(recipe), "--model", str(tiny_sd3_dir),
                 "--family", "sd3", "--model-kwargs", "[1, 2]", "--prompt", "x"]) == 2
    assert "--model-kwargs must be a mapping" in capsys.readouterr().err


def test_config_defaults():
    config = load_config(None)
    assert config.model.attention == "auto" and config.model.kwargs == {} and not config.model.gradient_checkpointing


def test_memory_benchmark_measures_one_step_per_backend():
    """scripts/benchmark_memory.py's child on a tiny transformer (the full run: docs/memory.md)."""
    from script_module import load_script

    bench = load_script("benchmark_memory")
    tiny = ["--device", "cpu", "--latent", "8", "--text", "4", "--layers", "1", "--heads", "2", "--head-dim", "8",
            "--batch", "1", "--lora-rank", "2", "--warmup", "0", "--steps", "1"]
    rows = [bench.run_child(bench.parse_args([*tiny, "--child", child])) for child in ("math:0", "sdpa:1")]
    assert [(r["backend"], r["gradient_checkpointing"]) for r in rows] == [("math", False), ("sdpa", True)]
    assert all(r["step_s"] > 0 and r["attention_processor"] == "JointAttnProcessor2_0" for r in rows)
    assert rows[0]["trainable_params"] < rows[0]["params"]  # LoRA only
    assert "| math | off |" in bench.table(rows) and "| sdpa | on |" in bench.table(rows)
    assert bench.available_backends(["math", "sdpa", "xformers"], "cpu")[0] == ["math", "sdpa"]


def test_sampling_commands_set_the_thread_count_as_a_run_does(tiny_sd3_dir, tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["sample", "--model", str(tiny_sd3_dir), "x", "--seeds", "0", "--steps", "2",
                     "--out", str(tmp_path / "s.png")]) == 0
        assert torch.get_num_threads() == 1  # no --config, no --threads: 1, the run's default
        assert main(["sample", "--model", str(tiny_sd3_dir), "x", "--seeds", "0", "--steps", "2", "--threads", "2",
                     "--out", str(tmp_path / "t.png")]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
