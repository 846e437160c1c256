"""Run torch's GPU-gated DistributedDataParallel cases on CPU ranks (``run_ddp.py --on-cpu``).

Most of ``distributed_test``'s DDP cases are decorated to skip below two GPUs and place their
models with ``.cuda(rank)``. With these shims, applied alike to the stock class and to
DDPWrapper, they run on two gloo CPU ranks: the GPU-count skips are unwrapped, CUDA placement
(``.cuda()``, ``.to(rank)``, ``device=rank``) becomes CPU, and the wrapper class drops
``device_ids``/``output_device`` (which torch refuses for a CPU module). A case that still
needs CUDA (SyncBatchNorm, streams, CUDA AMP) fails alike for both classes; only the cases that
pass with stock torch count.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_GPU_SKIPS = ("skip_if_lt_x_gpu", "skip_if_no_gpu", "require_n_gpus_for_nccl_backend")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    return (isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda"))
            or (isinstance(device, torch.device) and device.type == "cuda"))


class _OnCpu(TorchFunctionMode):
    """Tensor placement on a CUDA device lands on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0].clone()
        if func is torch.Tensor.to:
            args = (args[0], *("cpu" if _is_cuda(a) else a for a in args[1:]))
        return func(*args, **kwargs)


def _is_gpu_skip(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and any(name in code.co_qualname for name in _GPU_SKIPS)


def _without_gpu_skips(fn: Any) -> Any:
    """``fn`` with every GPU-count skip decorator in its wrapper chain bypassed."""
    while _is_gpu_skip(fn) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    outer = fn
    while hasattr(outer, "__wrapped__"):
        inner = outer.__wrapped__
        if _is_gpu_skip(inner) and outer.__closure__:
            target = inner
            while _is_gpu_skip(target):
                target = target.__wrapped__
            for cell in outer.__closure__:  # the outer decorator calls `inner` through its closure
                with contextlib.suppress(ValueError):
                    if cell.cell_contents is inner:
                        cell.cell_contents = target
            outer.__wrapped__ = target
            inner = target
        outer = inner
    return fn


def apply(distributed_test: Any, wrapper_class: type) -> None:
    """Patch ``distributed_test`` (the module) and torch so that its DDP cases run on CPU ranks
    with ``wrapper_class`` as DistributedDataParallel."""

    class OnCpu(wrapper_class):  # type: ignore[misc, valid-type]
        def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None,
                     *args: Any, **kwargs: Any) -> None:
            super().__init__(module, None, None, *args, **kwargs)

    OnCpu.__name__ = OnCpu.__qualname__ = wrapper_class.__name__
    globals()[OnCpu.__name__] = OnCpu  # where pickle looks a model's class up (cases that pickle one)
    distributed_test.DistributedDataParallel = OnCpu
    torch.nn.parallel.DistributedDataParallel = OnCpu
    _OnCpu().__enter__()  # for the rest of the process: every case runs under it
    nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign]
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.device_count = lambda: 2
    torch.cuda.current_device = lambda: 0
    base = distributed_test.DistributedTest._DistTestBase
    for name, fn in list(vars(base).items()):
        if not name.startswith("test"):
            continue
        unwrapped = _without_gpu_skips(fn)
        if unwrapped is not fn:
            for flag in ("__unittest_skip__", "__unittest_skip_why__"):
                if hasattr(fn, flag):
                    setattr(unwrapped, flag, getattr(fn, flag))
            setattr(base, name, unwrapped)
