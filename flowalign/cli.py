"""The flowalign command: train from a YAML recipe; compare policies in grids, eval tables and reports.

Examples:

    flowalign train configs/shapes_flow_grpo.yaml                     # the built-in demo
    flowalign train shapes_nft                                        # a built-in recipe by name (flowalign recipes)
    flowalign train configs/shapes_flow_grpo.yaml train.epochs=5 output_dir=runs/try
    flowalign train configs/sd35m_flow_grpo_pickscore.yaml --dry-run    # check a recipe, say what it loads
    flowalign generate-groups configs/shapes_gdro.yaml --groups 512 && flowalign train configs/shapes_gdro.yaml
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m flowalign.cli train CONFIG
    flowalign grid --policies base runs/shapes-flow-grpo --prompts shapes:test --out grid.png
    flowalign eval --policies base runs/shapes-flow-grpo/final --rewards shapes,jpeg_compressibility --out eval
    flowalign report runs/shapes-flow-grpo --eval eval
    flowalign push runs/shapes-flow-grpo --repo me/shapes-flow-grpo-lora   # final/ with its model card
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowalign import arguments as A

# Nothing heavy at the top: ``flowalign --help`` and ``flowalign train --help`` answer after parsing
# the arguments, before torch, diffusers or the trainer load (scripts/benchmark_cli_startup.py);
# each command imports what it needs.

CONFIG_KEYS_HELP = (
    "Where every config key is documented: `python -m flowalign.config_reference` prints the reference of "
    "every key (type, default, meaning, the rules; docs/config.md in the repository). Each key is defined "
    "and commented in flowalign/config.py (the sections model, sampling, data, reward, train, eval, explore, "
    "routing; CHOICES and check_values hold the rules that tie keys together); each method's own train.* "
    "options in its file flowalign/objectives/<method>.py; model.kwargs per family in pipelines/<family>.py "
    "(`flowalign train CONFIG --dry-run` checks them all); reward.kwargs in reward_models/<reward>.py.")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a recipe whose model section (family, path, dtype, attention, "
                                                  "size, kwargs) is used; the flags below override it")
    p.add_argument("--model", default=None, help="built-in demo name, local diffusers folder or hub id "
                                                 "(default: shapes-sd3)")
    p.add_argument("--family", default=None, help="adapter family (default: the one whose pipeline a local --model folder's "
                   "model_index.json names, else sd3)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default: float32)")
    p.add_argument("--attention", default=None, metavar="BACKEND",  # checked as model.attention, the config's choices
                   help="attention backend: auto (default: xformers on CUDA when installed, else sdpa), sdpa, xformers, "
                        "or a backend of diffusers' attention dispatcher (flash, sage, _native_cudnn, ...; model.attention)")
    p.add_argument("--model-kwargs", default=None, metavar="MAPPING",
                   help="adapter options as a YAML/JSON mapping, e.g. '{max_sequence_length: 256}' (model.kwargs)")
    p.add_argument("--steps", type=A.integer(1), default=None, help="sampling steps (default: 10 ODE steps; chess: 16 "
                                                           "unmasking steps)")
    p.add_argument("--guidance", type=A.number(0), default=1.0, help="classifier-free guidance scale")
    p.add_argument("--threads", type=A.integer(0), default=None,
                   help="torch CPU threads (default: --config's threads, else 1, as a run's; 0 = one per core). "
                        "Images depend on it, as a run's numbers do")
    p.add_argument("--seeds", default="0,1,2,3", type=A.seeds,
                   help="comma-separated seeds; the same seed gives the same initial noise under every policy "
                        "(eval: prompt i's seed s is row i·(max seed + 1) + s of a run's own evaluation noise, "
                        "flowalign.evaluation.held_out_noise)")


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", nargs="+", default=["base"], metavar="POLICY",
                   help="what to compare: 'base' (the untrained model), a run folder (each checkpoint, then "
                        "final), a checkpoint folder, or a trained-weights folder (final/, LoRA or full); "
                        "LABEL=FOLDER names it in tables and grids")


# Families whose `sample` command is their own (flowalign/<world>/command.py): FAMILY, add_sample_arguments
# (an argument group, shown under its own heading), refuse_options and sample. Light modules: --help stays fast.
FAMILY_COMMANDS = ("flowalign.chess.command",)


def _family_commands():
    import importlib

    return [importlib.import_module(name) for name in FAMILY_COMMANDS]


def _seeds(args) -> list[int]:
    return [int(s) for s in args.seeds.split(",")]


def _model_loading(args) -> tuple[str, str, dict]:
    """(model path, family, ``load_adapter`` settings) from --config's model section and the flags."""
    from flowalign.config import ConfigError, load_config, parse_override
    from flowalign.preflight import check_model

    from pipelines import folder_family

    from flowalign.untrusted import check_model_folder

    if args.model:  # a local folder: its index, configs and weight headers
        check_model_folder(args.model, "--model")
    family = args.family
    if family is None and args.config is None and args.model is not None:
        family = folder_family(args.model)  # a local folder names its pipeline: no --family needed
    overrides = [f"model.{k}={v}" for k, v in (("path", args.model), ("family", family), ("dtype", args.dtype),
                                                 ("attention", args.attention)) if v is not None]
    if args.model_kwargs is not None:
        _, kwargs = parse_override(f"x={args.model_kwargs}")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"--model-kwargs must be a mapping, e.g. '{{max_sequence_length: 256}}', got "
                              f"{args.model_kwargs!r}")
        overrides.append(f"model.kwargs={args.model_kwargs}")
    if args.threads is not None:
        overrides.append(f"threads={args.threads}")
    config = load_config(args.config, overrides)
    check_model(_sampling_only(config))
    if config.threads:  # before any tensor work, as the trainer does: the samples depend on the thread count
        import torch

        torch.set_num_threads(config.threads)
    model = config.model
    loading = {"dtype": model.dtype, "attention": model.attention, "options": model.kwargs, "height": model.height,
               "width": model.width, "num_frames": model.num_frames}
    return model.path, model.family, loading


