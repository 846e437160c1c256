"""The report command: the committed results become one table per capability and the plots,
and the narrative around the tables is kept (``python benchmarks/report.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from . import report

RESULTS = Path(__file__).parent / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def _doc(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    doc = out / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro kept\n\n{report.BEGIN}\nold tables\n{report.END}\n\nafterword kept\n")
    return doc


def test_report_writes_tables_and_plots(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "docs")
    report.main(["--results", str(RESULTS), "--out", str(tmp_path / "docs")])
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro kept\n") and text.endswith("afterword kept\n")
    assert "old tables" not in text
    for f in sorted(RESULTS.glob("*.json")):
        rows = json.loads(f.read_text())
        assert f"### {f.stem}\n" in text
        for r in rows:
            assert f"| {r['name']} |" in text, (f.stem, r["name"])
    for png in ("e2e_samples_per_s.png", "step_time_breakdown.png", "projected_scaling.png"):
        path = tmp_path / "docs" / "img" / png
        assert path.read_bytes()[:8] == PNG, png
        assert f"](img/{png})" in text


def test_report_without_matplotlib_is_one_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    doc = _doc(tmp_path / "docs")
    before = doc.read_text()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exc:
        report.main(["--results", str(RESULTS), "--out", str(tmp_path / "docs")])
    assert exc.value.code == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert doc.read_text() == before  # nothing half-written
    report.main(["--results", str(RESULTS), "--out", str(tmp_path / "docs"), "--no-plots"])
    assert "### e2e" in doc.read_text() and "](img/" not in doc.read_text()
    assert not (tmp_path / "docs" / "img").exists()
