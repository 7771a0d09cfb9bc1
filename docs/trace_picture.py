"""Draw one request's trace as a waterfall PNG (the picture in README's "Observability").

    SPLITSERVE_TRACE_OUT=/tmp/trace.json .venv/bin/pytest \
        tests/integration/test_observability.py -k streamed
    .venv/bin/python docs/trace_picture.py /tmp/trace.json docs/trace.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt

COLOURS = {
    "splitserve-gateway": "#4c72b0",
    "splitserve-scheduler": "#8172b2",
    "splitserve-prefill": "#dd8452",
    "splitserve-decode": "#55a868",
}


def ordered(spans: list[dict]) -> list[dict]:
    """Depth-first from the root, children by start time."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else ""
        children.setdefault(parent, []).append(span)
    out: list[dict] = []

    def walk(parent: str) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["start_ns"]):
            out.append(span)
            walk(span["span_id"])

    walk("")
    return out


def label(span: dict) -> str:
    a = span["attributes"]
    extra = {
        "gateway.request": f"{a.get('gen_ai.usage.input_tokens')} in, "
        f"{a.get('gen_ai.usage.output_tokens')} out",
        "scheduler.route": f"→ {a.get('splitserve.prefill_worker')} + "
        f"{a.get('splitserve.decode_worker')}",
        "kv.transfer": f"{a.get('splitserve.kv.direction')}, {a.get('splitserve.kv.blocks')} "
        f"blocks, {a.get('splitserve.kv.bytes', 0) / 1e3:.0f} kB",
        "decode.generate": f"{a.get('splitserve.tokens')} tokens, "
        f"{a.get('splitserve.steps')} steps",
    }.get(span["name"], "")
    return f"{span['name']}  {extra}".strip()


def draw(spans: list[dict], out: Path) -> None:
    rows = ordered(spans)
    t0 = min(s["start_ns"] for s in rows)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.4))
    for y, span in enumerate(rows):
        start = (span["start_ns"] - t0) / 1e6
        width = max((span["end_ns"] - span["start_ns"]) / 1e6, 0.15)
        ax.barh(y, width, left=start, color=COLOURS.get(span["service"], "grey"), height=0.6)
        ax.text(start + width + 0.5, y, f"{width:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label(s) for s in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the request arrived at the gateway")
    trace_id = rows[0]["trace_id"]
    ax.set_title(f"one streamed chat request, trace {trace_id[:16]}…", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    draw(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
