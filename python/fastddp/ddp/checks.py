"""DDPWrapper's argument checks: options the reducer does not implement, bucket caps, the
process group, devices, buffer sync. Each refusal names the argument and the fix. (The check
that every rank built the same model is in rank_check.py.)"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import Backend as C10dBackend


def refuse_unsupported(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any,
                        mixed_precision: Any, skip_all_reduce_unused_params: bool) -> None:
    """torch DDP constructor options the C++ reducer does not implement: one clear error each,
    before anything is communicated, instead of a silently different training."""
    if (delay_all_reduce_named_params is not None) != (param_to_hook_all_reduce is not None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
                         "same time.")  # torch's check, which comes first
    if delay_all_reduce_named_params is not None:
        raise NotImplementedError(
            "DDPWrapper: delay_all_reduce_named_params / param_to_hook_all_reduce are not supported "
            "(every parameter that requires a gradient is bucketed and reduced during backward). "
            "Leave them unset, or use torch's DistributedDataParallel for delayed all-reduces.")
    if mixed_precision is not None:
        raise NotImplementedError(
            "DDPWrapper: mixed_precision (torch DDP's private _MixedPrecision) is not supported. Train "
            "under torch.autocast with fastddp.GradScaler, and pass comm_dtype=torch.bfloat16 (or "
            "torch.float16) to all-reduce the gradients in low precision.")
    if skip_all_reduce_unused_params:
        raise NotImplementedError(
            "DDPWrapper: skip_all_reduce_unused_params=True is not supported; unused parameters are "
            "reduced as zero contributions (find_unused_parameters=True), or, with a fixed set of used "
            "parameters, static_graph=True skips the per-iteration search for them.")
    dynamo = sys.modules.get("torch._dynamo")  # not imported: its settings are the defaults
    if dynamo is not None and dynamo.utils.get_optimize_ddp_mode().startswith("python_reducer"):
        raise NotImplementedError(
            f"DDPWrapper: torch._dynamo.config.optimize_ddp={dynamo.config.optimize_ddp!r} (torch DDP's "
            "Python reducer under compiled autograd) is not supported. Leave it at its default "
            "('ddp_optimizer': torch.compile splits the module at the buckets and DDPWrapper's reducer "
            "reduces them), or use torch's DistributedDataParallel for compiled autograd.")


_MIB = 1024 * 1024
_INT64_MAX = 2**63 - 1


def flags(**values: Any) -> None:
    """Each boolean argument checked with :func:`flag`, in the order given."""
    for name, value in values.items():
        flag(name, value)


def flag(name: str, value: Any) -> bool:
    """A bool argument as torch DDP's C++ reducer and logger take it (pybind11's conversion):
    None is False, anything with ``__bool__`` (an int, a numpy bool, a one-element tensor) is
    its truth value, and the rest (a string, a list) is refused with torch's ``TypeError``."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if getattr(type(value), "__bool__", None) is None:
        raise TypeError(f"DDPWrapper: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def cap_bytes(name: str, value: Any) -> int:
    """A bucket cap in MiB converted to bytes as torch DDP converts it (``int(value * 2**20)``):
    what torch takes (an int, a float, a ``Decimal``, a 0-d tensor) is taken, and what it refuses
    fails with torch's exception type: a string ``ValueError`` (torch repeats it 2**20 times, then
    fails converting that), NaN ``ValueError``, an infinity ``OverflowError``, None ``TypeError``,
    a cap beyond 64-bit bytes ``TypeError`` (torch's reducer constructor's)."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"DDPWrapper: {name} must be a number of MiB (e.g. 25), got "
                         f"{type(value).__name__} {value!r}")
    try:
        n = int(value * _MIB)
    except (TypeError, ValueError, OverflowError) as e:
        raise type(e)(f"DDPWrapper: {name} must be a finite number of MiB (e.g. 25), got {value!r} ({e}); a "
                      "very large cap, e.g. 1e6, puts every parameter in one bucket") from None
    if n > _INT64_MAX:
        raise TypeError(f"DDPWrapper: {name}={value!r} MiB is {n} bytes, more than a 64-bit size holds; a cap "
                        "of 1e6 MiB already puts every parameter in one bucket")
    return n


def bucket_cap(bucket_cap_mb: Any) -> float:
    """``bucket_cap_mb`` as torch DDP takes it (``cap_bytes``), 0 giving each parameter a bucket
    of its own. A negative cap, which torch takes as 0, is refused as the mistake it is."""
    cap_bytes("bucket_cap_mb", bucket_cap_mb)
    if not bucket_cap_mb >= 0:
        raise ValueError(f"DDPWrapper: bucket_cap_mb must be a finite number >= 0 (0: one parameter per "
                         f"bucket), got {bucket_cap_mb}")
    return float(bucket_cap_mb)


def resolve_group(process_group: Optional[dist.ProcessGroup], device_mesh: Any) -> dist.ProcessGroup:
    """torch DDP's rule: the given process group, or the group of a 1-D ``device_mesh``, or
    the default group; not both. The group may be any ``ProcessGroup``: a ``dist.new_group``
    subgroup or one built on a store without a default group."""
    if device_mesh is not None:
        if process_group:  # torch's test: a group, not None
            raise RuntimeError("DDPWrapper: Cannot specify both process_group and device_mesh arguments. "
                               "Pass one of them.")
        if device_mesh.ndim != 1:
            raise RuntimeError(f"DDPWrapper: Only 1D device mesh is supported, but got {device_mesh} "
                               f"({device_mesh.ndim} dimensions); slice the data-parallel dimension, e.g. "
                               "mesh['dp'].")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            # torch DDP's type (its _get_default_group raises ValueError)
            raise ValueError("DDPWrapper: no process_group was given and the default process group is not "
                             "initialised. Call torch.distributed.init_process_group(...) first (torchrun sets "
                             "up the environment for it), or pass process_group=.")
        return dist.group.WORLD
    if isinstance(process_group, C10dBackend):
        # torch DDP refuses a bare backend too (TypeError, from its cross-rank parameter check)
        raise TypeError(f"DDPWrapper: process_group is a {type(process_group).__name__}, a c10d backend, not a "
                        "ProcessGroup. Wrap it as torch DDP needs it: pg = dist.ProcessGroup(store, rank, "
                        "world_size); pg._register_backend(torch.device('cpu'), "
                        "dist.ProcessGroup.BackendType.GLOO, backend); pg._set_default_backend("
                        "dist.ProcessGroup.BackendType.GLOO); or use dist.new_group(...).")
    if not isinstance(process_group, dist.ProcessGroup):
        if process_group == dist.GroupMember.NON_GROUP_MEMBER:  # torch DDP: TypeError too
            raise TypeError("DDPWrapper: this rank is not a member of process_group (dist.new_group returned "
                             "GroupMember.NON_GROUP_MEMBER here); wrap the model only on the group's ranks.")
        raise TypeError(f"DDPWrapper: process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(process_group).__name__}")
    return process_group


def reducer_parameters(module: nn.Module, ignore: Any) -> list[tuple[str, nn.Parameter]]:
    """The parameters torch DDP's reducer takes, in its order, with their qualified names: each
    module's own parameters that require grad, each tensor once, unless
    ``f"{module_name}.{name}"`` is in ``ignore``. That key is torch's: for the root module's own
    parameters it reads ``".name"``, so naming one of them in
    ``_set_params_and_buffers_to_ignore_for_model`` keeps it out of the broadcast at construction
    (which matches qualified names) but not out of the reduction, under torch DDP and here."""
    seen: set[int] = set()
    named: list[tuple[str, nn.Parameter]] = []
    for module_name, owner in module.named_modules():
        for name, p in owner.named_parameters(recurse=False):
            if not p.requires_grad or f"{module_name}.{name}" in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            named.append((f"{module_name}.{name}" if module_name else name, p))
    return named


def backend_name(group: dist.ProcessGroup) -> str:
    """The group's backend name ("gloo", "nccl", ...), also for a group the default group does not
    know (built on a store), whose name dist.get_backend cannot look up."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return group.name().lower()


def bucket_caps(bucket_cap_mb_list: Any) -> Optional[list[float]]:
    """torch DDP's ``bucket_cap_mb_list`` as floats: None when not given or empty (torch's
    ``if bucket_cap_mb_list:``); each entry converted as torch converts it (``cap_bytes``), 0
    giving each parameter a bucket of its own, a negative entry refused as ``bucket_cap_mb``'s."""
    if isinstance(bucket_cap_mb_list, (str, bytes)):  # torch iterates its characters
        raise ValueError(f"DDPWrapper: bucket_cap_mb_list must be a list of numbers of MiB (e.g. [25, 50]), "
                         f"got {type(bucket_cap_mb_list).__name__} {bucket_cap_mb_list!r}")
    if not bucket_cap_mb_list:
        return None
    caps = []
    for cap in bucket_cap_mb_list:
        cap_bytes("every bucket_cap_mb_list entry", cap)
        if not cap >= 0:
            raise ValueError(f"DDPWrapper: every bucket_cap_mb_list entry must be >= 0 (0: one parameter per "
                             f"bucket), got {bucket_cap_mb_list}")
        caps.append(float(cap))
    return caps


def check_comm_dtype(comm_dtype: Optional[torch.dtype]) -> None:
    if comm_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"DDPWrapper: comm_dtype must be torch.bfloat16, torch.float16 or None, got {comm_dtype}")


