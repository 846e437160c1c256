"""DDPWrapper's construction checks beside torch DDP's, one case per test: models that differ
across ranks (full shape, dtype), ``bucket_cap_mb`` values torch accepts or refuses, and the
shared-memory timeout of a group whose backend has none."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .distributed import run_distributed


def _outcome(build) -> tuple[str, str]:
    """(exception type name, message) of ``build()``, or ("ok", "")."""
    try:
        build()
    except Exception as exc:  # the type is what the tests compare
        return type(exc).__name__, str(exc)
    return "ok", ""


class _Tensor6d(nn.Module):
    """One parameter of six dimensions whose last two are swapped on odd ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros((1, 1, 1, 1, 2, 3) if rank % 2 == 0 else (1, 1, 1, 1, 3, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w.sum()


def _shape_beyond_fourth_dim(rank: int, world_size: int) -> tuple[tuple[str, str], tuple[str, str]]:
    return (_outcome(lambda: fastddp.DDPWrapper(_Tensor6d(rank))),
            _outcome(lambda: TorchDDP(_Tensor6d(rank))))


def test_shapes_differing_beyond_the_fourth_dim_are_refused_as_torch_refuses() -> None:
    for (ours, ours_msg), (ref, _) in run_distributed(_shape_beyond_fourth_dim, world_size=2):
        assert ref == "RuntimeError"
        assert ours == ref, ours_msg
        assert "parameter 0 ('w') differs between ranks" in ours_msg, ours_msg
        assert "rank 0 has shape (1, 1, 1, 1, 2, 3)" in ours_msg, ours_msg
        assert "rank 1 has shape (1, 1, 1, 1, 3, 2)" in ours_msg, ours_msg


def _layout_mismatch(rank: int, world_size: int) -> tuple[str, str]:
    conv = nn.Sequential(nn.Conv2d(3, 4, 3))
    if rank == 1:  # the same shapes, the weight channels_last on one rank only
        conv.to(memory_format=torch.channels_last)
    return _outcome(lambda: fastddp.DDPWrapper(conv))


def test_strides_differing_between_ranks_are_refused_with_torchs_sentence() -> None:
    """torch DDP refuses this on the differing rank ("appears not to match strides of the same
    param in process 0"); DDPWrapper on every rank (a bucket laid out differently per rank would
    sum unrelated elements)."""
    for kind, msg in run_distributed(_layout_mismatch, world_size=2):
        assert kind == "RuntimeError", msg
        assert ("params[0] ('0.weight') in this process with sizes [4, 3, 3, 3] appears not to match "
                "strides of the same param in process 0") in msg, msg
        assert "rank 0 has strides (27, 9, 3, 1), rank 1 has (27, 1, 9, 3)" in msg, msg


def _dtype_mismatch(rank: int, world_size: int, dims: int) -> tuple[str, str]:
    shape = (3, 2, 2, 2, 2)[:dims]
    dtype = torch.float32 if rank == 0 else torch.float64
    module = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=dtype))])
    return _outcome(lambda: fastddp.DDPWrapper(module))


@pytest.mark.parametrize("dims", [1, 2, 5])
def test_dtype_mismatch_names_both_dtypes(dims: int) -> None:
    shape = str((3, 2, 2, 2, 2)[:dims])
    for kind, msg in run_distributed(_dtype_mismatch, world_size=2, args=(dims,)):
        assert kind == "RuntimeError", msg
        assert f"rank 0 has shape {shape}" in msg and "dtype torch.float32" in msg, msg
        assert "rank 1 has" in msg and "dtype torch.float64" in msg.split("rank 1 has")[1], msg


