"""torch's own DistributedDataParallel tests (``torch.testing._internal.distributed.
distributed_test``, shipped in the wheel) run on gloo with DDPWrapper in torch DDP's place.

    python benchmarks/torch_suites/run_ddp.py [--torch] [--on-cpu] [-k PATTERN] [--json OUT]

Every ``_DistTestBase`` test whose name mentions DDP or whose body uses DistributedDataParallel
runs in torch's own harness (two spawned ranks, file:// rendezvous). With ``--torch`` the stock
class runs, for the baseline of what passes on this machine at all (most DDP cases need GPUs
and skip). ``--on-cpu`` runs the GPU-gated cases on the CPU ranks too (cpu_shims.py, the same
shims for both classes). Prints one line per test and a summary; ``--json`` writes
``{test: [outcome, reason]}``. The list of cases that fail only with DDPWrapper, with the
reason, is kept in docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import unittest

# distributed_test reads these at import, in the parent and in every spawned rank.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="fastddp-torch-suite-"))
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")

import torch
import torch.nn.parallel
from torch.testing._internal.distributed import distributed_test as dt

import fastddp

SWAP = os.environ.get("FASTDDP_SUITE_STOCK") != "1"
ON_CPU = os.environ.get("FASTDDP_SUITE_ON_CPU") == "1"
if ON_CPU:  # in the spawned ranks too: they import this module afresh
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_shims

    cpu_shims.apply(dt, fastddp.DDPWrapper if SWAP else torch.nn.parallel.DistributedDataParallel)
elif SWAP:  # every spelling the suite uses: the module global and torch.nn.parallel's attribute
    dt.DistributedDataParallel = fastddp.DDPWrapper
    torch.nn.parallel.DistributedDataParallel = fastddp.DDPWrapper


class TestDDPOnGloo(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def _uses_ddp(name: str) -> bool:
    """The test's name mentions DDP, or its body builds a DistributedDataParallel."""
    if "ddp" in name.lower() or "distributeddataparallel" in name.lower():
        return True
    try:
        source = inspect.getsource(inspect.unwrap(getattr(TestDDPOnGloo, name)))
    except (OSError, TypeError):
        return False
    return "DistributedDataParallel" in source or "_test_ddp" in source or "_test_DDP" in source


def _selected(pattern: str) -> list[str]:
    names = unittest.TestLoader().getTestCaseNames(TestDDPOnGloo)
    return [n for n in names if _uses_ddp(n) and pattern.lower() in n.lower()]


class _Collect(unittest.TextTestResult):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.outcomes: dict[str, tuple[str, str]] = {}

    def _last_line(self, test, err) -> str:
        text = self._exc_info_to_string(err, test)
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]  # a rank's exception
        return (errors or lines or [""])[-1][:300]

    def addSuccess(self, test) -> None:
        super().addSuccess(test)
        self.outcomes[test._testMethodName] = ("pass", "")

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self.outcomes[test._testMethodName] = ("fail", self._last_line(test, err))

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self.outcomes[test._testMethodName] = ("error", self._last_line(test, err))

    def addSkip(self, test, reason) -> None:
        super().addSkip(test, reason)
        self.outcomes[test._testMethodName] = ("skip", str(reason)[:200])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch", action="store_true", help="run stock torch DDP (the baseline)")
    p.add_argument("--on-cpu", action="store_true", help="run the GPU-gated cases on the CPU ranks (cpu_shims.py)")
    p.add_argument("-k", default="", help="only tests whose name contains this")
    p.add_argument("--cases", default="", help="only these tests (comma-separated names, e.g. those a --torch "
                                               "--json run passed)")
    p.add_argument("--json", help="write {test: [outcome, reason]} here")
    args = p.parse_args()
    if args.torch or args.on_cpu:  # the spawned ranks import this module afresh: tell them through the env
        os.environ["FASTDDP_SUITE_STOCK" if args.torch else "FASTDDP_SUITE_ON_CPU"] = "1"
        flag = "--torch" if args.torch else "--on-cpu"
        os.execv(sys.executable, [sys.executable, *sys.argv[:1], *[a for a in sys.argv[1:] if a != flag]])
    wanted = {n for n in args.cases.split(",") if n}
    suite = unittest.TestSuite(TestDDPOnGloo(n) for n in _selected(args.k) if not wanted or n in wanted)
    result = unittest.TextTestRunner(resultclass=_Collect, verbosity=2, stream=sys.stdout).run(suite)
    side = "DDPWrapper" if SWAP else "torch DDP"
    counts = {k: sum(1 for o, _ in result.outcomes.values() if o == k)
              for k in ("pass", "fail", "error", "skip")}
    print(f"\n{side}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    for name, (outcome, reason) in sorted(result.outcomes.items()):
        if outcome in ("fail", "error"):
            print(f"  {outcome}: {name}: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
