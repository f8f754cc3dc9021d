"""The newer text-to-image families through the real trainer (what ``flowalign train`` runs): every
flow objective trains tiny offline models saved to folders, exactly on policy at init; GDRO on
pre-generated groups; the trained LoRA loads in plain diffusers and reproduces the trainer's samples."""

import math

import pytest
import torch
from test_zoo_adapters import VARIANTS

from flowalign.config import load_config
from flowalign.offline import generate_groups
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits (conftest)

PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
STEPS = 3
# every objective a flow model trains with: Flow-GRPO with each of the three SDE steps, DiffusionNFT
METHODS = {
    "flow_grpo": ["method=flow_grpo", "sampling.sde=flow_grpo", "train.kl_beta=0.1"],
    "cps": ["method=flow_grpo", "sampling.sde=cps", "train.kl_beta=0.1"],
    "dance_grpo": ["method=dance_grpo", "sampling.sde=dance_grpo"],  # no reference model: KL 0 by definition
    "diffusion_nft": ["method=diffusion_nft", "train.kl_beta=0.1"],
}
JPEG = ["reward.name=jpeg_compressibility", "reward.weights={jpeg_compressibility: 1.0}"]
RUNS = [(family, method) for family in sorted(VARIANTS) for method in METHODS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family → folder of its tiny random pipeline (save_pretrained), and the prompt file."""
    root = tmp_path_factory.mktemp("zoo-training")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    for name, variant in VARIANTS.items():
        variant.build().save_pretrained(root / name)
    return root


def run_config(folders, out, name, *overrides):
    """One epoch of 2 groups × 2 samples, one minibatch (every statistic at the initial weights)."""
    variant = VARIANTS[name]
    sizes = [f"model.{k}={v}" for k, v in variant.sizes.items()]
    kwargs = ", ".join(f"{k}: {v}" for k, v in variant.adapter_kwargs.items())  # YAML flow mapping
    return load_config(None, [
        f"output_dir={out}", f"model.family={variant.family}", f"model.path={folders / name}", "model.lora_rank=4",
        *sizes, f"model.kwargs={{{kwargs}}}", f"sampling.guidance_scale={variant.guidance}", "tracker=none",
        f"sampling.num_steps={STEPS}", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=2",
        "train.sample_batch_size=4", "train.train_batch_size=4", "train.noise_draws=2", "train.learning_rate=1e-2",
        f"data.train_prompts={folders / 'prompts.txt'}", f"data.eval_prompts={folders / 'prompts.txt'}",
        "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0",
        *JPEG, *overrides])


def _train(config) -> tuple[Trainer, list[torch.Tensor]]:
    trainer = Trainer(config)
    initial = [p.detach().clone() for p in trainer.params]
    trainer.train()
    return trainer, initial


def _assert_trained(trainer, initial):
    stats = trainer.history[0]
    assert math.isfinite(stats["train/policy_loss"]) and stats["train/skipped_nonfinite"] == 0
    assert stats["train/grad_norm"] > 0
    assert any((p.detach() - p0).abs().max() > 0 for p, p0 in zip(trainer.params, initial))
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert (trainer.out / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("name, method", RUNS, ids=["-".join(r) for r in RUNS])
def test_each_objective_trains_on_policy_with_zero_kl_at_init(folders, tmp_path, name, method):
    trainer, initial = _train(run_config(folders, tmp_path, name, *METHODS[method]))
    _assert_trained(trainer, initial)
    stats = trainer.history[0]
    assert stats["train/kl"] == 0.0  # a fresh LoRA is the identity: policy = reference
    if method == "diffusion_nft":  # the old policy samples and anchors; at init it is the current one
        assert stats["train/old_decay"] == 0.0 and stats["train/nft_positive"] == pytest.approx(
            stats["train/nft_negative"], rel=1e-6)
    else:  # one minibatch, rescored by the weights that sampled it
        assert stats["train/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert stats["train/approx_kl"] < 1e-12 and stats["train/clipfrac"] == 0.0
    assert math.isfinite(stats["reward/jpeg_compressibility"]) and stats["reward/std"] > 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gdro_trains_on_pregenerated_groups(folders, tmp_path, name):
    gdro = ["method=gdro", "sampling.eta=0.0", f"data.offline_groups={tmp_path / 'groups'}"]
    generate_groups(run_config(folders, tmp_path / "gen", name, *gdro), 2)
    trainer, initial = _train(run_config(folders, tmp_path / "run", name, *gdro))
    _assert_trained(trainer, initial)
    assert trainer.history[0]["train/gdro_score_gap"] == 0.0  # policy = reference: every implicit reward is 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_trained_lora_is_saved_in_diffusers_format(folders, tmp_path, name):
    variant = VARIANTS[name]
    trainer, initial = _train(run_config(folders, tmp_path, name, *METHODS["flow_grpo"]))
    _assert_trained(trainer, initial)
    adapter, guidance = trainer.adapter, variant.guidance
    pipe = type(adapter.pipe).from_pretrained(folders / name)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(tmp_path / "final")
    expected = pipe(prompt=list(PROMPTS), num_inference_steps=STEPS, output_type="latent",
                    generator=torch.Generator().manual_seed(7), **variant.adapter_kwargs, **variant.sizes, **variant.guided(guidance)).images

    def samples(noise):
        x = rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(STEPS), plan_steps(STEPS, 2, 0.0),
                    guidance_scale=guidance).samples
        return variant.latents(adapter, x)

    noise = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(7))
    assert (samples(noise) - expected).abs().max().item() <= 1e-5
    with adapter.reference():  # guards the comparison: the base model's samples differ at this tolerance
        assert (samples(noise) - expected).abs().max().item() > 1e-4
