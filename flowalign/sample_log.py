"""Training samples in the trackers: every ``tracker_samples_every`` epochs, a grid of the epoch's
first ``tracker_samples`` rollouts (this process's, in group order), each captioned with its prompt
and its reward, logged as the image ``train/samples`` at the epoch (TensorBoard's Images tab, a W&B
media panel), beside the evaluation grids (``eval/grid``). Decoding them draws no random numbers,
so a run's numbers do not depend on it."""

from __future__ import annotations

import textwrap

import torch
from PIL import Image, ImageDraw, ImageFont

from flowalign.grids import as_image_cells

TAG = "train/samples"


def captioned_grid(cells: torch.Tensor, captions: list[str], columns: int = 4, min_cell: int = 128,
                   lines: int = 3) -> Image.Image:
    """cells float [N, 3, H, W] in [0, 1] → one image: each cell (scaled up to ``min_cell`` pixels
    wide, nearest) over its caption (wrapped to ``lines`` lines)."""
    n = len(cells)
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    scale = max(1, -(-min_cell // cells.shape[-1]))
    h, w = cells.shape[-2] * scale, cells.shape[-1] * scale
    font = ImageFont.load_default()
    line_h = 11
    chars = max(8, w // 6)
    cap_h = lines * line_h + 4
    sheet = Image.new("RGB", (columns * (w + 4), rows * (h + cap_h + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    pixels = (cells.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i, (cell, caption) in enumerate(zip(pixels, captions)):
        x, y = (i % columns) * (w + 4) + 2, (i // columns) * (h + cap_h + 4) + 2
        sheet.paste(Image.fromarray(cell).resize((w, h), Image.NEAREST), (x, y))
        wrapped = textwrap.wrap(caption, chars)[:lines]
        for k, text in enumerate(wrapped):
            draw.text((x, y + h + 2 + k * line_h), text, fill="black", font=font)
    return sheet


def final_samples(traj) -> torch.Tensor:
    """The rollouts' final latents (or masked-diffusion states)."""
    return traj.latents[:, -1] if hasattr(traj, "latents") else traj.states[:, -1]


def samples_grid(adapter, encode, batch, count: int) -> Image.Image:
    """The captioned grid of the first ``count`` samples of an EpochBatch."""
    from pipelines.base import decode_samples, encode_records

    idx = list(range(min(count, len(batch.specs))))
    specs = [batch.specs[i] for i in idx]
    with torch.no_grad():
        decoded = decode_samples(adapter, final_samples(batch.traj)[idx], lambda: encode_records(encode, specs))
    cells = as_image_cells(decoded).float()
    captions = [f"{float(batch.rewards[i]):.3f} {spec['prompt']}" for i, spec in zip(idx, specs)]
    return captioned_grid(cells, captions)


def due(config, epoch: int) -> bool:
    """``epoch`` (1-based, just finished) is one whose samples go to the trackers."""
    every = config.tracker_samples_every
    return config.tracker != "none" and every > 0 and config.tracker_samples > 0 and epoch % every == 0
