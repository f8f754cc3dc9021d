"""Argument types and checks of the commands (``flowalign grid / eval / sample / reward-server /
generate-groups``): every value is checked when parsed, so a bad one ends with argparse's one-line
usage error naming the flag, before any model loads; paths to write are checked before the work."""

from __future__ import annotations

import argparse
import json
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


def names(text: str) -> str:
    """A comma-separated list of names, none empty."""
    if not text.strip() or any(not p.strip() for p in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated names, none empty, e.g. shapes,jpeg_compressibility")
    return text


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object, e.g. '{{\"min_area\": 4}}'")
    return value


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
    if not out.exists() and not out.parent.exists():
        raise ConfigError(f"{flag} {shown or path}: the folder {out.parent} does not exist")
