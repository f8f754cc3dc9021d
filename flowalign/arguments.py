"""Argument types and checks of the commands (``flowalign grid / eval / sample / reward-server /
generate-groups``): every value is checked when parsed, so a bad one ends with argparse's one-line
usage error naming the flag, before any model loads; paths to write are checked before the work."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def integer(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: " + (f"{low}..{high}" if high is not None
                                                                               else f"must be ≥ {low}"))
        return value
    return parse


def number(low: float, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or low_open and value == low:
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {'>' if low_open else '≥'} {low:g}")
        return value
    return parse


def seeds(text: str) -> str:
    """Comma-separated seeds, each a whole number ≥ 0 (kept as text: ``_seeds`` splits it)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: seeds are comma-separated whole numbers ≥ 0, e.g. 0,1,2,3")
    if any(int(p) >= 2**63 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed must be < 2^63")
    return text


def prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty")
    return text


def output_file(flag: str, path: str, suffixes=IMAGE_SUFFIXES) -> None:
    """``path`` can be written: an image suffix, its folder there (or creatable) and not a file."""
    from flowalign.errors import ConfigError

    out = Path(path.replace("{seed}", "0")).expanduser()
    if suffixes and out.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {path}: the file type must be one of {', '.join(suffixes)}")
    output_folder(flag, str(out.parent), path)


def output_folder(flag: str, path: str, shown: str | None = None) -> None:
    from flowalign.errors import ConfigError

    out = Path(path).expanduser()
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{flag} {shown or path}: {blocking} is a file, not a folder")


def check_kinds(defaults: dict, given: dict, where: str, owner: str) -> None:
    """Each given value of the kind of its argument's default (a number for a number, a string for a
    string, a bool for a bool): ``reward.kwargs={min_area: lots}`` stops here, not in the reward's
    first batch. Arguments without a plain default pass."""
    from flowalign.errors import ConfigError

    for arg, value in given.items():
        default = defaults.get(arg)
        kinds = (int, float) if type(default) in (int, float) else (type(default),)
        if default is not None and type(default) in (bool, int, float, str) and value is not None \
                and (not isinstance(value, kinds) or isinstance(value, bool) != isinstance(default, bool)):
            raise ConfigError(f"{where}.{arg}: {owner} takes {type(default).__name__} (default {default!r}), got "
                              f"{type(value).__name__} {value!r}")


def prompt_file(source: str) -> list[dict]:
    """``--prompts``: its records, at least one (ConfigError naming the source otherwise)."""
    from flowalign.errors import ConfigError
    from flowalign.prompts import load_prompts

    try:
        records = load_prompts(source)
    except ValueError as error:
        raise ConfigError(f"--prompts: {error}") from None
    if not records:
        raise ConfigError(f"--prompts {source}: holds no prompts (empty, or blank lines only)")
    return records


def named_path(path: str):
    """A write fault (full, read-only, size-limited disk) inside raised as an OSError naming ``path``."""
    from flowalign.faults import write_fault_at

    return write_fault_at(path)


def reward_server(args):
    """``flowalign reward-server``'s server, bound: the reward looked up, its --kwargs checked and the
    reward built, a --token required beyond loopback (a warning without one on it), a bind error
    named with the address; each failure one line (ConfigError)."""
    import os
    import sys

    from flowalign.errors import ConfigError
    from flowalign.faults import built_reward, describe_os_error
    from flowalign.usage import reward_options
    from reward_models.remote import LOCAL_HOSTS, make_server

    name, kwargs = reward_options(args.reward, args.kwargs)  # one line for a bad name or --kwargs (flowalign/usage.py)
    token = args.token or os.environ.get("FLOWALIGN_REWARD_TOKEN")
    if not token and args.host not in LOCAL_HOSTS:
        raise ConfigError(f"--host {args.host} serves the network: give --token TOKEN (or FLOWALIGN_REWARD_TOKEN), "
                          "which clients send as reward.kwargs.token")
    if not token:
        print("flowalign: warning: no --token: any process on this machine may call the reward", file=sys.stderr)
    reward = built_reward(name, kwargs)
    try:
        return make_server(reward, args.reward, args.host, args.port, args.max_batch, int(args.max_payload_mb * 2**20),
                           args.max_image_pixels, args.max_request_pixels, args.timeout_s, args.idle_timeout_s,
                           token=token)
    except OSError as error:
        raise ConfigError(f"--host {args.host} --port {args.port}: cannot serve there: {describe_os_error(error)}") \
            from None


def push(args):
    """``flowalign push``: the repo id checked, then the upload (flowalign/hub.py: no token, a hub that
    refuses or cannot be reached: one line, a PushError)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from flowalign.errors import ConfigError
    from flowalign.hub import push

    try:
        validate_repo_id(args.repo)
    except HFValidationError as error:
        raise ConfigError(f"--repo {args.repo!r}: {str(error).splitlines()[0]}") from None
    return push(args.run, args.repo, private=args.private, endpoint=args.endpoint, message=args.message)
