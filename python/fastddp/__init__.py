"""fastddp: data-parallel PyTorch training with a C++/CUDA core.

Public API (imported lazily, so ``import fastddp`` stays cheap)::

    fastddp.DDPWrapper          # drop-in for torch.nn.parallel.DistributedDataParallel
    fastddp.GradScaler          # fused AMP loss scaler (unscale + inf check + clip, no host sync)
    fastddp.DistributedSampler  # torch's order, built in C++ on tensors
    fastddp.PrefetchLoader      # C++ threads gather batches into pinned rings
    fastddp.DesyncError         # the ranks of a DDPWrapper are out of step (raised on every rank)
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed

from ._ext import C as _C

if torch.distributed.is_available():
    # torch.distributed.nn.functional binds the default process group as its collectives'
    # default argument when first imported, and torch._dynamo imports it (the first optimizer a
    # process builds does, so does DDPWrapper's torch.compile marking). Imported after
    # init_process_group, it keeps the group alive past destroy_process_group(), and with it
    # gloo's threads: one still freeing a collective's tensors when the interpreter finalizes
    # aborts the process ("terminate called without an active exception"). Imported here, in a
    # script that imports fastddp before it makes a group, the defaults are None.
    import torch.distributed.nn

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY = {
    "DistributedSampler": "sampler",
    "DDPWrapper": "ddp",
    "DesyncError": "ddp.fingerprint",
    "GradScaler": "amp",
    "PrefetchLoader": "loader",
}

__all__ = ["__version__", "build_info", *sorted(_LAZY)]


def build_info() -> dict[str, Any]:
    """What this build of fastddp was compiled with.

    Returns a dict with the fastddp version, the torch version it was built against, whether
    the CUDA kernels were compiled (and for which architectures), whether torch.distributed and
    NCCL are available at run time, and the compiled capabilities.
    """
    import torch

    from . import _build_info as b

    info = dict(_C._build_info())
    info["cuda_archs"] = [a for a in b.CUDA_ARCHS.split(";") if a]
    info["torch_cuda"] = b.TORCH_CUDA or None
    info["sanitize"] = b.SANITIZE or None
    dist_ok = torch.distributed.is_available()
    info["nccl_available"] = bool(dist_ok and torch.distributed.is_nccl_available())
    info["gloo_available"] = bool(dist_ok and torch.distributed.is_gloo_available())
    info["nccl_version"] = (
        ".".join(map(str, torch.cuda.nccl.version())) if info["nccl_available"] else None
    )
    return info


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
