"""A static HTML report of a run: one self-contained ``index.html`` (images embedded, charts as
inline SVG, no server, no network) that a user opens in any browser or attaches to a message.

Sections: the before/after summary (``metrics.json``), training curves read from the run's
TensorBoard event files (or ``history.jsonl`` when the run was started with ``tracker=none``),
held-out evaluations over training, the run's grids plus any extra images, the tables written by
``flowalign eval``, and the resolved config. A few lines of script mark the page
``data-status="ok"`` once every image has decoded, which is what the browser test checks.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from flowalign.errors import ConfigError
from flowalign.evaluation import is_change_key, metric_cell

CURVE_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from TensorBoard events under ``run_dir``, else ``history.jsonl``."""
    run_dir = Path(run_dir)
    events = sorted(run_dir.rglob("events.out.tfevents.*"))
    series: dict[str, dict[int, float]] = {}
    if events:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for path in events:
            acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                for event in acc.Scalars(tag):
                    series.setdefault(tag, {})[event.step] = event.value  # a resumed run overwrites
    elif (run_dir / "history.jsonl").exists():
        for step, line in enumerate((run_dir / "history.jsonl").read_text(errors="replace").splitlines(), start=1):
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"{run_dir / 'history.jsonl'}: line {step} is not JSON; the file is corrupt") from None
            for tag, value in (record.items() if isinstance(record, dict) else ()):
                if isinstance(value, (int, float)):
                    series.setdefault(tag, {})[step] = float(value)
    return {tag: sorted(points.items()) for tag, points in series.items()}