def check_lazy(module: nn.Module) -> None:
    lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        # torch's sentences first (scripts match them)
        raise RuntimeError("Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                           "Run a dummy forward pass to correctly initialize the modules. (DDPWrapper: "
                           f"parameter {lazy[0]!r} is not initialised yet, a lazy module such as nn.LazyLinear; "
                           "run one forward pass with a sample batch before wrapping the model.)")


def refuse_meta(named: list[tuple[str, nn.Parameter]]) -> None:
    """Parameters on the meta device have no values to broadcast or reduce (torch DDP fails on
    them at construction, inside its cross-rank check)."""
    meta = [n for n, p in named if p.device.type == "meta"]
    if meta:
        raise RuntimeError(f"DDPWrapper: parameter {meta[0]!r} is on the meta device ({len(meta)} of "
                           f"{len(named)} parameters are), so it has no values; materialise the module "
                           "before wrapping it (module.to_empty(device=...), then initialise or load its "
                           "weights).")


def refuse_cpu_sync_batchnorm(module: nn.Module, device_type: str) -> None:
    """torch DDP's refusal of ``nn.SyncBatchNorm`` in a CPU module, at construction with its
    ``ValueError`` (SyncBatchNorm's own check would fail only in a training forward, and an
    evaluation forward would run)."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if names and device_type == "cpu":
        raise ValueError(f"SyncBatchNorm layers only work with GPU modules (DDPWrapper: this module's parameters "
                         f"are on the CPU and {names[0] or 'the module'!r} is a SyncBatchNorm; keep nn.BatchNorm "
                         "layers on the CPU (leave out nn.SyncBatchNorm.convert_sync_batchnorm), or move the "
                         "module to a GPU before wrapping)")


def input_device(named: list[tuple[str, nn.Parameter]], device_ids: Any,
                 output_device: Any) -> Optional[torch.device]:
    """The device forward moves the inputs to (``device_ids``' one device, which must hold every
    parameter), or None; a module spread over several GPUs is refused. ``device_ids`` and
    ``output_device`` are refused where torch DDP refuses them (a CPU module, no
    ``device_ids``), with torch's truth-value test (``output_device=0`` alone passes)."""
    devices = {p.device for _, p in named}
    # torch DDP's messages first (code written for it may match them), then the fix
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or contain a single element. (DDPWrapper: one device "
                         f"per process, as torch DDP; got {device_ids})")
    if not device_ids or all(d.type == "cpu" for d in devices) or len(devices) > 1:
        if device_ids or output_device:
            want = _device_of(device_ids[0]) if device_ids else None
            move = (f"move the module with module.to({str(want)!r}) before wrapping it, or "
                    if want is not None and want.type != "cpu" and len(devices) == 1 else "")
            raise ValueError("DistributedDataParallel device_ids and output_device arguments only work with "
                             "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                             f"{device_ids}, output_device {output_device}, and module parameters {devices}. "
                             f"(DDPWrapper: they need a module on one GPU; {move}leave both unset for a CPU "
                             "module)")
        if len(devices) > 1 and any(d.type == "cuda" for d in devices):
            raise ValueError(f"DDPWrapper: module spans devices {sorted(map(str, devices))}; "
                             "multi-device modules need device_ids=None and are not supported")
        return None
    want = _device_of(device_ids[0])
    wrong = [n for n, p in named if p.device != want]
    if wrong:
        raise ValueError(f"DDPWrapper: device_ids={device_ids} but parameter {wrong[0]!r} is on "
                         f"{dict(named)[wrong[0]].device}; move the module with "
                         f"module.to({str(want)!r}) before wrapping it")
    return want


def _device_of(device_id: Any) -> torch.device:
    """An entry of ``device_ids``: a CUDA index, or a device (or its name)."""
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def buffer_sync(broadcast_buffers: Any, forward_sync_buffers: Any) -> tuple[Any, bool]:
    """``forward_sync_buffers`` as torch DDP sets it (the value as given: it syncs the buffers
    before forwards when true) and whether the buffers are synced at construction, by torch's
    (2.13+) rule: forward_sync_buffers replaces broadcast_buffers; given, it decides only the
    per-forward sync and the buffers are synced at construction anyway; else broadcast_buffers
    (default True) decides both."""
    if forward_sync_buffers is not None:
        flag("forward_sync_buffers", forward_sync_buffers)
        return forward_sync_buffers, True
    if broadcast_buffers is None:
        return True, True
    return broadcast_buffers, flag("broadcast_buffers", broadcast_buffers)


def deprecated_arguments(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool],
                         check_reduction: bool) -> None:
    """torch DDP's FutureWarnings for its deprecated arguments, given the same way."""
    if broadcast_buffers is not None:
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                      "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers "
                      "at init. If you rely on buffers NOT being synced at init (e.g. rank-local buffers), "
                      "keep using `broadcast_buffers=False` until `init_sync_buffers` is available."
                      if forward_sync_buffers is None else
                      "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                      "`broadcast_buffers` is deprecated and its value is ignored when "
                      "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                      "Please avoid using it.", FutureWarning, stacklevel=3)


def env_flag(name: str) -> Optional[bool]:
    """An on/off environment setting: None when unset or ``auto``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not understood; set it to 1, 0 or auto (or unset it)")
