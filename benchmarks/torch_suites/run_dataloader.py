"""Run torch's own DataLoader tests with ``fastddp.PrefetchLoader`` in DataLoader's place.

torch's ``test/test_dataloader.py`` is not in the wheel: pass the file from a pytorch checkout
at the installed torch's commit. The test module is imported from that path under its own name
(it imports itself, and spawned children find its classes by that name), its ``DataLoader``
(and ``torch.utils.data.DataLoader`` while the tests run) becomes PrefetchLoader, the chosen
TestCase classes run, and every test that does not pass is listed with its reason::

    python benchmarks/torch_suites/run_dataloader.py ~/pytorch/test/test_dataloader.py \\
        --classes TestDataLoader TestDictDataLoader --out dataloader_failures.md

Child processes the tests start with ``spawn`` (a loader built inside a child, to watch it time
out or crash) import torch afresh: a ``sitecustomize`` the runner puts first on their
``PYTHONPATH`` makes their DataLoader PrefetchLoader too (it shadows another ``sitecustomize``
in those children). Without ``--classes`` every TestCase class whose source builds a DataLoader
runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile
import unittest
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.utils.data

import fastddp

_CHILD_SWAP = """import os
if os.environ.get("FASTDDP_SWAP_DATALOADER") == "1":
    import torch.utils.data
    import fastddp
    torch.utils.data.DataLoader = fastddp.PrefetchLoader
"""


@contextmanager
def swapped(module: Any) -> Iterator[None]:
    """PrefetchLoader in DataLoader's place, for the test module, torch.utils.data and the
    processes the tests spawn."""
    saved = module.DataLoader, torch.utils.data.DataLoader
    saved_env = {k: os.environ.get(k) for k in ("FASTDDP_SWAP_DATALOADER", "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix="fastddp_swap_") as child_site:
        Path(child_site, "sitecustomize.py").write_text(_CHILD_SWAP)
        os.environ["FASTDDP_SWAP_DATALOADER"] = "1"
        package_root = str(Path(fastddp.__file__).resolve().parents[1])  # fastddp, at their start
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [child_site, package_root, *filter(None, [saved_env["PYTHONPATH"]])])
        module.DataLoader = torch.utils.data.DataLoader = fastddp.PrefetchLoader
        try:
            yield
        finally:
            module.DataLoader, torch.utils.data.DataLoader = saved
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def load(path: Path) -> Any:
    sys.path.insert(0, str(path.parent))  # the file imports itself and its siblings
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"run_dataloader: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def builds_a_loader(cls: type) -> bool:
    """Whether a TestCase class's own source builds a DataLoader."""
    try:
        return "DataLoader(" in inspect.getsource(cls)
    except (OSError, TypeError):  # a class made at run time (torch's per-device copies)
        return False


def reason(err: Any) -> str:
    """The last line of a formatted traceback: the exception and its message."""
    trailer = ("To execute this test", "python ", "This message can be suppressed")  # torch's TestCase
    lines = [line for line in str(err).strip().splitlines()
             if line.strip() and not line.strip().startswith(trailer)]
    return lines[-1].strip() if lines else "?"


def run_suite(path: Path, classes: Sequence[str] = (), pattern: str = "") -> list[tuple[str, str, str]]:
    """(test id, outcome, reason) for every test of ``classes`` (default: each TestCase class
    of the module whose source builds a DataLoader) whose id contains ``pattern``, run with the
    swap."""
    module = load(path)
    names = list(classes) or [n for n, v in vars(module).items()
                              if isinstance(v, type) and issubclass(v, unittest.TestCase)
                              and v.__module__ == module.__name__ and builds_a_loader(v)]
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
    for cls in sorted({tid.split(".")[-2] for tid, _, _ in rows}):
        outcomes = [o for tid, o, _ in rows if tid.split(".")[-2] == cls]
        print(f"{cls}: {len(outcomes)} run, " + ", ".join(
            f"{outcomes.count(o)} {o}" for o in ("passed", "failed", "error", "skipped") if o in outcomes))
    print(f"{passed} of {len(rows)} passed ({sum(r[1] == 'skipped' for r in rows)} skipped)")
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0 if passed + sum(r[1] == "skipped" for r in rows) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
