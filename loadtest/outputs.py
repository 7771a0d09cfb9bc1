"""After a run: print the table, write the JSON and the PNG; before one: find the model."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.by_label import format_by_label
from loadtest.metrics import Summary, summarize
from loadtest.openloop import RunResult
from loadtest.plot import write_png
from loadtest.report import format_table, result_json, write_json


def discover_model(host: str, api_key: str = "") -> str:
    base = host.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    request = urllib.request.Request(
        base + "/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def finish_run(
    label: str, config: dict[str, Any], run: RunResult, slo: dict[str, float], out: Path
) -> Summary:
    summary = summarize(run.records, run.duration, slo or None)
    print(format_table(label, summary))
    if by_label := format_by_label(run.records):
        print(by_label)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    write_json(out / f"{stem}.json", result_json(config | {"slo": slo}, summary, run))
    write_png(out / f"{stem}.png", label, run, summary)
    print(f"wrote {out / stem}.json and .png")
    return summary
