"""Image grids: prompts × seeds, and before/after comparisons, saved as one PNG."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw


def to_pil_grid(images: torch.Tensor, rows: int, cols: int, min_cell: int = 96, pad: int = 2) -> Image.Image:
    """images: float [rows·cols, 3, H, W] in [0, 1], row-major → one PIL image. Small images are
    upscaled (nearest) to at least ``min_cell`` pixels so a 32-pixel demo stays readable."""
    n, _, h, w = images.shape
    if n != rows * cols:
        raise ValueError(f"{n} images do not fill a {rows}×{cols} grid")
    scale = max(1, -(-min_cell // max(h, w)))
    cells = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    grid = Image.new("RGB", (cols * (w * scale + pad) + pad, rows * (h * scale + pad) + pad), (255, 255, 255))
    for i, cell in enumerate(cells):
        r, c = divmod(i, cols)
        tile = Image.fromarray(cell).resize((w * scale, h * scale), Image.NEAREST)
        grid.paste(tile, (pad + c * (w * scale + pad), pad + r * (h * scale + pad)))
    return grid


def side_by_side(panels: dict[str, Image.Image], header: int = 16) -> Image.Image:
    """Panels of equal height next to each other, each titled with its key."""
    width = sum(p.width for p in panels.values()) + 8 * (len(panels) - 1)
    height = max(p.height for p in panels.values()) + header
    out = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(out)
    x = 0
    for title, panel in panels.items():
        draw.text((x + 4, 2), title, fill=(0, 0, 0))
        out.paste(panel, (x, header))
        x += panel.width + 8
    return out


def save_grid(image: Image.Image, path: str | Path, prompts: list[str] | None = None) -> None:
    """Write the PNG and, when given, the row prompts next to it (``<name>.txt``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    if prompts is not None:
        path.with_suffix(".txt").write_text("".join(f"row {i}: {p}\n" for i, p in enumerate(prompts)))