def _sampling_only(config):
    """``config`` with a method that fits its family (the recipe's, else the first registered one
    that does): sampling commands train nothing, so the recipe's method must not fail the family check."""
    import dataclasses

    from flowalign.objectives.base import OBJECTIVES, methods
    from flowalign.preflight import adapter_for

    prediction = adapter_for(config).prediction
    fitting = [name for name in methods() if any(prediction in c.predictions for c in OBJECTIVES[name])]
    return config if config.method in fitting else dataclasses.replace(config, method=fitting[0])


def cmd_train(args) -> int:
    from flowalign.config import load_config
    from flowalign.faults import RunStopped
    from flowalign.api import train

    config = load_config(args.config, args.overrides)
    if args.dry_run:
        from flowalign.inputs import MissingInputs
        from flowalign.preflight import dry_run

        try:
            print(dry_run(config, args.config))
        except MissingInputs as error:  # the report, then the one-line error (exit 2)
            print(error.report)
            raise
        return 0
    try:
        with A.named_path(config.output_dir):  # a write fault without a path (a full disk mid-write) names the run
            summary = train(config)
    except RunStopped as error:  # a failing reward: say what is kept
        from flowalign.checkpoint import checkpoint_folders

        kept = checkpoint_folders(Path(config.output_dir) / "checkpoints")
        raise RunStopped(f"{error}. Kept: {kept[-1] if kept else 'no checkpoint yet'} (nothing was deleted); fix "
                         "the cause and continue with resume=auto") from None
    if summary.get("interrupted"):  # the trainer said where it stopped and how to continue
        return 0
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key in sorted(after):
        if isinstance(after[key], float) and isinstance(before.get(key), float):
            print(f"{key}: {before[key]:.4f} → {after[key]:.4f}")
    print(f"outputs in {config.output_dir} (metrics.json, grids/, final/)")
    return 0


