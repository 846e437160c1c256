"""Run PyTorch's own DistributedSampler and GradScaler test cases against fastddp's classes.

torch's test files are loaded at run time from a PyTorch source tree (``--pytorch-src DIR`` or
``FASTDDP_PYTORCH_SRC``; the wheel ships none of them); nothing of torch's is copied here.
From each file only the selected test methods of the named classes run, with the classes'
fixtures and the module's imports, while ``torch.utils.data.distributed.DistributedSampler``
and ``torch.amp.GradScaler`` are fastddp's:

    test/test_dataloader.py  TestDataLoader       cases that use DistributedSampler
    test/test_torch.py       TestTorchDeviceType  test_grad_scal* and cases that use GradScaler
    test/test_cuda.py        TestCuda             cases that use GradScaler (CUDA only)

A file or class that is absent is reported as skipped with the reason. Each case reports
pass/fail/error/skip and whether it constructed a fastddp object at all (a case that passes
without touching ours proves nothing). torch's deprecated ``torch.cuda.amp.GradScaler`` /
``torch.cpu.amp.GradScaler`` are not swapped: fastddp replaces ``torch.amp.GradScaler``.

    python benchmarks/torch_suites/run_sampler_scaler.py --pytorch-src ~/src/pytorch [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import os
import sys
import unittest
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import fastddp


@dataclass
class Suite:
    """One torch test file, the class whose cases run, and which of its tests are selected."""

    path: str
    cls: str
    select: Callable[[ast.FunctionDef, str], bool]
    device_generic: bool = False


def _uses(*names: str) -> Callable[[ast.FunctionDef, str], bool]:
    def select(node: ast.FunctionDef, source: str) -> bool:
        text = ast.get_source_segment(source, node) or ""
        return node.name.startswith("test_grad_scal") or any(n in text for n in names)
    return select


SUITES = [
    Suite("test/test_dataloader.py", "TestDataLoader", _uses("DistributedSampler")),
    Suite("test/test_torch.py", "TestTorchDeviceType", _uses("GradScaler"), device_generic=True),
    Suite("test/test_cuda.py", "TestCuda", _uses("GradScaler")),
]


@dataclass
class Outcome:
    suite: str
    test: str
    status: str  # pass / fail / error / skip
    used_fastddp: bool
    detail: str


class _Counter:
    """Counts fastddp objects built while a test runs. The classes' own ``__init__`` is wrapped
    in place while the swap lasts, so the swapped name is fastddp's class itself (a subclass
    with its name would not pickle: pickle finds the original under that name)."""

    built = 0

    @classmethod
    @contextlib.contextmanager
    def counting(cls, *targets: type) -> Iterator[None]:
        saved = [(t, t.__dict__.get("__init__")) for t in targets]
        for target in targets:
            init = target.__init__

            @functools.wraps(init)  # the signature a test may inspect stays the class's
            def __init__(self: Any, *args: Any, _init: Callable[..., None] = init, **kwargs: Any) -> None:
                cls.built += 1
                _init(self, *args, **kwargs)
            target.__init__ = __init__  # type: ignore[misc]
        try:
            yield
        finally:
            for target, init in saved:
                if init is None:
                    del target.__init__
                else:
                    target.__init__ = init  # type: ignore[misc]


@contextlib.contextmanager
def swapped() -> Iterator[None]:
    """torch's DistributedSampler and GradScaler names (``torch.GradScaler`` too, the alias
    torch's own tests use) point at fastddp's classes."""
    import torch.amp.grad_scaler
    import torch.utils.data
    import torch.utils.data.distributed

    sampler, scaler = fastddp.DistributedSampler, fastddp.GradScaler
    targets = [(torch.utils.data.distributed, "DistributedSampler", sampler),
               (torch.utils.data, "DistributedSampler", sampler),
               (torch.amp, "GradScaler", scaler), (torch.amp.grad_scaler, "GradScaler", scaler)]
    if hasattr(torch, "GradScaler"):
        targets.append((torch, "GradScaler", scaler))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    try:
        with _Counter.counting(sampler, scaler):
            for mod, name, new in targets:
                setattr(mod, name, new)
            yield
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def _is_instantiation(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and ast.unparse(node).startswith("instantiate_")


def _has_tests(node: ast.ClassDef) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name.startswith("test") for n in node.body)


def load(suite: Suite, root: Path) -> tuple[list[unittest.TestCase], list[str]]:
    """The selected cases of ``suite`` (built while the swap is active) and notes on what
    could not be loaded."""
    path = root / suite.path
    source = path.read_text()
    tree = ast.parse(source)
    ns: dict[str, Any] = {"__name__": f"torch_suite_{path.stem}", "__file__": str(path)}
    notes: list[str] = []
    found = False
    sys.path.insert(0, str(path.parent))  # torch's test files import their siblings
    for node in tree.body:
        if _is_main_guard(node) or _is_instantiation(node):
            continue
        if isinstance(node, ast.ClassDef) and _has_tests(node):
            if node.name != suite.cls:
                continue  # other test classes: not run, and not built (they may need more)
            found = True
            node.body = [n for n in node.body if not (isinstance(n, ast.FunctionDef) and n.name.startswith("test"))
                         or suite.select(n, source)] or [ast.Pass()]
        try:
            exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), ns)
        except Exception as exc:  # a helper this torch version cannot build: noted, and cases that need it fail
            notes.append(f"line {node.lineno}: {type(exc).__name__}: {exc}")
    if not found:
        return [], notes + [f"class {suite.cls} not found in {suite.path}"]
    classes = [ns[suite.cls]]
    if suite.device_generic:
        from torch.testing._internal.common_device_type import instantiate_device_type_tests

        # torch's function replaces the generic class in the scope it is given by the device ones
        generated: dict[str, Any] = {suite.cls: ns[suite.cls]}
        only = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        instantiate_device_type_tests(ns[suite.cls], generated, only_for=only)
        classes = [c for c in generated.values() if isinstance(c, type)]
    loader = unittest.TestLoader()
    cases = [case for c in classes for case in loader.loadTestsFromTestCase(c)]
    return cases, notes


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.status, self.detail = "pass", ""

    def addFailure(self, test, err) -> None:  # unittest.TestResult API names
        self.status, self.detail = "fail", self._exc_info_to_string(err, test).strip().splitlines()[-1]

    def addError(self, test, err) -> None:
        self.status, self.detail = "error", self._exc_info_to_string(err, test).strip().splitlines()[-1]

    def addSkip(self, test, reason) -> None:
        self.status, self.detail = "skip", reason

    def addExpectedFailure(self, test, err) -> None:
        self.status, self.detail = "pass", "expected failure (as in torch's suite)"

    def addUnexpectedSuccess(self, test) -> None:
        self.status, self.detail = "fail", "unexpected success"


def run_suite(suite: Suite, root: Path) -> list[Outcome]:
    if not (root / suite.path).is_file():
        return [Outcome(suite.path, "*", "skip", False, f"{root / suite.path} not found: pass "
                        "--pytorch-src (a PyTorch source tree) to run these cases")]
    out = []
    with swapped():
        cases, notes = load(suite, root)
        for note in notes:
            out.append(Outcome(suite.path, "(module)", "note", False, note))
        for case in cases:
            before, result = _Counter.built, _Result()
            case.run(result)
            out.append(Outcome(suite.path, case.id().split(".", 1)[-1], result.status,
                               _Counter.built > before, result.detail))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pytorch-src", default=os.environ.get("FASTDDP_PYTORCH_SRC", ""),
                        help="a PyTorch source tree holding test/ (default: $FASTDDP_PYTORCH_SRC)")
    parser.add_argument("--json", default=None, help="also write the outcomes here")
    args = parser.parse_args()
    root = Path(args.pytorch_src).expanduser()
    print(f"torch {torch.__version__}, fastddp from {Path(fastddp.__file__).parent}, tests from {root}")
    outcomes = [o for suite in SUITES for o in run_suite(suite, root)]
    for o in outcomes:
        ours = "ours" if o.used_fastddp else "----"
        print(f"{o.status:5} {ours} {o.suite}::{o.test}" + (f"  -- {o.detail}" if o.detail else ""))
    ran = [o for o in outcomes if o.status in ("pass", "fail", "error")]
    bad = [o for o in ran if o.status != "pass"]
    print(f"{len(ran) - len(bad)} of {len(ran)} run cases pass; "
          f"{sum(o.status == 'skip' for o in outcomes)} skipped")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
