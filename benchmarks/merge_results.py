"""Merge the JSON results of another machine (e.g. the folder `benchmarks/gpu.sh` wrote) into
benchmarks/results/, row by row (a row of the same name is replaced).

    python benchmarks/merge_results.py GPU_OUT_DIR && python benchmarks/report.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def merge(src: Path, dst: Path = RESULTS) -> list[str]:
    """Merge every ``*.json`` of ``src`` into ``dst``; returns the row names merged."""
    merged: list[str] = []
    for path in sorted(src.glob("*.json")):
        new = json.loads(path.read_text())
        target = dst / path.name
        rows = json.loads(target.read_text()) if target.exists() else []
        names = {r["name"] for r in new}
        rows = [r for r in rows if r["name"] not in names] + new
        target.write_text(json.dumps(rows, indent=1))
        merged += [f"{path.stem}/{n}" for n in sorted(names)]
    return merged


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/merge_results.py DIR  (a folder of result *.json files)")
    for name in merge(Path(sys.argv[1])):
        print("merged", name)