def _zero_cap(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    ours_m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    ref_m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    ref_m.load_state_dict(ours_m.state_dict())
    ours, ref = fastddp.DDPWrapper(ours_m, bucket_cap_mb=0), TorchDDP(ref_m, bucket_cap_mb=0)
    assert ours.bucket_bytes_cap == ref.bucket_bytes_cap == 0
    assert len(ours.bucket_report()["buckets"]) == 1  # as torch's: one bucket until the rebuild
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(6, 4, generator=g)
        for model in (ours, ref):
            model.zero_grad()
            model(x).square().sum().backward()
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    report = ours.bucket_report()
    assert len(report["buckets"]) == 4, report  # rebuilt: one parameter per bucket
    return [float(p.grad.sum()) for p in ours.parameters()]


def test_bucket_cap_mb_zero_is_accepted_like_torch() -> None:
    grads = run_distributed(_zero_cap, world_size=2)
    assert grads[0] == grads[1]


def _cap_outcomes(rank: int, world_size: int, cap) -> tuple[tuple[str, str], tuple[str, str]]:
    return (_outcome(lambda: fastddp.DDPWrapper(nn.Linear(2, 2), bucket_cap_mb=cap)),
            _outcome(lambda: TorchDDP(nn.Linear(2, 2), bucket_cap_mb=cap)))


def test_bucket_cap_mb_string_is_refused_with_torchs_exception_type() -> None:
    for (ours, msg), (ref, _) in run_distributed(_cap_outcomes, world_size=1, args=("25",)):
        assert ref == "ValueError"
        assert ours == ref and "bucket_cap_mb must be a number" in msg and "'25'" in msg, msg


def test_negative_bucket_cap_mb_is_refused_on_purpose() -> None:
    """torch takes a negative cap as 0 (one parameter per bucket); a negative size is a
    mistake, refused with a message that names it."""
    for (ours, msg), (ref, _) in run_distributed(_cap_outcomes, world_size=1, args=(-1,)):
        assert ref == "ok"
        assert ours == "ValueError" and "bucket_cap_mb must be a finite number >= 0" in msg, msg


def test_shared_memory_timeout_falls_back_to_torchs_default() -> None:
    """A group whose backend exposes no timeout (no CPU backend, or options without one): the
    shared-memory wait takes torch's default process-group timeout."""
    from types import SimpleNamespace

    from torch.distributed.constants import default_pg_timeout

    class NoCpuBackend:
        def _get_backend(self, device: torch.device) -> None:
            raise RuntimeError(f"no backend for {device}")

    for group in (NoCpuBackend(), SimpleNamespace(_get_backend=lambda device: SimpleNamespace(options=None))):
        holder = SimpleNamespace(process_group=group)
        assert fastddp.DDPWrapper._timeout_s(holder) == default_pg_timeout.total_seconds()


_SETTINGS_ON_RANK_1 = {
    "comm_dtype": ({"comm_dtype": torch.bfloat16}, "comm_dtype differs between ranks: rank 0 has None, "
                   "rank 1 has torch.bfloat16"),
    "find_unused_parameters": ({"find_unused_parameters": True}, "find_unused_parameters differs between "
                               "ranks: rank 0 has False, rank 1 has True"),
    "broadcast_buffers": ({"broadcast_buffers": False}, "broadcast_buffers differs between ranks"),
    "forward_sync_buffers": ({"forward_sync_buffers": False}, "forward_sync_buffers differs between ranks"),
    "static_graph": ({"static_graph": True}, "static_graph differs between ranks"),
    "bucket_cap_mb_list": ({"bucket_cap_mb_list": [1.0, 25.0]}, "bucket_cap_mb_list differs between ranks: "
                           "rank 0 has None, rank 1 has a list"),
}


def _setting_on_one_rank(rank: int, world_size: int, name: str) -> tuple[str, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    kwargs = _SETTINGS_ON_RANK_1[name][0] if rank == 1 else {}
    return _outcome(lambda: fastddp.DDPWrapper(model, **kwargs))


@pytest.mark.parametrize("name", list(_SETTINGS_ON_RANK_1))
def test_settings_that_differ_between_ranks_are_refused_by_name(ranks, name: str) -> None:
    """A setting that decides which collectives a rank issues, given on one rank only: every
    rank raises, naming it (unchecked, gloo would abort the process, the ranks wait for each
    other until the timeout, or, comm_dtype on shared memory, sum bfloat16 bytes as float32)."""
    for kind, message in ranks.run(_setting_on_one_rank, world_size=2, args=(name,)):
        assert kind == "RuntimeError" and _SETTINGS_ON_RANK_1[name][1] in message, message


def _caps_differ(rank: int, world_size: int) -> int:
    """bucket_cap_mb 0.3 on rank 0, 25 on rank 1: torch DDP trains (it broadcasts rank 0's bucket
    assignment); DDPWrapper lays every rank's buckets out with rank 0's cap and trains alike."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # noqa: E731
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    cap = 0.3 if rank == 0 else 25.0
    ours, ref = fastddp.DDPWrapper(a, bucket_cap_mb=cap), TorchDDP(b, bucket_cap_mb=cap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 256, generator=g)
        for m, opt in zip((ours, ref), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert ours.bucket_bytes_cap == int(cap * 1024 * 1024)  # torch DDP's attribute keeps the argument
    return len(ours.bucket_buffers())


def test_bucket_caps_that_differ_between_ranks_train_like_torch_ddp(ranks) -> None:
    counts = ranks.run(_caps_differ, world_size=2)
    assert counts[0] == counts[1] and counts[0] > 1, counts


def _frozen_on_rank_1(rank: int, world_size: int) -> tuple[str, str]:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    if rank == 1:
        model[2].requires_grad_(False)
    return _outcome(lambda: fastddp.DDPWrapper(model))


def test_parameters_frozen_on_one_rank_are_named(ranks) -> None:
    for kind, message in ranks.run(_frozen_on_rank_1, world_size=2):
        assert kind == "RuntimeError", message
        assert ("ranks reduce different numbers of parameters (rank 0: 4, rank 1: 2); parameters that "
                "require grad on rank 0 only (not on rank 1): 2.bias, 2.weight") in message, message


class _TwoAlike(nn.Module):
    """Two layers alike in shape, registered in the given order (a rank-dependent order is what
    a model built from a set of names gets: each process has its own string hash seed)."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        for name in order:
            self.add_module(name, nn.Linear(4, 4))


class _Compiled(nn.Module):
    """What torch.compile returns: the model kept as ``_orig_mod``, its names prefixed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def _names_differ(rank: int, world_size: int, how: str) -> list[str]:
    if how == "order":
        model: nn.Module = _TwoAlike(["a", "b"] if rank == 0 else ["b", "a"])
    else:
        model = _TwoAlike(["a", "b"])
        model = _Compiled(model) if rank == 1 else model
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fastddp.DDPWrapper(model)
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_parameters_named_differently_on_one_rank_are_warned_about(ranks) -> None:
    """Alike in shape but registered in other orders: torch DDP averages a.weight with b.weight
    without a word; DDPWrapper trains the same and warns on every rank, naming both."""
    for messages in ranks.run(_names_differ, world_size=2, args=("order",)):
        assert len(messages) == 1, messages
        assert ("parameter 0 is 'a.weight' on rank 0 but 'b.weight' on rank 1, alike in shape and dtype, so "
                "their gradients are averaged together (3 more positions differ)") in messages[0], messages


def test_a_model_compiled_on_one_rank_only_is_not_warned_about(ranks) -> None:
    assert ranks.run(_names_differ, world_size=2, args=("compiled",)) == [[], []]
