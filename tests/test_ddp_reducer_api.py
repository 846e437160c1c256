"""The C++ reducer's interface as DDPWrapper and GradScaler use it: ReducerOptions (named
fields), the reducer's bucket plan and alignment rule, and the post-reduction bucket visitor
through which GradScaler takes its statistics (one case per test)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp._ext import C
from fastddp.ddp import assign_buckets

from .distributed import run_distributed


def test_reducer_options_are_named_fields_with_defaults() -> None:
    options = C.ReducerOptions()
    assert (options.gradient_as_bucket_view, options.find_unused_parameters, options.static_graph) == (
        True, False, False)
    assert options.comm_dtype is None and options.shm_allreduce is None and options.batch_copies is None
    assert (options.bucket_cap_mb, options.first_bucket_mb, options.bucket_caps_mb) == (25.0, 1.0, [])
    options.comm_dtype = torch.bfloat16
    options.bucket_caps_mb = [1.5, 4]
    assert options.comm_dtype == torch.bfloat16 and options.bucket_caps_mb == [1.5, 4.0]


def test_bucket_plan_follows_torch_ddps_rules() -> None:
    mib = 2**18  # float32 elements in one MiB
    params = [torch.zeros(mib), torch.zeros(mib, dtype=torch.float64), torch.zeros(mib), torch.zeros(mib)]
    # before the rebuild: one bucket per dtype, listed in reverse, registration order inside
    assert assign_buckets(params) == [[1], [0, 2, 3]]
    # find_unused_parameters: never rebuilt, so capped from the start; a bucket closes once it
    # reaches its cap (float64 apart), and only the default cap has a small first bucket
    assert assign_buckets(params, 2, find_unused_parameters=True) == [[3], [1], [0, 2]]
    assert assign_buckets(params, find_unused_parameters=True) == [[2, 3], [1], [0]]
    assert assign_buckets(params, 2, find_unused_parameters=True, static_graph=True) == [[1], [0, 2, 3]]
    # rebuilt in arrival order: the default's first bucket holds 1 MiB
    assert assign_buckets(params, order=[3, 2, 1, 0]) == [[3], [1], [2, 0]]
    assert assign_buckets(params, 2, order=[0, 2, 3, 1]) == [[0, 2], [1], [3]]
    assert assign_buckets(params, 0, order=[3, 2, 1, 0]) == [[3], [2], [1], [0]]


def test_packed_bytes_align_each_tensor_to_64_bytes() -> None:
    tensors = [torch.zeros(3), torch.zeros(16), torch.zeros(17, dtype=torch.float64), torch.zeros(0)]
    assert C.Reducer.packed_bytes(tensors) == 64 + 64 + 192 + 0


def _mean_hook(state, bucket):
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _visitor_across_hook_replacement(rank: int, world_size: int) -> tuple[float, float, bool]:
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3)), bucket_cap_mb=0.001)
    visitor = C.amp_bucket_stats()
    model.register_bucket_visitor(visitor)
    model.register_comm_hook(None, _mean_hook)  # replaces the C++ reducer: the visitor stays
    model(torch.randn(4, 30, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    stats = C.amp_take_bucket_stats(visitor)
    expected = sum(float(b.double().square().sum()) for b in model.reduced_gradients())
    return float(stats), expected, C.amp_take_bucket_stats(visitor) is None


def test_bucket_visitor_survives_a_replaced_reducer_and_is_taken_once() -> None:
    for stats, expected, taken_once in run_distributed(_visitor_across_hook_replacement, world_size=2):
        assert abs(stats - expected) <= 1e-12 * expected and taken_once, (stats, expected)


def _visitor_checks(rank: int, world_size: int) -> tuple[str, bool, int]:
    net = nn.Sequential(nn.Linear(3, 3))
    net._ddp_params_and_buffers_to_ignore = ["0.bias"]
    model = fastddp.DDPWrapper(net)
    try:
        model.register_bucket_visitor(object())
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    model(torch.randn(2, 3)).sum().backward()
    # a world of one leaves the gradients with autograd: no flat buffers stand in for them
    return refused, model.reduced_gradients() is None, len(model.reduced_parameters())


def test_visitor_type_and_gradient_accessors() -> None:
    [(refused, no_buffers, n_params)] = run_distributed(_visitor_checks, world_size=1)
    assert "expected a fastddp._C.BucketVisitor" in refused and "got object" in refused, refused
    assert no_buffers and n_params == 1  # the ignored bias is not reduced