def cmd_generate_groups(args) -> int:
    from flowalign.config import load_config
    from flowalign.group_generation import generate_groups

    config = load_config(args.config, args.overrides)
    with A.named_path(config.data.offline_groups or "data.offline_groups"):
        print(f"wrote {args.groups} groups to {generate_groups(config, args.groups)}")
    return 0


def _records(prompts: list[str], images: list[str] | None) -> list[dict]:
    """--prompt values as prompt records, each with its --image (one per prompt; several input images
    of one prompt separated by "|"), resolved as a prompt file's are (``flowalign.prompts``)."""
    from flowalign.config import ConfigError
    from flowalign.prompts import resolve_image

    if not images:
        return [{"prompt": p} for p in prompts]
    if len(images) != len(prompts):
        raise ConfigError(f"--image: one per --prompt (an image-conditioned family's input), got {len(images)} "
                          f"image(s) for {len(prompts)} prompt(s)")
    # relative paths: from the working directory (an error names "--image" where a prompt file is named)
    return [resolve_image({"prompt": p, "image": i}, Path.cwd() / "--image") for p, i in zip(prompts, images)]


def cmd_grid(args) -> int:
    import torch

    from flowalign.evaluation import load_policy, resolve_policies, sample_images
    from flowalign.grids import as_image_cells, labelled_grid, save_gif, save_grid, with_inputs

    if args.image and not args.prompt:
        raise FileNotFoundError("--image goes with --prompt (a prompt file's records carry their own \"image\")")
    A.output_file("--out", args.out)
    records = _records(args.prompt, args.image) if args.prompt else A.prompt_file(args.prompts)[: args.max_prompts]
    prompts = [r["prompt"] for r in records]
    inputs = [r.get("image") for r in records]
    seeds, policies = _seeds(args), resolve_policies(args.policies)
    model, family, loading = _model_loading(args)
    # records, not prompt strings: an image-conditioned family encodes each record's "image" with its prompt
    per_policy = [sample_images(load_policy(p, model, family, **loading), records, seeds, args.steps or 10,
                                args.guidance)
                  for p in policies]
    if per_policy[0].ndim == 5:  # videos: one GIF per cell next to the contact-sheet grid
        gif_dir = Path(args.out).with_suffix("")
        for policy, videos in zip(policies, per_policy):
            for k, video in enumerate(videos):
                r, s = divmod(k, len(seeds))
                save_gif(video, gif_dir / f"row{r}-{policy.label.replace('/', '_')}-seed{seeds[s]}.gif")
        print(f"wrote GIFs to {gif_dir}/")
    per_policy = [as_image_cells(samples) for samples in per_policy]
    # [P, R·S, ...] → row-major (prompt, policy, seed)
    images = torch.stack(per_policy).unflatten(1, (len(prompts), len(seeds))).transpose(0, 1).flatten(0, 2)
    columns = {p.label: [f"seed {s}" for s in seeds] for p in policies}
    if any(inputs):  # an image-conditioned task: each row's input first, beside its outputs
        images = with_inputs(images, inputs, len(policies) * len(seeds))
        columns = {"input": ["image"], **columns}
    with A.named_path(args.out):
        save_grid(labelled_grid(images, prompts, columns), args.out, prompts)
    print(f"wrote {args.out} ({len(prompts)} prompts × {len(policies)} policies × {len(seeds)} seeds)")
    return 0


def cmd_eval(args) -> int:
    from flowalign.evaluation import evaluate, is_change_key, metric_cell, resolve_policies

    from flowalign.faults import built_reward
    from flowalign.usage import reward_names

    A.output_folder("--out", args.out)
    names = reward_names(args.rewards, "--rewards")  # one line for an unknown name, before anything loads
    records = A.prompt_file(args.prompts)[: args.max_prompts]
    rewards = {name: built_reward(name, {}) for name in names}
    model, family, loading = _model_loading(args)
    summary = evaluate(resolve_policies(args.policies), records, rewards, args.out, model=model, family=family,
                       seeds=_seeds(args), steps=args.steps or 10, guidance=args.guidance, loading=loading)
    for label, entry in summary.items():
        print(label + ": " + ", ".join(f"{k} {metric_cell(entry, k)}" for k, v in entry.items()
                                       if isinstance(v, float) and not is_change_key(k)))
    if len(summary) > 1:
        print(f"(in brackets: the paired change against {next(iter(summary))} on the same prompts and seeds, "
              "± its standard error)")
    print(f"wrote {args.out}/summary.json, summary.csv, samples.jsonl")
    return 0


