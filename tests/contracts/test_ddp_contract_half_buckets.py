"""Contract: bf16 and fp16 gradients reduce to torch DDP's bits, side by side in the same two
or three gloo ranks, with the gradients sent as they are and compressed (torch's
``bf16_compress_hook``/``fp16_compress_hook``, DDPWrapper's ``comm_dtype``).

torch DDP divides a bf16/fp16 gradient by the world size in its own dtype and gloo adds the
ranks' values, rounding after each addition, in the order of its ring (csrc/reducer/ring_order.h).
DDPWrapper sums them through shared memory (each value rounded as torch rounds it, each
addition rounded, in gloo's order), which must give the same bits for every value: subnormal
values, sums that overflow, signed zeros, operands whose exponents lie far apart, infinities
and NaN.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


class _Direct(nn.Module):
    """loss = sum(weight * given): the weight's gradient is exactly ``given``."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, dtype=dtype))

    def forward(self, given: torch.Tensor) -> torch.Tensor:
        return (self.weight * given).sum()


def _edge_values(dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank-specific gradients that exercise every rounding the sum can make."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(10 + rank)
    wide = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 30, (4096,), generator=g).float())
    special = [info.max, -info.max, info.max / 2, info.tiny, -info.tiny, info.tiny / 2, info.smallest_normal / 8,
               info.tiny * info.eps, 3 * info.tiny * info.eps, info.eps, 1.0 + info.eps, 0.0, -0.0,
               float("inf"), float("-inf"), float("nan"), 3.0, -3.0]
    # each value meets itself on the peer (rounded halves that add up differently), then the others
    tail = torch.tensor(special + (special if rank == 0 else special[::-1]), dtype=torch.float32)
    return torch.cat([wide, tail]).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _reduced_bits(rank: int, world_size: int, dtype: torch.dtype, compressed: bool) -> tuple[str, int]:
    given = _edge_values(dtype, rank)
    if compressed:  # float32 parameters, the gradients sent as dtype
        ours = fastddp.DDPWrapper(_Direct(given.numel(), torch.float32), comm_dtype=dtype)
        ref = TorchDDP(_Direct(given.numel(), torch.float32))
        hook = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}
        ref.register_comm_hook(None, hook[dtype])
        given = given.float()
    else:
        ours = fastddp.DDPWrapper(_Direct(given.numel(), dtype))
        ref = TorchDDP(_Direct(given.numel(), dtype))
    assert ours.bucket_report()["buckets"][0]["transport"] == "shm", ours.bucket_report()
    for model in (ours, ref):
        model(given).backward()
    a, b = ours.module.weight.grad, ref.module.weight.grad
    differ = _bits(a) != _bits(b)  # NaN's bits too
    assert not differ.any(), (a[differ][:8], b[differ][:8], given[differ][:8])
    return str(a.dtype), int(torch.isnan(a).sum())


@pytest.mark.parametrize("compressed", [False, True], ids=["native", "compressed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_half_precision_buckets_reduce_to_torch_ddps_bits(ranks, world: int, dtype: torch.dtype,
                                                          compressed: bool) -> None:
    results = ranks.run(_reduced_bits, world_size=world, args=(dtype, compressed))
    assert len(set(results)) == 1 and results[0][1] > 0, results  # NaN reached the comparison
