"""The construction check across ranks (torch DDP's ``_verify_param_shape_across_processes``
and more): every rank built the same model (count, shapes, strides, dtypes; parameters frozen
on some ranks only named) and wraps it with the same settings; a parameter whose name differs
between ranks at the same position is warned about. Two all-gathers of integers."""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import astuple, dataclass, fields
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .checks import backend_name


@dataclass(frozen=True)
class SharedSettings:
    """The wrapper settings that decide which collectives a rank issues, as integers: ranks
    that differ in one would issue different collectives (gloo aborts the process, or the
    ranks wait for each other until the timeout, or — comm_dtype on shared memory — sum
    bytes of one dtype as another), so the construction check refuses them by name."""

    find_unused_parameters: int
    static_graph: int
    comm_dtype: int  # -1: none
    broadcast_buffers: int  # the buffers broadcast at construction
    forward_sync_buffers: int  # ... and before forwards
    bucket_cap_mb_list: int  # hash of the list; 0: none

    @staticmethod
    def of(find_unused: bool, static_graph: bool, comm_dtype: Optional[torch.dtype], init_sync_buffers: bool,
           forward_sync_buffers: bool, caps: Optional[list[float]]) -> SharedSettings:
        caps_hash = 0 if caps is None else hash(tuple(float(c) for c in caps)) & ((1 << 62) - 1) | 1
        return SharedSettings(int(bool(find_unused)), int(bool(static_graph)),
                              -1 if comm_dtype is None else _dtype_code(comm_dtype),
                              int(bool(init_sync_buffers)), int(bool(forward_sync_buffers)), caps_hash)


def _show(name: str, code: int) -> str:
    if name == "comm_dtype":
        return "None" if code < 0 else str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"
    if name == "bucket_cap_mb_list":
        return "None" if code == 0 else "a list"
    return str(bool(code))


def _refuse_other_settings(rows: list[list[int]]) -> None:
    for k, field in enumerate(fields(SharedSettings)):
        codes = [row[k] for row in rows]
        if len(set(codes)) > 1:
            r = next(r for r, c in enumerate(codes) if c != codes[0])
            raise RuntimeError(
                f"DDPWrapper: {field.name} differs between ranks: rank 0 has {_show(field.name, codes[0])}, "
                f"rank {r} has {_show(field.name, codes[r])}. Every rank must wrap its model with the same "
                f"{field.name}, or the ranks issue different collectives.")


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def verify_across_ranks(named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup, world_size: int,
                        settings: SharedSettings, bucket_caps_mb: tuple[float, float]) -> tuple[float, float]:
    """torch DDP's check that every rank built the same model: the same number of
    parameters and, for each, the same full shape, strides, dtype and requires_grad (two
    all-gathers: the count, widest rank and settings, then one row per parameter). Strides
    matter: each rank lays its bucket out as its parameters are laid out, so a parameter that
    is channels_last on one rank only would be summed element against unrelated element.

    The first gather also carries the :class:`SharedSettings`, refused when they differ, and
    ``bucket_caps_mb`` (the bucket cap and the first bucket's, MiB): returns group rank 0's,
    which every rank lays its buckets out with (torch DDP broadcasts rank 0's bucket
    assignment, so ranks given other caps still train alike)."""
    if world_size == 1:
        return bucket_caps_mb
    device = named[0][1].device if "nccl" in backend_name(group) else torch.device("cpu")
    header = torch.tensor([len(named), max(p.dim() for _, p in named), *map(_bits, bucket_caps_mb), *astuple(settings)],
                          dtype=torch.int64, device=device)
    headers = [torch.zeros_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header, group=group)
    rows = [h.cpu().tolist() for h in headers]
    _refuse_other_settings([row[4:] for row in rows])
    counts = [row[0] for row in rows]
    if len(set(counts)) > 1:
        raise RuntimeError(_count_mismatch(named, counts, group, world_size))
    width = _META_FIELDS + 2 * max(int(h[1]) for h in headers) + 1  # the name's hash last
    local = torch.tensor([v for n, p in named for v in _param_meta(p, width) + [_name_hash(n)]],
                         dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    rows = [g.view(-1, width).cpu() for g in gathered]
    for i, (name, param) in enumerate(named):
        for r in range(world_size):
            if torch.equal(rows[r][i][:-1], rows[0][i][:-1]):
                continue
            if _describe(rows[r][i]) == _describe(rows[0][i]) and _strides(rows[r][i]) != _strides(rows[0][i]):
                raise RuntimeError(
                    f"DDPWrapper: params[{i}] ({name!r}) in this process with sizes {list(param.shape)} "
                    "appears not to match strides of the same param in process 0 (torch DDP's check): "
                    f"rank 0 has strides {_strides(rows[0][i])}, rank {r} has {_strides(rows[r][i])}. Lay "
                    "the parameters out alike on every rank, e.g. .to(memory_format=torch.channels_last) "
                    "on all ranks or none, before wrapping.")
            raise RuntimeError(
                f"DDPWrapper: parameter {i} ({name!r}) differs between ranks: rank 0 has "
                f"{_describe(rows[0][i])}, rank {r} has {_describe(rows[r][i])}. Every rank "
                "must build the same model.")
    _warn_other_names(named, rows, group, world_size)
    return _float(int(headers[0][2])), _float(int(headers[0][3]))


def _name_hash(name: str) -> int:
    """A parameter's name, compared across ranks, without torch.compile's ``_orig_mod.`` (a
    model compiled on some ranks only is the same model)."""
    plain = ".".join(part for part in name.split(".") if part != "_orig_mod")
    return zlib.crc32(plain.encode())


def _warn_other_names(named: list[tuple[str, nn.Parameter]], rows: list[torch.Tensor], group: dist.ProcessGroup,
                      world_size: int) -> None:
    """Parameters alike in shape and dtype but named differently at the same position on some
    rank: their gradients are averaged together (torch DDP does it without a word), which is
    what happens when ranks register their modules in different orders. One more all-gather
    (of names), made only when every rank saw a difference."""
    hashes = torch.stack([row[:, -1] for row in rows])
    differing = (hashes != hashes[0]).any(dim=0).nonzero().flatten().tolist()
    if not differing:
        return
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, [n for n, _ in named], group=group)
    i = differing[0]
    r = next(r for r in range(world_size) if int(hashes[r][i]) != int(hashes[0][i]))
    more = f" ({len(differing) - 1} more positions differ)" if len(differing) > 1 else ""
    warnings.warn(f"DDPWrapper: parameter {i} is {names[0][i]!r} on rank 0 but {names[r][i]!r} on rank {r}, "
                  f"alike in shape and dtype, so their gradients are averaged together{more}. The ranks "
                  "registered their modules in different orders (e.g. built from a set, or from a dict "
                  "filled in a rank-dependent order); build the model in one order on every rank. (torch "
                  "DDP averages them without a warning.)", RuntimeWarning, stacklevel=4)


