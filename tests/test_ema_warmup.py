"""The EMA's warm-up follows diffusers' EMAModel.get_decay, so a short run's final/ holds weights
near the trained ones instead of near the start; a run shorter than the EMA's horizon says so."""

import logging

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.ema import EMA, decay_at, horizon
from flowalign.trainer import Trainer


@pytest.mark.parametrize("warmup, use_ema_warmup", [("diffusers", False), ("power", True)])
def test_the_decay_is_diffusers_ema_models(warmup, use_ema_warmup):
    from diffusers.training_utils import EMAModel

    reference = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=0.98, use_ema_warmup=use_ema_warmup)
    for step in range(1, 600):
        assert decay_at(step, 0.98, warmup) == pytest.approx(reference.get_decay(step), abs=1e-12), step
    assert decay_at(1, 0.98, "none") == decay_at(500, 0.98, "none") == 0.98 and horizon(0.98) == pytest.approx(50)


def test_the_average_equals_diffusers_ema_model_step_by_step():
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    ours, theirs = EMA([param], 0.98, "diffusers"), EMAModel([param], decay=0.98)
    for _ in range(7):
        with torch.no_grad():
            param.add_(torch.randn(5))
        ours.update()
        theirs.step([param])
    assert torch.allclose(ours.shadow[0], theirs.shadow_params[0], atol=1e-6)
    restored = EMA([param], 0.98, "diffusers")
    restored.load_state_dict(ours.state_dict())
    assert restored.steps == 7  # checkpointed: a resumed run continues the warm-up where it was


def _short_run(tiny_sd3_dir, out, warmup: str) -> tuple[float, float]:
    """4 optimizer steps (2 epochs × 8 samples / 4 per step), EMA decay 0.98: ‖LoRA-B‖ of final/
    (the average) and of the last checkpoint's raw weights (LoRA-B starts at zero)."""
    Trainer(load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=4", "train.learning_rate=1e-3",
        "train.ema_decay=0.98", f"train.ema_warmup={warmup}", "eval.seeds=1", "eval.grid_prompts=1",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0"])).train()

    def b_norm(path) -> float:
        tensors = load_file(str(path))
        return sum(float(v.float().pow(2).sum()) for k, v in tensors.items() if "lora_B" in k) ** 0.5

    last = sorted((out / "checkpoints").iterdir())[-1]
    return b_norm(out / "final" / "pytorch_lora_weights.safetensors"), b_norm(last / "trained.safetensors")


def test_a_4_step_runs_final_weights_are_near_the_raw_ones_and_the_run_warns(tiny_sd3_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flowalign"):
        final, raw = _short_run(tiny_sd3_dir, tmp_path / "warm", "diffusers")
    assert raw > 0 and final / raw >= 0.8  # stated: within 20 % of the raw weights' distance from the start
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ema_decay" in r.message]
    assert len(warning) == 1 and "~50 optimizer steps, but this run took 4" in warning[0]
    assert "\n" not in warning[0]


def test_without_the_warm_up_final_stays_near_the_start(tiny_sd3_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flowalign"):
        final, raw = _short_run(tiny_sd3_dir, tmp_path / "cold", "none")
    assert final / raw < 0.2  # the old behaviour: 0.98^4 of the average is still the start
    assert any("the initial weights still weigh 92% in it" in r.getMessage() for r in caplog.records)
