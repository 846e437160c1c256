"""Run torch's own DataLoader tests with ``fastddp.PrefetchLoader`` in DataLoader's place.

torch's ``test/test_dataloader.py`` is not in the wheel: pass the file from a pytorch checkout
at the installed torch's commit. The test module is imported from that path, its ``DataLoader``
(and ``torch.utils.data.DataLoader`` while the tests run) becomes PrefetchLoader, the chosen
TestCase classes run, and every test that does not pass is listed with its reason::

    python benchmarks/torch_suites/run_dataloader.py ~/pytorch/test/test_dataloader.py \\
        --classes TestDataLoader TestDictDataLoader --out dataloader_failures.md
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import unittest
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.utils.data

import fastddp


@contextmanager
def swapped(module: Any) -> Iterator[None]:
    """PrefetchLoader in DataLoader's place, for the test module and torch.utils.data."""
    saved = module.DataLoader, torch.utils.data.DataLoader
    module.DataLoader = torch.utils.data.DataLoader = fastddp.PrefetchLoader
    try:
        yield
    finally:
        module.DataLoader, torch.utils.data.DataLoader = saved


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("torch_suite_under_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"run_dataloader: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def reason(err: Any) -> str:
    """The last line of a formatted traceback: the exception and its message."""
    trailer = ("To execute this test", "python ", "This message can be suppressed")  # torch's TestCase
    lines = [line for line in str(err).strip().splitlines()
             if line.strip() and not line.strip().startswith(trailer)]
    return lines[-1].strip() if lines else "?"


def run_suite(path: Path, classes: Sequence[str] = (), pattern: str = "") -> list[tuple[str, str, str]]:
    """(test id, outcome, reason) for every test of ``classes`` (default: each TestCase class
    whose name mentions DataLoader) whose id contains ``pattern``, run with the swap."""
    module = load(path)
    names = list(classes) or [n for n, v in vars(module).items()
                              if isinstance(v, type) and issubclass(v, unittest.TestCase) and "DataLoader" in n]
    suite = unittest.TestSuite()
    for name in names:
        for test in unittest.defaultTestLoader.loadTestsFromTestCase(getattr(module, name)):
            if pattern in test.id():
                suite.addTest(test)
    ids = [t.id() for t in suite]  # a suite drops its tests as it runs them
    result = unittest.TestResult()
    with swapped(module):
        suite.run(result)
    rows = [(t.id(), "failed", reason(e)) for t, e in result.failures]
    rows += [(t.id(), "error", reason(e)) for t, e in result.errors]
    rows += [(t.id(), "skipped", str(why)) for t, why in result.skipped]
    bad = {r[0] for r in rows}
    rows += [(tid, "passed", "") for tid in ids if tid not in bad]
    return sorted(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="pytorch's test/test_dataloader.py")
    parser.add_argument("--classes", nargs="*", default=[], help="TestCase classes to run")
    parser.add_argument("-k", dest="pattern", default="", help="only test ids containing this")
    parser.add_argument("--out", type=Path, help="write the table of tests that do not pass here")
    args = parser.parse_args(argv)
    rows = run_suite(args.tests, args.classes, args.pattern)
    table = ["| torch test | outcome | reason |", "|---|---|---|"]
    table += [f"| `{tid}` | {outcome} | {why.replace('|', '/')} |" for tid, outcome, why in rows
              if outcome in ("failed", "error")]
    passed = sum(r[1] == "passed" for r in rows)
    print(f"{passed} of {len(rows)} passed ({sum(r[1] == 'skipped' for r in rows)} skipped)")
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0 if passed + sum(r[1] == "skipped" for r in rows) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
