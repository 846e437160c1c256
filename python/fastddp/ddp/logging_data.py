"""torch DDP's ``_get_ddp_logging_data()`` for a DDPWrapper.

torch DDP's C++ logger keeps a dict of the run's configuration, its bucket layout and sampled
runtime statistics, which libraries and scripts read (Lightning's ``DDPStrategy.teardown`` asks
it for ``can_set_static_graph``). The wrapper answers with the same keys, types and formats: the
configuration and the environment torch records (read from the wrapper when asked), the bucket
sizes before and after the rebuild, the parameters' arrival order, and what :class:`RunLog`
records as the wrapper runs: torch's iteration count, its samples of the forward, backward and
communication times (the first 10 iterations, then every ``sample_rate``-th), the
communication hook, ``join()`` and the errors torch's logger keeps. The times are host times
on every device (torch measures CUDA modules' durations with CUDA events).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from .._pg_options import gloo_threads

# The environment torch's logger records ("N/A" when unset): for every backend, and for its own
_ENVIRONMENT = {"cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",), "master_addr": ("MASTER_ADDR",),
                "master_port": ("MASTER_PORT",), "torch_distributed_debug": ("TORCH_DISTRIBUTED_DEBUG",)}
_BACKEND_ENVIRONMENT = {
    "gloo": {"gloo_device_transport": ("GLOO_DEVICE_TRANSPORT",), "gloo_socket_ifname": ("GLOO_SOCKET_IFNAME",)},
    "nccl": {"nccl_socket_ifname": ("NCCL_SOCKET_IFNAME",),
             "nccl_blocking_wait": ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
             "nccl_async_error_handling": ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
             "nccl_debug": ("NCCL_DEBUG",), "nccl_nthreads": ("NCCL_NTHREADS",),
             "nccl_ib_timeout": ("NCCL_IB_TIMEOUT",)},
}
# torch's sampled durations: (key, start event, end event), the events being IterationStats's
# (C++) and the forward's start (RunLog's)
_DURATIONS = (("forward_compute_time", "forward_start", "backward_compute_start"),
              ("backward_compute_time", "backward_compute_start", "backward_compute_end"),
              ("backward_comm_time", "backward_comm_start", "backward_comm_end"),
              ("backward_compute_comm_overlap_time", "backward_comm_start", "backward_compute_end"))
_TIMESTAMPS = (("forward_compute_time_start", "forward_start"),
               ("backward_compute_time_start", "backward_compute_start"),
               ("backward_comm_time_start", "backward_comm_start"),
               ("backward_compute_time_end", "backward_compute_end"),
               ("backward_comm_time_end", "backward_comm_end"))
DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate


class RunLog:
    """What torch DDP's C++ logger records while a wrapper runs, and when: the iterations
    (forwards with gradients on outside ``no_sync()``, counted as each starts), a sample taken
    as an iteration starts (after iterations 1 to 10, then every ``sample_rate``-th) of the
    iteration before it (its times, unused parameters, gradient arrival order) and of the
    bucket rebuild, the communication hook's name, whether ``join()`` was entered, and the last
    error torch's logger would have recorded."""

    def __init__(self) -> None:
        self.iterations = 0
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.comm_hook: Optional[str] = None
        self.joined = False
        self.error: Optional[str] = None
        self._reducer_error = ""
        self._forward_start = -1
        self._samples_taken = 0
        self._samples: dict[str, int] = {}

    def forward_starting(self, reducer: Any,
                         rebuilt_layout: Callable[[], Optional[tuple[list[int], list[list[int]]]]]) -> None:
        """A forward that arms a reduction starts (torch's ``set_runtime_stats_and_log`` and
        ``prepare_for_forward``): sample the iteration before it when torch would, then count it.
        ``rebuilt_layout()`` gives the bucket sizes and parameter indices once the buckets were
        rebuilt (None before)."""
        done = self.iterations
        # (not while torch.jit.trace records the forward: the sizes would enter its graph)
        if done > 0 and (done <= 10 or done % self.sample_rate == 0) and not torch.jit.is_tracing():
            self._sample(done, reducer.iteration_stats(), rebuilt_layout())
        self.iterations = done + 1
        self._forward_start = time.time_ns()

    def _sample(self, iteration: int, stats: dict[str, Any],
                rebuilt: Optional[tuple[list[int], list[list[int]]]]) -> None:
        self._samples_taken += 1
        samples = self._samples
        samples["iteration"] = iteration
        samples["unused_parameter_size"] = stats["unused_parameter_bytes"]
        if rebuilt is not None and not samples.get("has_rebuilt_buckets"):
            samples["rebuilt_bucket_sizes"] = _joined(rebuilt[0])
            samples["rebuilt_per_bucket_param_indices"] = _joined([" ".join(map(str, b)) for b in rebuilt[1]])
        samples["has_rebuilt_buckets"] = int(rebuilt is not None)
        if stats["ready_order"]:
            samples["prev_iteration_grad_ready_order_indices"] = _joined(stats["ready_order"])
        samples["num_buckets_reduced"] = stats["buckets_reduced"]
        events: dict[str, int] = {name: stats[name] for _, name in _TIMESTAMPS[1:]}
        events["forward_start"] = self._forward_start
        for key, start_event, end_event in _DURATIONS:
            start, end = events[start_event], events[end_event]
            samples[key] = 0
            if start < 0 or end < start:  # not reached in that iteration: torch skips it too
                continue
            samples[key] = end - start
            average = samples.get("avg_" + key, 0)
            samples["avg_" + key] = (end - start + average * (self._samples_taken - 1)) // self._samples_taken
        for key, event in _TIMESTAMPS:
            samples[key] = max(int(events[event]), 0)

    def set_sample_rate(self, sample_rate: int, reducer_error: str) -> None:
        """torch DDP's ``_set_ddp_runtime_logging_sample_rate`` (``reducer_error``: see note_error)."""
        if sample_rate < 1:
            error = ValueError("DDP runtime logging sample rate should be equal or greater than 1")
            self.note_error(f"{ValueError}: {error}", reducer_error)
            raise error
        self.sample_rate = int(sample_rate)

    def note_error(self, message: str, reducer_error: str) -> None:
        """Record an error the wrapper raises, as torch's logger keeps it; ``reducer_error`` is
        the reducer's logged error at that moment, which came before it."""
        self.note_reducer_error(reducer_error)
        self.error = message

    def note_reducer_error(self, message: str) -> None:
        """The C++ reducer's last logged error (``Reducer.logged_error``), kept once it changes."""
        if message and message != self._reducer_error:
            self._reducer_error = self.error = message

    def entries(self) -> dict[str, Any]:
        """The keys this log adds to ``_get_ddp_logging_data()``."""
        out: dict[str, Any] = {"iteration": 0}
        if self.comm_hook is not None:
            out["comm_hook"] = self.comm_hook
        if self.joined:
            out["join_uneven_inputs"] = 1
        if self.error is not None:
            out.update(has_error=1, error=self.error)
        out.update(self._samples)
        return out


