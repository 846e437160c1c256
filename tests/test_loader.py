"""PrefetchLoader yields exactly dataset[sampler indices], batch by batch, for every dataset kind;
its errors, arguments and device paths."""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp
from tests import forking
from tests.loader_common import N, _check, _data, _expected, _IndexSampler, _MapDataset


@pytest.mark.parametrize("kind", ["tensors", "npy", "generic"])
@pytest.mark.parametrize("batch", [1, 32, 333])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_equal_dataset_at_sampler_indices(tmp_path, kind, batch, drop_last) -> None:
    x, y = _data()
    if kind == "tensors":
        ds = TensorDataset(x, y)
    elif kind == "npy":
        np.save(tmp_path / "x.npy", x.numpy())
        np.save(tmp_path / "y.npy", y.numpy())
        ds = (str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))
    else:
        ds = _MapDataset(x, y)
    sampler = fastddp.DistributedSampler(N, num_replicas=3, rank=1, seed=7)
    loader = fastddp.PrefetchLoader(ds, batch_size=batch, sampler=sampler, num_workers=3,
                                    drop_last=drop_last)
    for epoch in range(2):
        loader.set_epoch(epoch)
        _check(loader, x, y, sampler.indices(), batch, drop_last)


@pytest.mark.parametrize(
    "make_sampler",
    [lambda: TorchSampler(range(N), num_replicas=2, rank=0, seed=1),
     lambda: RandomSampler(range(N), generator=torch.Generator().manual_seed(5)),
     lambda: SequentialSampler(range(N)),
     lambda: _IndexSampler(torch.randperm(N)[:700])],
)
def test_any_sampler_order(make_sampler) -> None:
    x, y = _data()
    sampler = make_sampler()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=64, sampler=sampler)
    if hasattr(sampler, "indices"):
        idx = sampler.indices()
    else:
        state = sampler.generator.get_state() if getattr(sampler, "generator", None) else None
        idx = torch.tensor(list(sampler))
        if state is not None:
            sampler.generator.set_state(state)
    _check(loader, x, y, idx, 64, False)


def test_shuffle_without_sampler_changes_per_epoch() -> None:
    """As DataLoader(shuffle=True), every pass has a new order, with or without set_epoch;
    set_epoch(e) pins the order of the next pass to the permutation of seed + e."""
    x, y = _data()
    loader = fastddp.PrefetchLoader({"x": x, "y": y}, batch_size=100, shuffle=True, seed=3)

    def one_pass() -> torch.Tensor:
        return torch.cat([b["y"].clone() for b in loader])

    def perm(epoch: int) -> torch.Tensor:
        return y[torch.randperm(N, generator=torch.Generator().manual_seed(3 + epoch))]

    first, second, third = one_pass(), one_pass(), one_pass()
    assert torch.equal(first, perm(0)) and torch.equal(second, perm(1)) and torch.equal(third, perm(2))
    assert loader.epoch == 2 and not torch.equal(first, second)
    assert torch.equal(torch.sort(first).values, torch.sort(y).values)
    loader.set_epoch(1)
    assert torch.equal(one_pass(), perm(1))
    assert torch.equal(one_pass(), perm(2))  # and on from there
    loader.set_epoch(5)  # an explicit epoch every pass, as a training loop does: that epoch each time
    assert torch.equal(one_pass(), perm(5))
    loader.set_epoch(5)
    assert torch.equal(one_pass(), perm(5))


