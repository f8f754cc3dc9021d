"""Drawing generated chess puzzles: one cell per puzzle, and a grid of cells as one PNG.

A cell (``puzzle_cell``) is the board on the left (a8 top left, file and rank names at its
edges) and, on the right: the side to move, the engine's solution in SAN, the requested
themes, the themes the tagger found on the solution, and the verdicts (legal, unique, theme
match, yield, two to a line; green ✓, red ✗, grey ? when not checked). A yield cell (legal ∧ unique ∧ every
requested theme found) gets a green frame, so yields can be counted at a glance.

Pieces are the chess glyphs U+2654–265F of DejaVu Sans when that font is found (the system's, or
the copy matplotlib ships); otherwise each piece is its letter on a disc, as the evaluation grids'
``chess_board`` draws them (``flowalign.grids.draw_piece_disc``), so the picture works on any
machine. ``flowalign sample --grid PNG`` and ``scripts/chess_puzzle_grid.py`` use it.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Sequence

import chess
from PIL import Image, ImageDraw, ImageFont

from flowalign.chess.sampling import GeneratedPuzzle, san_line
from flowalign.grids import DARK_SQUARE, LIGHT_SQUARE, draw_piece_disc

# white pieces U+2654 … U+2659 (outlines), black U+265A … U+265F (filled shapes), in K Q R B N P order
GLYPHS = {piece: chr(0x2654 + i) for i, piece in enumerate("KQRBNP")} | \
         {piece: chr(0x265A + i) for i, piece in enumerate("kqrbnp")}
CELL_WIDTH, SQUARE, FONT_SIZE, GAP = 392, 24, 12, 6
GREEN, RED, GREY = (30, 140, 60), (200, 40, 40), (130, 130, 130)


@functools.lru_cache(maxsize=None)
def dejavu_path() -> str | None:
    """The path of DejaVuSans.ttf (the system's font folders, then matplotlib's copy), or None."""
    try:
        return ImageFont.truetype("DejaVuSans.ttf", 10).path  # Pillow searches the system font folders
    except OSError:
        pass
    spec = importlib.util.find_spec("matplotlib")  # without importing it (slow)
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
        if path.is_file():
            return str(path)
    return None


@functools.lru_cache(maxsize=None)
def _font(size: int, dejavu: bool) -> ImageFont.FreeTypeFont:
    path = dejavu_path() if dejavu else None
    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size=size)


def board_layout(fen: str) -> list[str]:
    """The placement of ``fen`` as 8 strings of 8 characters, rank 8 first, file a first: a
    piece letter (upper case white) or "." (empty). Only the placement field is read, without
    legality checks (a generated board may have three kings).

    >>> board_layout(chess.STARTING_FEN)[7]  # rank 1
    'RNBQKBNR'
    """
    board = chess.BaseBoard(fen.split()[0])
    return ["".join((p.symbol() if (p := board.piece_at(chess.square(f, r))) else ".") for f in range(8))
            for r in range(7, -1, -1)]


def draw_board(fen: str, square: int = SQUARE, glyphs: bool | None = None) -> Image.Image:
    """The board of ``fen`` → an RGB image [8·square + 12 wide, 8·square + 12 high]: the squares
    from (12, 0) (a8 top left), rank names in the 12-pixel column on the left, file names in the
    12-pixel row below. ``glyphs``: draw the Unicode pieces (None: when DejaVu Sans is found)."""
    glyphs = dejavu_path() is not None if glyphs is None else glyphs
    margin, size = 12, 8 * square
    image = Image.new("RGB", (size + margin, size + margin), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    label = _font(9, dejavu_path() is not None)
    piece_font = _font(int(square * 0.9), True) if glyphs else _font(max(8, int(square * 0.7)), False)
    for row, pieces in enumerate(board_layout(fen)):
        draw.text((margin / 2, row * square + square / 2), str(8 - row), fill=GREY, font=label, anchor="mm")
        for col, piece in enumerate(pieces):
            x, y = margin + col * square, row * square
            draw.rectangle([x, y, x + square - 1, y + square - 1],
                           fill=LIGHT_SQUARE if (row + col) % 2 == 0 else DARK_SQUARE)
            if piece != ".":
                _draw_piece(draw, piece, x + square / 2, y + square / 2, square, piece_font, glyphs)
    for col in range(8):
        draw.text((margin + col * square + square / 2, size + margin / 2), "abcdefgh"[col], fill=GREY, font=label,
                  anchor="mm")
    return image


def _draw_piece(draw: ImageDraw.ImageDraw, piece: str, cx: float, cy: float, square: int, font, glyphs: bool) -> None:
    if not glyphs:
        draw_piece_disc(draw, piece, cx - square / 2, cy - square / 2, square, font)
        return
    # a white piece: the filled (black) shape painted white, then its outline glyph in black on top
    if piece.isupper():
        draw.text((cx, cy), GLYPHS[piece.lower()], fill=(255, 255, 255), font=font, anchor="mm")
    draw.text((cx, cy), GLYPHS[piece], fill=(0, 0, 0), font=font, anchor="mm")


def _wrap(text: str, font, width: float) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width`` pixels in ``font`` (a longer
    word gets a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(lines[-1] + " " + word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _verdicts(puzzle: GeneratedPuzzle) -> list[tuple[str, bool | None]]:
    """(name, True / False / None = not checked) of the four verdicts."""
    if not puzzle.legal:
        return [("legal", False), ("unique", False), ("theme", False), ("yield", False)]
    if puzzle.unique is None:
        return [("legal", True), ("unique", None), ("theme", None), ("yield", None)]
    return [("legal", True), ("unique", puzzle.unique), ("theme", puzzle.theme_match),
            ("yield", puzzle.unique and puzzle.theme_match)]


def is_yield(puzzle: GeneratedPuzzle) -> bool:
    return bool(puzzle.legal and puzzle.unique and puzzle.theme_match)


def puzzle_cell(puzzle: GeneratedPuzzle, label: str | None = None, *, width: int = CELL_WIDTH,
                square: int = SQUARE, font_size: int = FONT_SIZE, glyphs: bool | None = None) -> Image.Image:
    """One puzzle → an RGB image [width, 8·square + 12 + 4] (the board, 12 pixels of coordinates
    and a 2-pixel frame, green for a yield): the board left, the text right (``label``,
    default "seed N", in grey on top; long lines wrap, and text that does not fit is cut with "…")."""
    board = draw_board(puzzle.fen, square, glyphs)
    height = board.height + 4
    cell = Image.new("RGB", (width, height), (255, 255, 255))
    cell.paste(board, (2, 2))
    draw = ImageDraw.Draw(cell)
    dejavu = dejavu_path() is not None
    font, line_h = _font(font_size, dejavu), font_size + 3
    x0 = board.width + 10
    wrap = functools.partial(_wrap, font=font, width=width - x0 - 4)
    lines: list[tuple[str, tuple[int, int, int]]] = [(s, GREY) for s in wrap(label or f"seed {puzzle.seed}")]
    turn = puzzle.fen.split()[1] if len(puzzle.fen.split()) > 1 else "w"
    lines.append(("White to move" if turn == "w" else "Black to move", (0, 0, 0)))
    if not puzzle.legal:
        lines += [(s, RED) for s in wrap("illegal: " + ", ".join(puzzle.problems))]
    elif puzzle.solution:
        lines += [(s, (0, 0, 0)) for s in wrap(san_line(puzzle.fen, puzzle.solution))]
    else:  # a position rejected at its first move has no line (its themes are tagged on that move)
        lines.append(("(not unique: no line)" if puzzle.unique is False else "(no engine line)", GREY))
    lines += [(s, (40, 40, 120)) for s in wrap("asked: " + (" ".join(puzzle.requested) or "-"))]
    if puzzle.legal and puzzle.unique is not None:
        found = " ".join(sorted(puzzle.themes)) or "-"
        lines += [(s, (40, 40, 120)) for s in wrap("found: " + found)]
    room = (height - 4) // line_h - 2  # the last two lines are the verdicts'
    if len(lines) > room:
        last, colour = lines[room - 1]
        while " " in last and font.getlength(last + " …") > width - x0 - 4:
            last = last.rsplit(" ", 1)[0]
        lines = lines[:room - 1] + [(last + " …", colour)]
    for k, (text, colour) in enumerate(lines):
        draw.text((x0, 4 + k * line_h), text, fill=colour, font=font)
    for k, (name, verdict) in enumerate(_verdicts(puzzle)):
        mark = {True: ("✓" if dejavu else "+", GREEN), False: ("✗" if dejavu else "-", RED), None: ("?", GREY)}[verdict]
        x, y = x0 + (k % 2) * (width - x0) / 2, 4 + (room + k // 2) * line_h
        draw.text((x, y), f"{name} {mark[0]}", fill=mark[1], font=font)
    if is_yield(puzzle):
        draw.rectangle([0, 0, width - 1, height - 1], outline=GREEN, width=2)
    return cell


def puzzle_grid(puzzles: Sequence[GeneratedPuzzle], columns: int, labels: Sequence[str] | None = None,
                column_labels: Sequence[str] | None = None, **cell_kwargs) -> Image.Image:
    """Cells of ``puzzles`` row-major, ``columns`` to a row, ``GAP`` pixels apart (a light grey
    rule between rows), under one header line of ``column_labels`` when given → an RGB image
    [columns·(cell width + GAP) + GAP wide, header + rows·(cell height + GAP) + GAP high]."""
    if not puzzles:
        raise ValueError("puzzle_grid: no puzzles to draw")
    if labels is not None and len(labels) != len(puzzles):
        raise ValueError(f"puzzle_grid: {len(labels)} labels for {len(puzzles)} puzzles")
    cells = [puzzle_cell(p, labels[i] if labels else None, **cell_kwargs) for i, p in enumerate(puzzles)]
    w, h = cells[0].size
    rows = -(-len(cells) // columns)
    header = FONT_SIZE + 8 if column_labels else 0
    grid = Image.new("RGB", (columns * (w + GAP) + GAP, header + rows * (h + GAP) + GAP), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    font = _font(FONT_SIZE + 1, dejavu_path() is not None)
    for c, text in enumerate(column_labels or ()):
        draw.text((GAP + c * (w + GAP) + w / 2, header / 2), text, fill=(0, 0, 0), font=font, anchor="mm")
    for r in range(1, rows):
        y = header + r * (h + GAP) + GAP // 2 - 1
        draw.line([(GAP, y), (grid.width - GAP, y)], fill=(210, 210, 210))
    for i, cell in enumerate(cells):
        r, c = divmod(i, columns)
        grid.paste(cell, (GAP + c * (w + GAP), header + GAP + r * (h + GAP)))
    return grid


def save_puzzle_grid(puzzles: Sequence[GeneratedPuzzle], path: str | Path, columns: int = 4, **kwargs) -> Path:
    """``puzzle_grid`` written as a PNG at ``path`` (folders made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    puzzle_grid(puzzles, min(columns, len(puzzles)), **kwargs).save(path)
    return path