def svg_line_chart(curves: dict[str, list[tuple[int, float]]], title: str, width: int = 420,
                   height: int = 220) -> str:
    """Curves {name: [(x, y), ...]} as one inline SVG with axes, ticks and a legend."""
    points = [(x, y) for c in curves.values() for x, y in c if math.isfinite(y)]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 64, 10, 24, 30 + 14 * ((len(curves) + 1) // 2)

    def sx(x):
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y):
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{width / 2}" y="15" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
             'fill="none" stroke="#bbb"/>']
    # enough significant digits that the tick labels differ (a ratio of 0.99999..1.00001)
    digits = 3 + max(0, math.ceil(math.log10(max(abs(y0), abs(y1)) / (y1 - y0)))) if max(abs(y0), abs(y1)) else 3
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        parts.append(f'<text x="{left - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end" font-size="10">'
                     f'{yv:.{digits}g}</text>')
        xv = x0 + (x1 - x0) * k / 4
        parts.append(f'<text x="{sx(xv):.1f}" y="{height - bottom + 12}" text-anchor="middle" '
                     f'font-size="10">{xv:.0f}</text>')
    for i, (name, curve) in enumerate(curves.items()):
        color = CURVE_COLORS[i % len(CURVE_COLORS)]
        finite = [(x, y) for x, y in curve if math.isfinite(y)]
        if len(finite) == 1:
            parts.append(f'<circle cx="{sx(finite[0][0]):.1f}" cy="{sy(finite[0][1]):.1f}" r="3" fill="{color}"/>')
        elif finite:
            path = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(finite))
            parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        lx, ly = left + (i % 2) * (width - left) / 2, height - bottom + 26 + 14 * (i // 2)
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{ly}" font-size="10">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _json(path: Path):
    """A JSON file of the run or an eval folder; ValueError naming it when it is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error}); the file is corrupt") from None


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(path.name)}">' \
           f'<figcaption>{html.escape(path.name)}</figcaption></figure>'


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _grouped_charts(scalars: dict[str, list[tuple[int, float]]]) -> list[str]:
    """One chart per tag prefix (reward/, train/, eval/ overall numbers), by-category evals apart."""
    groups: dict[str, dict[str, list]] = {}
    for tag, curve in scalars.items():
        prefix, _, name = tag.rpartition("/")
        if "_by_category" in prefix:
            title = prefix.replace("eval/", "held-out ").replace("_by_category", " by category")
        else:
            title = {"reward": "training reward", "train": "training", "eval": "held-out (ODE)"}.get(prefix, prefix)
        if prefix == "eval" and name in ("epoch", "samples"):
            continue
        groups.setdefault(title or "other", {})[name] = curve
    charts = []
    for title, curves in groups.items():
        if title == "training":  # loss, clipfrac, KL, grad norm: different scales, one chart each
            charts += [svg_line_chart({name: curve}, f"training: {name}") for name, curve in curves.items()]
        else:
            charts.append(svg_line_chart(curves, title))
    return [chart for chart in charts if chart]


def build_report(run_dir: str | Path, out: str | Path | None = None, eval_dirs: list[str | Path] = (),
                 images: list[str | Path] = ()) -> Path:
    """Write the report of ``run_dir`` (default ``RUN/report/index.html``); returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir.resolve()}")
    out = Path(out) if out else run_dir / "report" / "index.html"
    metrics = _json(run_dir / "metrics.json") if (run_dir / "metrics.json").exists() else {}
    config = json.dumps(_json(run_dir / "config.json")) if (run_dir / "config.json").exists() else "{}"
    for image in images:
        if not Path(image).is_file():
            raise FileNotFoundError(f"--image {image}: no such file")
        if Path(image).read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise ConfigError(f"--image {image}: not a PNG file")
    for eval_dir in eval_dirs:
        if not (Path(eval_dir) / "summary.json").is_file():
            raise FileNotFoundError(f"--eval {eval_dir}: no summary.json (an output folder of flowalign eval)")
        _json(Path(eval_dir) / "summary.json")
    sections = [f"<h1>flowalign run: {html.escape(run_dir.resolve().name)}</h1>"]

    before, after = metrics.get("before") or {}, metrics.get("after") or {}
    keys = [k for k in after if isinstance(after[k], float) and isinstance(before.get(k), float)]
    if keys:
        rows = [[k, before[k], after[k], after[k] - before[k]] for k in keys]
        sections.append("<h2>Held-out, before → after</h2>" + _table(["metric", "before", "after", "Δ"], rows)
                        + f"<p>{metrics.get('epochs', '?')} epochs, {metrics.get('train_minutes', float('nan')):.1f} "
                          "training minutes.</p>")

    charts = _grouped_charts(read_scalars(run_dir))
    if charts:
        sections.append("<h2>Curves</h2><div class='charts'>" + "".join(charts) + "</div>")

    pngs = sorted((run_dir / "grids").glob("*.png")) if (run_dir / "grids").is_dir() else []
    pngs += [Path(p) for p in images]
    if pngs:
        sections.append("<h2>Grids</h2>" + "".join(_img(p) for p in pngs))

    for eval_dir in eval_dirs:
        summary = _json(Path(eval_dir) / "summary.json")
        metric_names = sorted({k for entry in summary.values() for k, v in entry.items()
                               if isinstance(v, float) and not is_change_key(k)})
        rows = [[label, entry["samples"], *[metric_cell(entry, m) for m in metric_names]]
                for label, entry in summary.items()]
        sections.append(f"<h2>Evaluation: {html.escape(Path(eval_dir).name)}</h2>"
                        + _table(["policy", "samples", *metric_names], rows))

    sections.append("<h2>Config</h2><pre>" + html.escape(json.dumps(json.loads(config), indent=2)) + "</pre>")
    page = PAGE.format(title=html.escape(run_dir.resolve().name), body="\n".join(sections))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flowalign: {title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1400px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
figure {{ display: inline-block; margin: 0.5em 1em 0.5em 0; }}
img {{ image-rendering: pixelated; max-width: 100%; }}
pre {{ background: #f6f6f6; padding: 1em; font-size: 12px; overflow-x: auto; }}
</style></head>
<body data-status="loading">
{body}
<script>
window.addEventListener("load", function () {{
  var images = Array.prototype.slice.call(document.images);
  var broken = images.filter(function (im) {{ return !(im.complete && im.naturalWidth > 0); }});
  document.body.dataset.images = images.length;
  document.body.dataset.charts = document.querySelectorAll("svg.chart path, svg.chart circle").length;
  document.body.dataset.status = broken.length ? "broken-images" : "ok";
}});
</script>
</body></html>
"""