@pytest.mark.parametrize("kind", ["tensors", "generic"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_with_a_generator_is_dataloaders_order(kind: str, drop_last: bool) -> None:
    """shuffle=True with generator=g: pass for pass the batches of DataLoader(shuffle=True,
    generator=g) from an equal generator, which ends each pass in the same state."""
    x, y = _data()
    ds = TensorDataset(x, y) if kind == "tensors" else _MapDataset(x, y)
    ours_g, ref_g = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    ours = fastddp.PrefetchLoader(ds, batch_size=64, shuffle=True, generator=ours_g, drop_last=drop_last)
    ref = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, generator=ref_g, drop_last=drop_last)
    assert ours.transfer == ("host" if kind == "tensors" else "generic")
    orders = []
    for _ in range(3):
        got, want = [b.clone() for _, b in ours], [b for _, b in ref]
        assert len(got) == len(want) == len(ours) == len(ref)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(ours_g.get_state(), ref_g.get_state())
        orders.append(torch.cat(got))
    assert not torch.equal(orders[0], orders[1])


def test_mid_epoch_resume_with_a_generator() -> None:
    x, y = _data()
    g = torch.Generator().manual_seed(4)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, shuffle=True, generator=g)
    list(loader)  # a first pass moves the generator on
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(3)]
    state = loader.state_dict()
    rest = [b.clone() for _, b in it]
    resumed = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, shuffle=True,
                                     generator=torch.Generator().manual_seed(999))
    resumed.load_state_dict(state)
    again = resumed.state_dict()  # saved again before the resumed pass: the same position
    tail = [b.clone() for _, b in resumed]
    assert len(tail) == len(rest) and all(torch.equal(a, b) for a, b in zip(tail, rest))
    assert len(head) + len(tail) == len(loader)
    third = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, shuffle=True, generator=torch.Generator())
    third.load_state_dict(again)
    assert all(torch.equal(a, b) for (_, a), b in zip(third, rest, strict=True))
    with pytest.raises(ValueError, match="saved from a loader with a generator; pass generator="):
        fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, shuffle=True).load_state_dict(state)


@pytest.mark.parametrize("sampler_cls", [fastddp.DistributedSampler, TorchSampler])
@pytest.mark.parametrize("idiom", ["loader.set_epoch", "sampler.set_epoch"])
def test_mid_epoch_resume(idiom: str, sampler_cls: type) -> None:
    """The epoch saved is the one the pass used, whichever object ``set_epoch`` was called on
    (``sampler.set_epoch(e)`` is DataLoader's idiom): the resumed pass is the rest of DataLoader's
    epoch ``e``, and a resumed script calling ``set_epoch(e)`` again keeps the position."""
    x, y = _data()

    def make() -> tuple[fastddp.PrefetchLoader, Any]:
        sampler = sampler_cls(range(N), num_replicas=2, rank=0, seed=2)
        return fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, sampler=sampler), sampler

    def select(loader: fastddp.PrefetchLoader, sampler: Any, epoch: int) -> None:
        (loader if idiom == "loader.set_epoch" else sampler).set_epoch(epoch)

    reference = TorchSampler(range(N), num_replicas=2, rank=0, seed=2)
    reference.set_epoch(3)
    full = [b.clone() for _, b in torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=50, sampler=reference)]
    loader, sampler = make()
    select(loader, sampler, 3)
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(4)]
    state = loader.state_dict()
    assert state["epoch"] == 3 and state["batches_done"] == 4
    del it
    resumed, sampler2 = make()
    resumed.load_state_dict(state)
    select(resumed, sampler2, 3)  # the resumed script's loop selects the saved epoch again
    again = resumed.state_dict()  # a checkpoint written before the resumed pass keeps the position
    assert again["epoch"] == 3 and again["batches_done"] == 4
    third, sampler3 = make()
    third.load_state_dict(again)
    select(third, sampler3, 3)
    assert all(torch.equal(a, b) for (_, a), b in zip(third, full[4:], strict=True))
    tail = [b.clone() for _, b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        assert torch.equal(a, b)
    select(resumed, sampler2, 4)
    assert len(list(resumed)) == len(full)  # another epoch: a whole pass


def test_early_break_and_reiterate_and_no_leaked_threads() -> None:
    x, y = _data()
    before = threading.active_count()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=10, num_workers=4, prefetch=2)
    for _ in range(20):
        for i, _batch in enumerate(loader):
            if i == 3:
                break
    got = torch.cat([b.clone() for _, b in loader])
    assert torch.equal(got, y)
    assert threading.active_count() == before  # C++ workers are not Python threads; pool joined


def test_kept_batches_stay_valid() -> None:
    x, y = _data()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=7, prefetch=2, num_workers=2)
    kept = list(loader)  # hold every batch: slots must not be overwritten under us
    assert torch.equal(torch.cat([b for _, b in kept]), y)


def test_batches_kept_from_a_pass_survive_the_next_passes() -> None:
    # The ring's host slots go from one pass to the next: a batch kept past its pass must stay
    # the consumer's, whatever passes follow (shuffled, so every pass writes other values).
    x, y = _data()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=16, shuffle=True, num_workers=2)
    kept = [(bx, by, bx.clone(), by.clone()) for bx, by in loader]
    for _ in range(3):
        got = [(bx.clone(), by.clone()) for bx, by in loader]
        assert torch.equal(torch.sort(torch.cat([by for _, by in got])).values, torch.sort(y).values)
    for bx, by, cx, cy in kept:
        assert torch.equal(bx, cx) and torch.equal(by, cy)