def _environment(backend: str) -> dict[str, str]:
    names = dict(_ENVIRONMENT, **_BACKEND_ENVIRONMENT.get(backend, {}))
    return {key: next((os.environ[v] for v in variables if v in os.environ), "N/A")
            for key, variables in names.items()}


# c10's names of the dtypes, as torch's logger writes them
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16"}


def _joined(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def bucket_bytes(params: list[torch.Tensor], layout: list[list[int]]) -> list[int]:
    """Bytes of each bucket of ``layout`` (parameter indices per bucket), as torch counts them."""
    return [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in layout]


def logging_data(ddp: Any, bucketed: list[torch.Tensor], layout: list[list[int]],
                 sizes_before_rebuild: Optional[list[int]], run: RunLog) -> dict[str, Any]:
    """The dict torch DDP's ``_get_ddp_logging_data()`` returns, for the wrapper ``ddp`` (read
    through torch DDP's public attributes). ``bucketed`` are the parameters in the buckets,
    ``layout`` their indices per bucket now; ``sizes_before_rebuild``, once the buckets were
    rebuilt, the bucket sizes before it; ``run`` what the wrapper recorded as it ran."""
    params: list[torch.Tensor] = ddp.reduced_parameters()
    backend = ddp.process_group.name()
    data: dict[str, Any] = _environment(backend)
    threads = gloo_threads(ddp.process_group) if backend == "gloo" else None
    if threads is not None:
        data["gloo_num_threads"] = threads
    if ddp.static_graph:
        data["static_graph"] = 1
    initial = bucket_bytes(bucketed, layout) if sizes_before_rebuild is None else sizes_before_rebuild
    data.update({
        "backend_name": backend,
        "bucket_sizes": _joined(initial),
        "device_ids": _joined(ddp.device_ids or []),
        "dtypes": _joined(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
        "module_name": type(ddp.module).__name__,
        "broadcast_buffers": int(bool(ddp.forward_sync_buffers)),
        "bucket_cap_bytes": int(ddp.bucket_bytes_cap),
        "find_unused_parameters": int(bool(ddp.find_unused_parameters)),
        "gradient_as_bucket_view": int(bool(ddp.gradient_as_bucket_view)),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
        "is_multi_device_module": int(ddp.is_multi_device_module),
        "num_parameter_tensors": len(params),
        "output_device": -1 if ddp.output_device is None else int(ddp.output_device),
        "rank": ddp.process_group.rank(),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "world_size": ddp.process_group.size(),
    })
    data.update(run.entries())
    return data