def _count_mismatch(named: list[tuple[str, nn.Parameter]], counts: list[int], group: dist.ProcessGroup,
                    world_size: int) -> str:
    """The message for ranks with different numbers of reduced parameters, naming those that
    only some ranks reduce (frozen on the others, or absent there); one more all-gather, which
    every rank makes since every rank saw the counts differ."""
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, [n for n, _ in named], group=group)
    first = set(names[0])
    lines = []
    for r in range(1, world_size):
        only_here, only_first = set(names[r]) - first, first - set(names[r])
        if only_first:
            lines.append(f"rank 0 only (not on rank {r}): {', '.join(sorted(only_first)[:10])}")
        if only_here:
            lines.append(f"rank {r} only: {', '.join(sorted(only_here)[:10])}")
    counted = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    return (f"DDPWrapper: ranks reduce different numbers of parameters ({counted}); parameters that "
            f"require grad on {'; '.join(lines) or 'some ranks only'}. Every rank must build the same model "
            "and freeze the same parameters before wrapping it.")



_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.int8, torch.bool, torch.complex64]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


_META_FIELDS = 4  # numel, ndim, requires_grad, dtype code; the full shape, then the strides follow


def _param_meta(p: torch.Tensor, width: int) -> list[int]:
    """One parameter's row of the cross-rank model check, zero-padded to ``width``: the fields,
    the shape, zeros to half the rest, the strides."""
    half = (width - _META_FIELDS) // 2
    shape = [*p.shape] + [0] * (half - p.dim())
    strides = [*p.stride()] + [0] * (half - p.dim())
    return [p.numel(), p.dim(), int(p.requires_grad), _dtype_code(p.dtype), *shape, *strides]


def _strides(row: torch.Tensor) -> tuple[int, ...]:
    ndim, half = int(row[1]), (len(row) - _META_FIELDS) // 2
    return tuple(int(v) for v in row[_META_FIELDS + half:_META_FIELDS + half + ndim])


def _describe(row: torch.Tensor) -> str:
    """A row of :func:`_param_meta` as the mismatch message shows it."""
    numel, ndim, _requires_grad, code = (int(v) for v in row[:_META_FIELDS])
    shape = tuple(int(v) for v in row[_META_FIELDS:_META_FIELDS + ndim])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "other"
    return f"shape {shape} ({numel} elements), dtype {dtype}"


