"""Grids: prompts × (policy, seed) cells saved as one labelled PNG; before/after comparisons.

Every cell is an image [3, H, W]. Other modalities become image cells first: a video
[T, 3, H, W] becomes a contact sheet of evenly spaced frames (``contact_sheet``, and
``save_gif`` keeps the motion), a waveform [N] becomes a log-magnitude spectrogram strip
(``spectrogram_strip``), a chess position (a FEN string) a drawn board (``chess_board``), an
audio-video sample (``pipelines.joint.AudioVideoSamples``) its frames above its waveform
(``av_cell``; ``save_clip`` writes it as an MP4 with sound, or a WAV and a PNG strip).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


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


def labelled_grid(images: torch.Tensor, row_labels: list[str], column_groups: dict[str, list[str]],
                  min_cell: int = 96, font_size: int = 12) -> Image.Image:
    """A grid with a prompt at the left of every row and two header lines: each group's name
    (e.g. a checkpoint) over its columns (e.g. its seeds).

    images: float [rows·cols, 3, H, W] in [0, 1], row-major; rows = len(row_labels), cols = the
    total number of columns in ``column_groups`` ({group: [column label, ...]}, in order)."""
    cols = sum(len(c) for c in column_groups.values())
    body = to_pil_grid(images, len(row_labels), cols, min_cell=min_cell)
    cell_w, cell_h = (body.width - 2) / cols, (body.height - 2) / len(row_labels)
    font = ImageFont.load_default(size=font_size)
    chars = max(12, int(cell_w * 1.6 // (font_size * 0.6)))
    wrapped = [textwrap.wrap(label, chars)[:max(1, int(cell_h // (font_size + 2)))] for label in row_labels]
    left = 8 + max(int(font.getlength(line)) for lines in wrapped for line in lines or [""])
    top = 2 * (font_size + 6)
    out = Image.new("RGB", (left + body.width, top + body.height), (255, 255, 255))
    out.paste(body, (left, top))
    draw = ImageDraw.Draw(out)
    for r, lines in enumerate(wrapped):
        y = top + 2 + r * cell_h + (cell_h - len(lines) * (font_size + 2)) / 2
        for k, line in enumerate(lines):
            draw.text((4, y + k * (font_size + 2)), line, fill=(0, 0, 0), font=font)
    x = left + 2
    for group, columns in column_groups.items():
        width = cell_w * len(columns)
        draw.text((x + (width - font.getlength(group)) / 2, 2), group, fill=(0, 0, 0), font=font)
        draw.line([(x + 2, font_size + 5), (x + width - 4, font_size + 5)], fill=(160, 160, 160))
        for k, column in enumerate(columns):
            cx = x + k * cell_w + (cell_w - font.getlength(column)) / 2
            draw.text((cx, font_size + 7), column, fill=(90, 90, 90), font=font)
        x += width
    return out


def contact_sheet(video: torch.Tensor, frames: int = 4) -> torch.Tensor:
    """video: float [T, 3, H, W] in [0, 1] → [3, H, frames·W]: ``frames`` evenly spaced frames
    (first and last included) side by side."""
    t = video.shape[0]
    idx = torch.linspace(0, t - 1, min(frames, t)).round().long()
    return torch.cat(list(video[idx]), dim=-1)


def save_gif(video: torch.Tensor, path: str | Path, fps: int = 8, min_side: int = 96) -> None:
    """video: float [T, 3, H, W] in [0, 1] → an endlessly looping GIF (upscaled like grid cells)."""
    frames = (video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    h, w = frames.shape[1:3]
    scale = max(1, -(-min_side // max(h, w)))
    images = [Image.fromarray(f).resize((w * scale, h * scale), Image.NEAREST) for f in frames]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)


def spectrogram_strip(audio: torch.Tensor, height: int = 64, n_fft: int = 256, floor_db: float = -80.0
                      ) -> torch.Tensor:
    """audio: float [N] (mono waveform) → image [3, height, frames]: log-magnitude STFT, low
    frequencies at the bottom, ``floor_db`` below the peak mapped to black."""
    spec = torch.stft(audio.float(), n_fft, hop_length=n_fft // 4, window=torch.hann_window(n_fft),
                      return_complex=True).abs()  # [F, frames]
    db = 20 * torch.log10(spec.clamp_min(1e-10))
    level = ((db - db.max()) / -floor_db + 1).clamp(0, 1)
    level = torch.nn.functional.interpolate(level.flip(0)[None, None], size=(height, level.shape[1]),
                                            mode="bilinear", align_corners=False)[0, 0]
    # a simple dark-to-bright colour map: black → purple → orange → yellow
    return torch.stack([level.sqrt(), level ** 2, (level * (1 - level) * 2.5).clamp(0, 1)])


LIGHT_SQUARE, DARK_SQUARE = (240, 217, 181), (181, 136, 99)


def chess_board(fen: str, square: int = 16) -> torch.Tensor:
    """A FEN string → image float [3, 8·square + 4, 8·square] in [0, 1]: a board (a8 top left,
    light and dark squares), each piece as its letter on a disc (white pieces: black letter on
    white, black pieces: white letter on black), and a 4-pixel bar under the board in the
    colour of the side to move. Only the placement and side-to-move fields are read, without
    any legality check (generated boards may have three kings); an unreadable placement draws
    the squares it could read and leaves the rest empty."""
    fields = fen.split()
    placement, turn = (fields + ["w", "w"])[:2] if fields else ("8/8/8/8/8/8/8/8", "w")
    size = 8 * square
    image = Image.new("RGB", (size, size + 4), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(8, int(square * 0.75)))
    for rank in range(8):
        for file in range(8):
            x, y = file * square, rank * square
            draw.rectangle([x, y, x + square - 1, y + square - 1],
                           fill=LIGHT_SQUARE if (rank + file) % 2 == 0 else DARK_SQUARE)
    for rank, row in enumerate(placement.split("/")[:8]):
        file = 0
        for char in row:
            if char.isdigit():
                file += int(char)
                continue
            if file >= 8 or char.upper() not in "PNBRQK":
                break
            draw_piece_disc(draw, char, file * square, rank * square, square, font)
            file += 1
    draw.rectangle([0, size, size - 1, size + 3], fill=(20, 20, 20) if turn == "b" else (200, 200, 200))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def draw_piece_disc(draw: ImageDraw.ImageDraw, piece: str, x: float, y: float, square: int, font) -> None:
    """A piece (FEN letter) as its letter on a disc in the square whose top-left corner is (x, y):
    white pieces a black letter on white, black pieces a white letter on black."""
    white, inset = piece.isupper(), max(1, square // 10)
    draw.ellipse([x + inset, y + inset, x + square - 1 - inset, y + square - 1 - inset],
                 fill=(250, 250, 250) if white else (20, 20, 20), outline=(0, 0, 0))
    draw.text((x + square / 2, y + square / 2), piece.upper(), fill=(0, 0, 0) if white else (255, 255, 255),
              font=font, anchor="mm")


def waveform_strip(audio: torch.Tensor, width: int, height: int = 24) -> torch.Tensor:
    """audio: float [T] in [−1, 1] → image [3, height, width]: each column the min…max of its share
    of the samples, dark on white, a grey centre line."""
    t = audio.shape[0]
    edges = torch.linspace(0, t, width + 1).round().long()
    strip = torch.ones(3, height, width)
    strip[:, height // 2] = 0.75
    rows = torch.arange(height, dtype=torch.float32)[:, None]
    lo = torch.stack([audio[a:max(b, a + 1)].min() for a, b in zip(edges[:-1], edges[1:])]).clamp(-1, 1)
    hi = torch.stack([audio[a:max(b, a + 1)].max() for a, b in zip(edges[:-1], edges[1:])]).clamp(-1, 1)
    # sample value v sits at row (1 − v)/2 · (height − 1): +1 at the top
    ink = (rows >= (1 - hi) / 2 * (height - 1) - 0.5) & (rows <= (1 - lo) / 2 * (height - 1) + 0.5)
    strip[:, ink] = torch.tensor([0.1, 0.2, 0.5])[:, None]
    return strip


def av_cell(video: torch.Tensor, audio: torch.Tensor, max_frames: int = 16) -> torch.Tensor:
    """One audio-video sample → image [3, 2·H, F·W]: every frame side by side (evenly spaced
    ones when F > ``max_frames``) over the waveform of the same time span, so a beep sits under the
    frame it belongs to. video: float [F, 3, H, W] in [0, 1]; audio: float [A, T] or [T]."""
    sheet = contact_sheet(video, min(video.shape[0], max_frames))
    mono = audio.float().mean(0) if audio.ndim == 2 else audio.float()
    return torch.cat([sheet, waveform_strip(mono.cpu(), sheet.shape[-1], max(8, video.shape[-2]))], dim=1)


def save_clip(video: torch.Tensor, audio: torch.Tensor, path: str | Path, fps: float, sample_rate: int,
              min_side: int = 96) -> list[Path]:
    """Write one audio-video sample; returns the files written. video: float [F, 3, H, W] in
    [0, 1]; audio: float [A, T] or [T] in [−1, 1] (channels averaged to mono).

    With ``imageio-ffmpeg`` installed (``pip install flowalign[av]``) and a ``.mp4`` path: an MP4
    (H.264, frames upscaled nearest to ≥ ``min_side``) with the sound as AAC at 16 kHz (AAC has no
    512 Hz mode; ffmpeg resamples). Otherwise ``<path>.wav`` (16-bit PCM at ``sample_rate``) and
    ``<path>.png`` (``av_cell``)."""
    import wave

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mono = (audio.float().mean(0) if audio.ndim == 2 else audio.float()).clamp(-1, 1).cpu()
    wav = path.with_suffix(".wav")
    with wave.open(str(wav), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes((mono * 32767).round().to(torch.int16).numpy().tobytes())
    try:
        import imageio_ffmpeg
    except ImportError:
        imageio_ffmpeg = None
    if imageio_ffmpeg is None or path.suffix != ".mp4":
        png = path.with_suffix(".png")
        cell = (av_cell(video.cpu(), mono).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        scale = max(1, -(-min_side // video.shape[-2]))
        Image.fromarray(cell).resize((cell.shape[1] * scale, cell.shape[0] * scale), Image.NEAREST).save(png)
        return [wav, png]
    frames = (video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    h, w = frames.shape[1:3]
    scale = max(1, -(-min_side // max(h, w)))
    scale += scale % 2  # H.264 in yuv420p needs even sides
    writer = imageio_ffmpeg.write_frames(str(path), (w * scale, h * scale), fps=fps, audio_path=str(wav),
                                         audio_codec="aac", output_params=["-ar", "16000", "-shortest"],
                                         macro_block_size=1)
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame.repeat(scale, 0).repeat(scale, 1)))
    writer.close()
    wav.unlink()
    return [path]


def as_image_cells(samples, frames: int = 4) -> torch.Tensor:
    """Decoded samples of any modality → image cells [B, 3, H, W]: images pass through, videos
    [B, T, 3, H, W] become contact sheets, waveforms [B, N] spectrogram strips, a list of FEN
    strings (the chess family's decoded boards) drawn boards, audio-video samples (``.video``
    [B, F, 3, H, W], ``.audio`` [B, A, T]) frames over waveform (``av_cell``)."""
    if hasattr(samples, "video") and hasattr(samples, "audio"):  # AudioVideoSamples
        return torch.stack([av_cell(v, a) for v, a in zip(samples.video, samples.audio)])
    if isinstance(samples, (list, tuple)):
        if samples and all(isinstance(s, str) for s in samples):
            return torch.stack([chess_board(fen) for fen in samples])
        raise ValueError("a list of samples must be FEN strings (chess boards)")
    if samples.ndim == 4:
        return samples
    if samples.ndim == 5:
        return torch.stack([contact_sheet(v, frames) for v in samples])
    if samples.ndim == 2:
        return torch.stack([spectrogram_strip(a) for a in samples])
    raise ValueError(f"cannot draw samples of shape {tuple(samples.shape)}: expected images [B, 3, H, W], "
                     "videos [B, T, 3, H, W] or waveforms [B, N]")


def with_inputs(cells: torch.Tensor, inputs: list, per_row: int) -> torch.Tensor:
    """Image cells [R·per_row, 3, H, W] (row-major) → [R·(per_row + 1), 3, H, W] with each row's
    conditioning image (a path; image-conditioned tasks; a list of paths: side by side) first,
    scaled to fit the cell (a video's contact sheet is wider than its frames) on white."""
    h, w = cells.shape[-2:]
    rows = []
    for r, paths in enumerate(inputs):
        paths = paths if isinstance(paths, (list, tuple)) else [paths]
        pictures = [Image.open(path).convert("RGB") for path in paths]
        strip = Image.new("RGB", (sum(p.width for p in pictures), max(p.height for p in pictures)), "white")
        for k, picture in enumerate(pictures):
            strip.paste(picture, (sum(p.width for p in pictures[:k]), 0))
        scale = min(h / strip.height, w / strip.width)
        strip = strip.resize((max(1, round(strip.width * scale)), max(1, round(strip.height * scale))))
        image = torch.ones(3, h, w)
        image[:, :strip.height, :strip.width] = torch.from_numpy(np.array(strip)).permute(2, 0, 1).float() / 255
        rows += [image[None], cells[r * per_row:(r + 1) * per_row]]
    return torch.cat(rows)


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


def load_grids(folder: str | Path, labels) -> dict[str, Image.Image]:
    """The grids ``save_grid`` wrote as ``<label>.png`` in ``folder``, for the labels found there
    (a resumed run's "before" grid, drawn by an earlier session)."""
    paths = {label: Path(folder) / f"{label}.png" for label in labels}
    return {label: Image.open(path).convert("RGB") for label, path in paths.items() if path.is_file()}
