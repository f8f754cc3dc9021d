"""The SD3 adapter against plain diffusers: same numbers, LoRA round trip, clear load errors."""

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from pipelines.base import ModelNotFoundError
from pipelines.sd3 import SD3Adapter

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a blue triangle"]


def _pipeline(path):
    return StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)


def _adapter_images(adapter, prompts, steps, guidance, seed):
    schedule = adapter.schedule(steps)
    noise = adapter.initial_noise(len(prompts), torch.Generator().manual_seed(seed))
    plan = plan_steps(steps, len(prompts), eta=0.0)
    traj = rollout(adapter, adapter.encode(prompts), noise, schedule, plan, guidance_scale=guidance)
    return adapter.decode(traj.samples)


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_eta_zero_rollout_reproduces_the_pipeline(tiny_sd3_dir, tiny_adapter, guidance):
    pipe = _pipeline(tiny_sd3_dir)
    expected = pipe(PROMPTS, num_inference_steps=6, guidance_scale=guidance, output_type="pt",
                    generator=torch.Generator().manual_seed(3), max_sequence_length=1,
                    height=tiny_adapter.height, width=tiny_adapter.width).images
    got = _adapter_images(tiny_adapter, PROMPTS, 6, guidance, seed=3)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5


def test_rollout_differs_from_pipeline_when_guidance_differs(tiny_sd3_dir, tiny_adapter):
    # guards the test above: a mismatch in CFG would be visible at this tolerance
    pipe = _pipeline(tiny_sd3_dir)
    expected = pipe(PROMPTS, num_inference_steps=6, guidance_scale=4.5, output_type="pt",
                    generator=torch.Generator().manual_seed(3), max_sequence_length=1,
                    height=tiny_adapter.height, width=tiny_adapter.width).images
    got = _adapter_images(tiny_adapter, PROMPTS, 6, 3.0, seed=3)
    assert (got - expected).abs().max().item() > 1e-3


def test_saved_lora_loads_in_plain_diffusers_and_changes_output(tiny_sd3_dir, tmp_path):
    adapter = SD3Adapter.from_pretrained(str(tiny_sd3_dir))
    adapter.add_lora(rank=4)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    adapter.save_trained(tmp_path / "lora")

    kwargs = dict(num_inference_steps=4, output_type="pt", max_sequence_length=1, guidance_scale=1.0,
                  height=adapter.height, width=adapter.width)
    pipe = _pipeline(tiny_sd3_dir)
    before = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(tmp_path / "lora")
    after = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), **kwargs).images
    assert (after - before).abs().max() > 1e-3
    # and it is the same function the adapter trained
    ours = _adapter_images(adapter, PROMPTS, 4, 1.0, seed=0)
    assert (ours - after).abs().max().item() <= 1e-4


def test_reference_context_disables_the_lora(tiny_adapter):
    tiny_adapter.add_lora(rank=4)
    with torch.no_grad():
        for name, p in tiny_adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    cond = tiny_adapter.encode(PROMPTS)
    x = tiny_adapter.initial_noise(3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = tiny_adapter.predict(x, torch.tensor(500.0), cond)
        with tiny_adapter.reference():
            reference = tiny_adapter.predict(x, torch.tensor(500.0), cond)
        again = tiny_adapter.predict(x, torch.tensor(500.0), cond)
    assert (trained - reference).abs().max() > 1e-3
    assert torch.equal(trained, again)


def test_missing_local_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        SD3Adapter.from_pretrained(str(missing))


def test_unreachable_hub_id_says_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="no local folder"):
        SD3Adapter.from_pretrained("someone/not-a-real-model")