def test_dataset_exception_reaches_consumer_with_traceback_and_the_pass_goes_on() -> None:
    x, y = _data()
    loader = fastddp.PrefetchLoader(_MapDataset(x, y, fail_at=123), batch_size=10)
    it = iter(loader)
    got = [next(it) for _ in range(12)]
    with pytest.raises(KeyError, match="sample 123 is broken") as info:
        next(it)
    assert any("__getitem__" in str(entry.name) for entry in info.traceback)
    rest = list(it)  # as DataLoader: the following batches still come
    assert len(got) + 1 + len(rest) == len(loader) == 100
    assert torch.equal(rest[0][1], y[130:140])


def test_worker_process_exception_names_the_worker() -> None:
    x, y = _data()
    loader = fastddp.PrefetchLoader(_MapDataset(x, y, fail_at=123), batch_size=10, num_workers=2)
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process"):
        list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_out_of_range_index_is_indexerror_at_its_batch(workers: int) -> None:
    """Side by side with DataLoader: the batch with an index past the data raises its
    IndexError at that batch (with workers, wrapped as from the worker that batch goes to:
    "Caught IndexError in DataLoader worker process 1. Original Traceback …"), and the pass
    goes on after it."""
    x, y = _data()
    sampler = _IndexSampler(torch.tensor([1, 2, 3, 4, 5, 6, N + 5, 3, 4, -1]))
    seen = []
    for cls in (torch.utils.data.DataLoader, fastddp.PrefetchLoader):
        it = iter(cls(TensorDataset(x, y), batch_size=2, num_workers=workers, sampler=sampler))
        assert [torch.equal(next(it)[1], y[i:i + 2]) for i in (1, 3, 5)] == [True] * 3
        with pytest.raises(IndexError) as info:
            next(it)
        lines = str(info.value).splitlines()
        seen.append((lines[0], lines[-1]))
        assert torch.equal(next(it)[1], y[[4, N - 1]])  # -1 is the last sample, as DataLoader reads it
        assert next(it, None) is None
    last = f"index {N + 5} is out of bounds for dimension 0 with size {N}"
    if workers:  # batch 3 of the pass goes to worker 3 % 2
        assert seen == [("Caught IndexError in DataLoader worker process 1.", f"IndexError: {last}")] * 2
    else:
        assert seen == [(last, last)] * 2
    assert info.value.__notes__ == [f"PrefetchLoader: raised reading batch 3 (indices [{N + 5}, 3])"]


def test_float_indices_are_refused_as_dataloader_refuses_them() -> None:
    x, y = _data()
    for cls in (torch.utils.data.DataLoader, fastddp.PrefetchLoader):
        it = iter(cls(TensorDataset(x, y), batch_size=2, sampler=[0, 1, 1.5, 2, 3, 4]))
        assert torch.equal(next(it)[1], y[[0, 1]])
        with pytest.raises(IndexError, match="only integers"):
            next(it)  # never read as index 1
        assert torch.equal(next(it)[1], y[[3, 4]])


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size should be a positive integer value, but got batch_size=0"),
        ({"batch_size": None, "drop_last": True}, ValueError, "batch_size=None option disables auto-batching"),
        ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
        ({"prefetch": 0}, ValueError, r"prefetch must be an integer in \[1, 2147483647\] .*, got 0"),
        ({"prefetch": 10**20}, ValueError, r"prefetch must be an integer in \[1, 2147483647\]"),
        ({"shuffle": True, "seed": 1.5}, TypeError, "seed must be an integer, got float 1.5"),
        ({"shuffle": True, "seed": True}, TypeError, "seed must be an integer, got bool True"),
        ({"device_resident": "yes"}, ValueError, "device_resident must be True, False or \"auto\", got 'yes'"),
        ({"device_resident": 1}, ValueError, "device_resident must be True, False or \"auto\", got 1"),
        ({"shuffle": True, "sampler": SequentialSampler(range(N))}, ValueError, "mutually exclusive"),
    ],
)
def test_bad_arguments(kwargs, exc, message) -> None:
    x, y = _data()
    with pytest.raises(exc, match=message):
        fastddp.PrefetchLoader(TensorDataset(x, y), **kwargs)