def cmd_report(args) -> int:
    from flowalign.report import build_report

    if args.out:
        A.output_file("--out", args.out, (".html", ".htm"))
    path = build_report(args.run, args.out, args.eval or [], args.image or [])
    print(f"wrote {path}")
    return 0


def cmd_reward_server(args) -> int:
    server = A.reward_server(args)  # arguments, token, the reward built, the address bound: one-line errors
    host, port = server.server_address[:2]
    print(f"serving reward {args.reward!r} on http://{host}:{port} (GET /health, POST /score); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_sample(args) -> int:
    seeds = _seeds(args)
    model, family, loading = _model_loading(args)
    for command in _family_commands():  # a family with a sample command of its own (its options grouped in --help)
        if command.FAMILY == family:
            return command.sample(args, model, loading, seeds)
        command.refuse_options(args, model, family)
    A.output_file("--out", args.out)
    from torchvision.utils import save_image

    from flowalign.evaluation import Policy, load_policy, sample_images

    policy = Policy("trained", args.weights) if args.weights else Policy("base", None)
    record = _records([args.prompt], [args.image] if args.image else None)
    images = sample_images(load_policy(policy, model, family, **loading), record, seeds, args.steps or 10,
                           args.guidance)
    for seed, image in zip(seeds, images):
        path = args.out.replace("{seed}", str(seed)) if "{seed}" in args.out else f"{args.out[:-4]}-{seed}.png"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with A.named_path(path):
            save_image(image, path)
        print(f"wrote {path}")
    return 0


def cmd_push(args) -> int:
    commit = A.push(args)  # the repo id checked, then hub.push: no token, no rights, the hub unreachable: one line
    print(f"uploaded {args.run}/final to {args.repo}: {commit}")  # a PushError is a ConfigError: one line, exit 2
    return 0


def cmd_recipes(args) -> int:
    from flowalign.recipes import builtin_recipes, describe, find_recipe

    if args.show:
        print(find_recipe(args.show).read_text(), end="")
        return 0
    recipes = builtin_recipes()
    width = max(map(len, recipes))
    for name, path in recipes.items():
        print(f"{name:{width}s}  {describe(path)}")
    print(f"\n{len(recipes)} recipes in {next(iter(recipes.values())).parent}: flowalign train NAME [key=value ...]; "
          "flowalign recipes --show NAME prints one (relative prompt paths in it are read from its folder)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowalign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from flowalign import __version__

    parser.add_argument("--version", action="version", version=f"flowalign {__version__}")
    parser.add_argument("--verbose", action="store_true", help="keep the libraries' loading bars and known-harmless "
                                                               "warnings (silenced by default: flowalign/quiet.py)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an alignment experiment from a YAML config",
                       description="Run an experiment. Any config value can be overridden: key.sub=value "
                                   "(e.g. train.learning_rate=1e-4 sampling.num_steps=8). resume=auto continues "
                                   "from the latest checkpoint in output_dir.",
                       epilog=CONFIG_KEYS_HELP)
    p.add_argument("config", help="YAML recipe: a path (configs/shapes_flow_grpo.yaml) or a built-in recipe's name "
                                  "(shapes_flow_grpo; flowalign recipes lists them)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the whole config (keys, rewards, method × family, adapter options) and print "
                        "which weights, rewards and prompts it would load, without downloading or loading any")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate-groups", help="GDRO, phase 1: sample and score prompt groups once, to disk",
                       description="Sample --groups prompt groups of train.group_size with the untrained model and "
                                   "the config's sampler, score them with its reward and write them to "
                                   "data.offline_groups; `flowalign train` with method=gdro then trains on them "
                                   "without sampling. Overrides as for train.")
    p.add_argument("config", help="YAML recipe: a path (configs/shapes_gdro.yaml) or a built-in recipe's name")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--groups", type=A.integer(1), default=512, help="prompt groups to generate (rounded up to whole "
                                                           "train.groups_per_epoch batches)")
    p.set_defaults(func=cmd_generate_groups)

    p = sub.add_parser("recipes", help="list the built-in recipes (flowalign train NAME runs one)",
                       description="The recipes that ship with flowalign (the repository's configs/), each with "
                                   "its first comment line. A name works wherever a recipe path does.")
    p.add_argument("--show", default=None, metavar="NAME", help="print this recipe's YAML (to copy and edit it)")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("grid", help="prompts × policies × seeds in one labelled PNG (ODE sampling)",
                       description="Rows are prompts; columns are seeds grouped by policy, every policy "
                                   "starting from the same noise per seed, so cells are comparable.")
    _add_model_args(p)
    _add_policy_args(p)
    p.add_argument("--prompts", default="shapes:test", help="shapes:test, a .txt / .jsonl / .csv prompt file or "
                   "hf:PATH[:SPLIT] (a Hugging Face dataset)")
    p.add_argument("--prompt", action="append", type=A.prompt, help="a prompt (repeatable; overrides --prompts)")
    p.add_argument("--image", action="append", help="an image-conditioned family's input image for each --prompt "
                   "(repeatable, in order; several inputs of one prompt separated by |); a prompt file's records "
                   "carry their own, and the grid shows each row's input first")
    p.add_argument("--max-prompts", type=A.integer(1), default=12)
    p.add_argument("--out", default="grid.png")
    p.set_defaults(func=cmd_grid)

    p = sub.add_parser("eval", help="score policies on a prompt set with registered rewards (JSON + CSV)",
                       description="Every policy × prompt × seed is sampled (ODE) and scored by every reward. "
                                   "Results are appended to OUT/samples.jsonl as they come, so rerunning the "
                                   "same command resumes; OUT/summary.json and summary.csv hold the means "
                                   "overall and per category, and for every policy after the first its paired "
                                   "change against the first (same prompts, same seeds) with a standard error: "
                                   "list the base model first.")
    _add_model_args(p)
    _add_policy_args(p)
    p.add_argument("--prompts", default="shapes:test", help="shapes:test, a .txt / .jsonl / .csv prompt file or "
                   "hf:PATH[:SPLIT] (a Hugging Face dataset)")
    p.add_argument("--max-prompts", type=A.integer(1), default=None)
    p.add_argument("--rewards", default="shapes", help="comma-separated registered rewards, e.g. "
                                                       "shapes,jpeg_compressibility")
    p.add_argument("--out", default="eval", help="output folder")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="a static HTML report of a run (curves, grids, eval tables, config)")
    p.add_argument("run", help="the run's output_dir")
    p.add_argument("--eval", action="append", help="an output folder of flowalign eval (repeatable)")
    p.add_argument("--image", action="append", help="an extra PNG to include, e.g. a flowalign grid (repeatable)")
    p.add_argument("--out", default=None, help="default: RUN/report/index.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("reward-server", help="serve a registered reward over HTTP for remote training processes",
                       description="Train with it: reward.name=remote 'reward.kwargs={url: http://HOST:PORT}'. "
                                   "Binds 127.0.0.1 unless --host is given; requests arriving together are "
                                   "scored in one batch.")
    p.add_argument("--reward", required=True, help="a registered reward name, e.g. shapes")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the reward")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=A.integer(0, 65535), default=8765)
    p.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' (default: $FLOWALIGN_REWARD_TOKEN); "
                   "needed when --host is not 127.0.0.1 / localhost / ::1")
    p.add_argument("--max-batch", type=A.integer(1), default=64, help="most samples per reward call")
    p.add_argument("--max-payload-mb", type=A.number(0, True), default=64, help="larger requests are refused (HTTP 413)")
    p.add_argument("--max-image-pixels", type=A.integer(1), default=2**22,
                   help="most pixels one sample may decode to (an NPY sample: values / 3); more: HTTP 413")
    p.add_argument("--max-request-pixels", type=A.integer(1), default=2**24,
                   help="most pixels all samples of one request may decode to; more: HTTP 413")
    p.add_argument("--timeout-s", type=A.number(0, True), default=300,
                   help="seconds to receive a request's body (else 408) and to score it (else 503)")
    p.add_argument("--idle-timeout-s", type=A.number(0, True), default=30,
                   help="a connection that sends nothing for this long is closed (its thread ends)")
    p.set_defaults(func=cmd_reward_server)

    p = sub.add_parser("push", help="upload a run's final/ (weights, model card, grid) to the Hugging Face hub",
                       description="Creates the repository if needed (huggingface_hub create_repo) and uploads "
                                   "RUN/final with upload_folder. Log in first (`hf auth login`) or set HF_TOKEN.")
    p.add_argument("run", help="the run's output_dir")
    p.add_argument("--repo", required=True, help="hub repository id, e.g. me/shapes-nft-lora")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--message", default=None, help="commit message (default: flowalign: RUN's name)")
    p.add_argument("--endpoint", default=None, help="another hub's URL (default: huggingface_hub's, HF_ENDPOINT)")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("sample", help="images for one prompt, one file per seed (chess: puzzles to PGN/CSV)",
                       description="Images for one prompt, one file per seed. A family with a sample command of "
                                   "its own (chess: puzzles) lists its options under its own heading below.")
    _add_model_args(p)
    p.add_argument("--weights", default=None, help="trained weights: a run's final/ or a checkpoint's policy/")
    p.add_argument("prompt", type=A.prompt)
    p.add_argument("--image", default=None, help="the input image of an image-conditioned family (several inputs "
                   "separated by |)")
    p.add_argument("--out", default="sample-{seed}.png", help="output path; {seed} is replaced (chess: .pgn or .csv)")
    for command in _family_commands():
        command.add_sample_arguments(p)
    p.set_defaults(func=cmd_sample)
    return parser


# Errors that end a command with a one-line message: usage errors (exit 2) and faults during a run
# (exit 1), as "module:Class". The classes live in modules that import torch; an exception can only
# be an instance of a class whose module is loaded, so main() looks them up in sys.modules instead
# of importing them (`flowalign recipes` and `--help` never load torch).
MODEL_COMMANDS = ("train", "generate-groups", "grid", "eval", "sample", "reward-server")  # they load models
USAGE_ERRORS = ("flowalign.checkpoint:CheckpointError", "reward_models.base:MissingRewardPackage")
RUN_FAULTS = ("flowalign.faults:RunStopped",)


def loaded_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    """The classes named "module:Class" whose modules are already imported (imports nothing)."""
    found = (name.split(":") for name in names)
    return tuple(getattr(sys.modules[module], cls) for module, cls in found if module in sys.modules)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and usage errors exit here, before anything heavy loads
    from flowalign.errors import ConfigError  # torch-free

    if not args.verbose and args.command in MODEL_COMMANDS:
        from flowalign.quiet import quiet

        quiet(diffusers_bars=args.command != "reward-server")  # a reward server loads no diffusers pipeline
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, argparse.ArgumentTypeError) as error:  # + pipelines' ModelNotFoundError
        print(f"flowalign: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a read-only, full or size-limited disk, a port in use: the path or address named
        from flowalign.faults import describe_os_error

        print(f"flowalign: error: {describe_os_error(error)}", file=sys.stderr)
        return 1
    except Exception as error:
        if isinstance(error, loaded_classes(USAGE_ERRORS)):
            print(f"flowalign: error: {error}", file=sys.stderr)
            return 2
        if isinstance(error, loaded_classes(RUN_FAULTS)):  # a fault during the run, not a usage error
            print(f"flowalign: error: {error}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
