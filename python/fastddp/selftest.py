"""``python -m fastddp.selftest``: is this machine's distributed set-up usable?

Prints a pass/fail table: fastddp build, torch.distributed, gloo and NCCL availability, the
NCCL version, the GPUs, and an all-reduce across ranks (all of them under torchrun, else a
world of one). Exit status 0 when every check that applies passed.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from ._net import finish_collectives


def _checks() -> list[tuple[str, bool | None, str]]:
    import torch
    import torch.distributed as dist

    rows: list[tuple[str, bool | None, str]] = []
    try:
        import fastddp

        info = fastddp.build_info()
        rows.append(("fastddp build", True, f"{info['version']} (torch {info['torch_version']}, "
                                            f"CUDA kernels {'on' if info['cuda'] else 'off'})"))
    except Exception as exc:
        rows.append(("fastddp build", False, str(exc)))
    rows.append(("torch.distributed", dist.is_available(), torch.__version__))
    rows.append(("gloo backend", dist.is_available() and dist.is_gloo_available(), ""))
    nccl = dist.is_available() and dist.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "not built in"
    gpus = torch.cuda.device_count()
    rows.append(("NCCL backend", nccl if gpus else None,
                 f"NCCL {version}" + ("" if gpus else " (no GPU: not needed)")))
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none (CPU ranks use gloo)"
    rows.append(("GPUs", None if not gpus else True, f"{gpus}: {names}"))

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_nccl = gpus > 0 and nccl
    backend = "nccl" if use_nccl else "gloo"
    try:
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
        device = torch.device("cuda", local % gpus) if use_nccl else torch.device("cpu")
        if use_nccl:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        expected = world * (world + 1) / 2
        ok = bool(torch.all(t == expected))
        rows.append((f"all-reduce ({backend}, {world} rank(s))", ok,
                     f"got {t[0].item():g}, expected {expected:g}"))
        finish_collectives()  # no collective left for a gloo thread to free at exit
        dist.destroy_process_group()
    except Exception as exc:
        rows.append((f"all-reduce ({backend}, {world} rank(s))", False, str(exc).splitlines()[0]))
    return rows


def main() -> int:
    rows = _checks()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        width = max(len(r[0]) for r in rows)
        print(f"{'check'.ljust(width)}  result  detail")
        for name, ok, detail in rows:
            mark = "PASS" if ok else ("n/a " if ok is None else "FAIL")
            print(f"{name.ljust(width)}  {mark}    {detail}")
    failed = [r for r in rows if r[1] is False]
    if rank == 0:
        print("selftest: " + ("PASS" if not failed else f"FAIL ({len(failed)} check(s))"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