@pytest.mark.parametrize("epoch", [1.5, "2", True])
def test_set_epoch_takes_an_integer(epoch) -> None:
    """int() would truncate 1.5 silently; a numpy integer is an integer."""
    x, y = _data()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=2, shuffle=True, seed=0)
    with pytest.raises(TypeError, match=f"set_epoch: epoch must be an integer, got {type(epoch).__name__}"):
        loader.set_epoch(epoch)
    loader.set_epoch(np.int64(3))
    assert loader.epoch == 3


def test_mismatched_tensors() -> None:
    with pytest.raises(ValueError, match="same first dimension"):
        fastddp.PrefetchLoader((torch.zeros(10, 2), torch.zeros(9)), batch_size=2)


def test_unsupported_dataset_type() -> None:
    with pytest.raises(TypeError, match="cannot load from int"):
        fastddp.PrefetchLoader(42, batch_size=2)


def test_device_resident_on_cpu_matches() -> None:
    x, y = _data()
    sampler = fastddp.DistributedSampler(N, num_replicas=1, rank=0, seed=1)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=128, sampler=sampler,
                                    device_resident=True)
    _check(loader, x, y, sampler.indices(), 128, False)


@pytest.mark.cuda
@pytest.mark.parametrize("transfer", ["staged", "direct", "resident"])
def test_cuda_device_batches(transfer: str) -> None:
    x, y = _data()
    sampler = fastddp.DistributedSampler(N, num_replicas=2, rank=1, seed=4)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=64, sampler=sampler,
                                    device="cuda", device_resident=transfer == "resident",
                                    pin_dataset=transfer == "direct", num_workers=2)
    idx = sampler.indices()
    got = [(bx.cpu(), by.cpu()) for bx, by in loader]
    assert loader.transfer == transfer
    for (bx, by), widx in zip(got, _expected(idx, 64, False)):
        assert torch.equal(bx, x[widx]) and torch.equal(by, y[widx])
    # consumer work on the yielded tensors while later slots refill
    total = sum(float(bx.sum()) for bx, _ in loader)
    assert total == pytest.approx(float(x[idx].sum()), rel=1e-4)
    # batches kept past their slot's refill stay intact (the slot gets new buffers)
    kept = [(bx, by) for bx, by in loader]
    for (bx, by), widx in zip(kept, _expected(idx, 64, False)):
        assert torch.equal(bx.cpu(), x[widx]) and torch.equal(by.cpu(), y[widx])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,row", [(torch.uint8, (3,)), (torch.int16, (5, 3)),
                                       (torch.float32, (7,)), (torch.float64, (2, 4)),
                                       (torch.bfloat16, (8,))])
def test_cuda_direct_gather_any_row_width(dtype: torch.dtype, row: tuple) -> None:
    """The direct path's kernel picks 16/8/4/2/1-byte accesses by row width: all exact."""
    n = 777
    x = (torch.arange(n * int(np.prod(row))) % 251).to(dtype).reshape(n, *row).pin_memory()
    y = torch.arange(n, dtype=torch.int64).pin_memory()
    loader = fastddp.PrefetchLoader((x, y), batch_size=100, shuffle=True, seed=3, device="cuda",
                                    num_workers=3)
    assert loader.transfer == "direct"  # already pinned: no pin_dataset needed
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    got = list(loader)
    assert loader.transfer == "direct"
    for (bx, by), widx in zip(got, order.split(100)):
        assert torch.equal(bx.cpu(), x[widx]) and torch.equal(by.cpu(), widx)


@pytest.mark.cuda
def test_cuda_direct_bad_index_is_dataloaders_indexerror_at_its_batch() -> None:
    """On the direct path too, a batch with an index past the data set is read as DataLoader
    reads it (its IndexError), and the batches before it arrive."""
    x = torch.randn(10, 4).pin_memory()
    sampler = _IndexSampler(torch.tensor([0, 1, 2, 3, 0, 12]))
    loader = fastddp.PrefetchLoader((x,), batch_size=4, device="cuda", sampler=sampler)
    assert loader.transfer == "direct"
    it = iter(loader)
    assert torch.equal(next(it).cpu(), x[:4])  # one tensor given: batches are tensors
    with pytest.raises(IndexError, match="index 12 is out of bounds for dimension 0 with size 10"):
        next(it)
    with pytest.raises(IndexError, match="index 12 is out of bounds for dimension 0 with size 10"):
        list(torch.utils.data.DataLoader(TensorDataset(x), batch_size=4, sampler=sampler))


