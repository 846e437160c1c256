"""torch DDP's ``_get_ddp_logging_data()`` for a DDPWrapper.

torch DDP's C++ logger keeps a dict of the run's configuration and of its bucket layout, which
libraries read (Lightning's ``DDPStrategy.teardown`` asks it for ``can_set_static_graph``). The
wrapper answers with the same keys, types and formats for what it has: the configuration, the
environment torch records, the bucket sizes before and after the rebuild, the parameters'
arrival order. torch's sampled timings (``avg_forward_compute_time`` ...), its iteration
counters and ``can_set_static_graph`` are absent (the last was absent from torch's dict too in
the runs compared: a ``.get()`` of it reads None from both).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

# The environment torch's logger records, "N/A" when unset
_ENVIRONMENT = {"cuda_visible_devices": "CUDA_VISIBLE_DEVICES", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT",
                "gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "master_addr": "MASTER_ADDR",
                "master_port": "MASTER_PORT", "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG"}
# c10's names of the dtypes, as torch's logger writes them
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16"}


def _joined(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def bucket_bytes(params: list[torch.Tensor], layout: list[list[int]]) -> list[int]:
    """Bytes of each bucket of ``layout`` (parameter indices per bucket), as torch counts them."""
    return [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in layout]


def logging_data(ddp: Any, bucketed: list[torch.Tensor], layout: list[list[int]],
                 before_rebuild: Optional[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """The dict torch DDP's ``_get_ddp_logging_data()`` returns, for the wrapper ``ddp`` (read
    through torch DDP's public attributes). ``bucketed`` are the parameters in the buckets,
    ``layout`` their indices per bucket now; ``before_rebuild``, once the buckets were rebuilt,
    the bucket sizes before it and the gradients' arrival order it followed."""
    params: list[torch.Tensor] = ddp.reduced_parameters()
    data: dict[str, Any] = {key: os.environ.get(var, "N/A") for key, var in _ENVIRONMENT.items()}
    initial = bucket_bytes(bucketed, layout) if before_rebuild is None else before_rebuild[0]
    data.update({
        "backend_name": ddp.process_group.name(),
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
        "rank": ddp.rank,
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "world_size": ddp.world_size,
    })
    if before_rebuild is not None:
        data["has_rebuilt_buckets"] = 1
        data["rebuilt_bucket_sizes"] = _joined(bucket_bytes(bucketed, layout))
        data["rebuilt_per_bucket_param_indices"] = _joined([" ".join(map(str, b)) for b in layout])
        data["prev_iteration_grad_ready_order_indices"] = _joined(before_rebuild[1])
    return data