def test_devices_other_than_cpu_and_cuda() -> None:
    """The C++ gather delivers to CPU or CUDA devices; a TensorDataset's batches for another
    backend are moved there with .to() (DataLoader's batches, on that device), own-form tensors
    are refused at construction naming the device, and a backend this torch lacks is refused
    there too."""
    ds = TensorDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    loader = fastddp.PrefetchLoader(ds, batch_size=4, device="meta")
    got = list(loader)
    want = list(torch.utils.data.DataLoader(ds, batch_size=4))
    assert [[t.device.type for t in b] for b in got] == [["meta", "meta"]] * 2
    assert [[t.shape for t in b] for b in got] == [[t.shape for t in b] for b in want]
    with pytest.raises(ValueError, match=r"device meta: tensors and \.npy paths are gathered by C\+\+ "
                       r"threads, .*wrap them in a TensorDataset"):
        fastddp.PrefetchLoader((torch.zeros(4, 2),), batch_size=2, device="meta")
    missing = next(t for t in ("xpu", "mps", "mtia") if not getattr(torch, t).is_available())
    with pytest.raises(ValueError, match=rf"device {missing}(:0)? is not usable in this torch"):
        fastddp.PrefetchLoader(ds, batch_size=4, device=missing)


def test_pin_dataset_needs_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"pin_dataset needs tensors or \.npy arrays and a CUDA "
                       r"device \(got a tensors dataset, device cpu\)"):
        fastddp.PrefetchLoader((torch.zeros(4, 2),), batch_size=2, pin_dataset=True)


@pytest.mark.parametrize(("option", "message"), [("pin_dataset", "pin_dataset needs tensors or .npy arrays and a CUDA"),
                                                 ("device_resident", "device_resident needs tensors or .npy arrays")])
def test_tensor_options_assigned_later_are_checked_at_iter(option: str, message: str) -> None:
    """The options are public attributes (a loader rebuilt from them keeps them): one assigned
    after construction where it cannot apply fails at iter() as at construction, not silently."""
    loader = fastddp.PrefetchLoader([torch.zeros(2)] * 4, batch_size=2)  # a list: not gathered natively
    setattr(loader, option, True)
    with pytest.raises(ValueError, match=re.escape(message)):
        iter(loader)


def test_dataloader_arguments_keep_working() -> None:
    """A DataLoader call with its usual keywords works after swapping the class name."""
    ds = TensorDataset(torch.arange(40, dtype=torch.float32).view(20, 2), torch.arange(20))
    sampler = fastddp.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)

    def collate(samples):  # a user's collation: x doubled, labels as a list
        return torch.stack([x for x, _ in samples]) * 2, [int(y) for _, y in samples]

    kwargs = dict(batch_size=6, sampler=sampler, num_workers=2, pin_memory=False,
                  persistent_workers=True, prefetch_factor=3, collate_fn=collate, drop_last=False)
    ours = fastddp.PrefetchLoader(ds, **kwargs)
    ref = torch.utils.data.DataLoader(ds, **kwargs)
    assert ours.prefetch == 6 and ours.transfer == "generic"
    got, want = list(ours), list(ref)
    assert len(got) == len(want) == 4
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and gy == wy
    # without collate_fn the same call takes the fast path
    del kwargs["collate_fn"]
    assert fastddp.PrefetchLoader(ds, **kwargs).transfer == "host"


def test_collate_fn_needs_a_dataset() -> None:
    with pytest.raises(ValueError, match="collate_fn=<class 'list'> needs a map-style Dataset"):
        fastddp.PrefetchLoader((torch.zeros(4, 2),), batch_size=2, collate_fn=list)


def test_forked_child_frees_a_pass_left_in_a_reference_cycle() -> None:
    """A forked child (a DataLoader worker) collects the parent's garbage: a native pass left
    in a reference cycle, whose gather threads wait on its condition variable in the parent,
    is freed there without waiting for them (glibc's pthread_cond_destroy would, for ever)."""
    with forking.garbage_kept_until_forked():
        it = iter(fastddp.PrefetchLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
        next(it)  # the threads fill the ring and wait for the consumer
        cycle: dict[str, Any] = {"pass": it}
        cycle["self"] = cycle
        del it, cycle
        assert forking.child_collects_within(30) == 0
