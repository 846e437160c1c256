"""PrefetchLoader yields exactly dataset[sampler indices], batch by batch, for every dataset kind."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, RandomSampler, SequentialSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp

N = 1000


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 9, 16, generator=g), torch.randint(0, 6, (N,), generator=g)


class _IndexSampler:
    def __init__(self, idx: torch.Tensor) -> None:
        self.idx = idx

    def indices(self) -> torch.Tensor:
        return self.idx

    def __iter__(self):
        return iter(self.idx.tolist())

    def __len__(self) -> int:
        return len(self.idx)


class _MapDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, fail_at: int | None = None) -> None:
        self.x, self.y, self.fail_at = x, y, fail_at

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return self.x[i], self.y[i]


def _expected(idx: torch.Tensor, batch: int, drop_last: bool) -> list[torch.Tensor]:
    end = (len(idx) // batch) * batch if drop_last else len(idx)
    return list(idx[:end].split(batch))


def _check(loader, x, y, idx, batch, drop_last) -> None:
    want = _expected(idx, batch, drop_last)
    got = list(loader)
    assert len(got) == len(want) == len(loader)
    for (bx, by), widx in zip(got, want):
        assert torch.equal(bx, x[widx]) and torch.equal(by, y[widx])


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
    tail = [b.clone() for _, b in resumed]
    assert len(tail) == len(rest) and all(torch.equal(a, b) for a, b in zip(tail, rest))
    assert len(head) + len(tail) == len(loader)
    with pytest.raises(ValueError, match="saved from a loader with a generator; pass generator="):
        fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, shuffle=True).load_state_dict(state)


def test_mid_epoch_resume() -> None:
    x, y = _data()
    sampler = fastddp.DistributedSampler(N, num_replicas=2, rank=0, seed=2)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, sampler=sampler)
    loader.set_epoch(3)
    full = [b.clone() for _, b in loader]
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(4)]
    state = loader.state_dict()
    assert state["epoch"] == 3 and state["batches_done"] == 4
    del it
    sampler2 = fastddp.DistributedSampler(N, num_replicas=2, rank=0, seed=2)
    resumed = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=50, sampler=sampler2)
    resumed.load_state_dict(state)
    tail = [b.clone() for _, b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        assert torch.equal(a, b)


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
    x, y = _data()
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=2, num_workers=workers,
                                    sampler=_IndexSampler(torch.tensor([1, 2, N + 5, 3, 4, -1])))
    it = iter(loader)
    assert torch.equal(next(it)[1], y[[1, 2]])
    with pytest.raises(IndexError, match=f"index {N + 5} is out of bounds for dimension 0 with size {N}"):
        next(it)
    assert torch.equal(next(it)[1], y[[4, N - 1]])  # -1 is the last sample, as DataLoader reads it


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
        ({"prefetch": 0}, ValueError, "prefetch must be an integer >= 1, got 0"),
        ({"shuffle": True, "sampler": SequentialSampler(range(N))}, ValueError, "mutually exclusive"),
    ],
)
def test_bad_arguments(kwargs, exc, message) -> None:
    x, y = _data()
    with pytest.raises(exc, match=message):
        fastddp.PrefetchLoader(TensorDataset(x, y), **kwargs)


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
def test_cuda_direct_bad_index_is_clear_error() -> None:
    x = torch.randn(10, 4).pin_memory()
    loader = fastddp.PrefetchLoader((x,), batch_size=4, device="cuda",
                                    sampler=_IndexSampler(torch.tensor([0, 1, 2, 12])))
    assert loader.transfer == "direct"
    with pytest.raises(RuntimeError, match="index 12 in batch 0 is out of range for a dataset of 10"):
        list(loader)


def test_pin_dataset_needs_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"pin_dataset needs tensors or \.npy arrays and a CUDA "
                       r"device \(got a tensors dataset, device cpu\)"):
        fastddp.PrefetchLoader((torch.zeros(4, 2),), batch_size=2, pin_dataset=True)


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


class _LengthBuckets:
    """Variable-size batches, as a batch sampler grouping samples by length would yield: a new
    grouping every epoch, batch sizes 1..37."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _cuts(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(100 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        out, pos = [], 0
        while pos < self.n:
            size = int(torch.randint(1, 38, (1,), generator=g))
            out.append(order[pos:pos + size])
            pos += size
        return out

    def __iter__(self):
        return iter(self._cuts())

    def __len__(self) -> int:
        return len(self._cuts())


@pytest.mark.parametrize("kind", ["tensors", "generic"])
@pytest.mark.parametrize("make", ["random", "buckets", "distributed"])
def test_batch_sampler_yields_dataloaders_batches(kind: str, make: str) -> None:
    x, y = _data()
    ds = TensorDataset(x, y) if kind == "tensors" else _MapDataset(x, y)

    def batch_sampler():
        if make == "random":
            return BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(5)),
                                batch_size=64, drop_last=False)
        if make == "buckets":
            return _LengthBuckets(N)
        return BatchSampler(TorchSampler(range(N), num_replicas=3, rank=1, seed=4), 50, drop_last=True)

    ours_bs, ref_bs = batch_sampler(), batch_sampler()
    ours = fastddp.PrefetchLoader(ds, batch_sampler=ours_bs, num_workers=2, pin_memory=False)
    ref = torch.utils.data.DataLoader(ds, batch_sampler=ref_bs)
    assert ours.batch_size is None and ours.transfer == ("host" if kind == "tensors" else "generic")
    for epoch in range(2):
        # our set_epoch reaches the batch sampler, or the sampler inside a BatchSampler
        ours.set_epoch(epoch)
        if make == "buckets":
            ref_bs.set_epoch(epoch)
        elif make == "distributed":
            ref_bs.sampler.set_epoch(epoch)
        got, want = list(ours), list(ref)
        assert len(got) == len(want) == len(ours) == len(ref)
        if make == "buckets":
            assert len({len(b[1]) for b in got}) > 5  # the batches really differ in size
        for (gx, gy), (wx, wy) in zip(got, want):
            assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_batch_sampler_mid_epoch_resume() -> None:
    x, y = _data()
    ds = TensorDataset(x, y)
    loader = fastddp.PrefetchLoader(ds, batch_sampler=_LengthBuckets(N))
    loader.set_epoch(2)
    full = [b.clone() for _, b in loader]
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = fastddp.PrefetchLoader(ds, batch_sampler=_LengthBuckets(N))
    resumed.load_state_dict(state)
    tail = [b.clone() for _, b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("kwargs", "exc", "message"), [
    ({"batch_size": 4}, ValueError, "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"),
    ({"shuffle": True}, ValueError, "mutually exclusive"),
    ({"drop_last": True}, ValueError, "mutually exclusive"),
    ({"sampler": range(4)}, ValueError, "mutually exclusive"),
])
def test_batch_sampler_with_batching_arguments_is_dataloaders_error(kwargs, exc, message) -> None:
    ds = TensorDataset(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="mutually exclusive with batch_size, shuffle, sampler, and drop_last"):
        torch.utils.data.DataLoader(ds, batch_sampler=[[0, 1]], **kwargs)
    with pytest.raises(exc, match=message):
        fastddp.PrefetchLoader(ds, batch_sampler=[[0, 1]], **kwargs)


def test_signature_is_dataloaders() -> None:
    """A DataLoader call keeps its meaning after the class name changes: the positional
    parameters are DataLoader's in its order, and every DataLoader keyword is accepted."""
    import inspect

    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    ours = inspect.signature(fastddp.PrefetchLoader.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert set(theirs) <= set(ours)
    ds0 = TensorDataset(torch.zeros(8, 2))
    public = lambda obj: {n for n in vars(obj) if not n.startswith("_")}  # noqa: E731
    assert public(torch.utils.data.DataLoader(ds0, batch_size=2)) <= public(fastddp.PrefetchLoader(ds0, batch_size=2))
    x, y = _data()
    ds = TensorDataset(x, y)
    sampler = TorchSampler(ds, num_replicas=2, rank=1, seed=3)
    # dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory, drop_last
    args = (ds, 48, None, sampler, None, 0, None, False, True)
    got, want = list(fastddp.PrefetchLoader(*args, in_order=False, pin_memory_device="")), \
        list(torch.utils.data.DataLoader(*args, in_order=False))
    assert len(got) == len(want) == 10
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
    for cls in (torch.utils.data.DataLoader, fastddp.PrefetchLoader):  # deprecated: a warning
        with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):
            iter(cls(ds, 4, pin_memory=True, pin_memory_device="cpu"))


class _Stream(torch.utils.data.IterableDataset):
    """A stream of (x, y) samples with a length, optionally failing at one."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.x, self.y = _data()

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise KeyError(f"record {i} is corrupt")
            yield self.x[i], self.y[i]

    def __len__(self) -> int:
        return self.n


class _UnsizedStream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.inner = _Stream(n)

    def __iter__(self):
        return iter(self.inner)


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("collate", [False, True])
def test_iterable_dataset_yields_dataloaders_batches(batch: int, drop_last: bool, collate: bool) -> None:
    ds = _Stream(301)
    kwargs = dict(batch_size=batch, drop_last=drop_last,
                  collate_fn=(lambda s: (torch.stack([a for a, _ in s]), [int(b) for _, b in s])) if collate else None)
    ours = fastddp.PrefetchLoader(ds, pin_memory=False, **kwargs)
    ref = torch.utils.data.DataLoader(ds, **kwargs)
    assert ours.transfer == "iterable" and len(ours) == len(ref)
    for _ in range(2):  # and again: each pass reads the stream anew
        got, want = list(ours), list(ref)
        assert len(got) == len(want) == len(ours)
        for (gx, gy), (wx, wy) in zip(got, want):
            assert torch.equal(gx, wx) and (gy == wy if collate else torch.equal(gy, wy))


def test_iterable_dataset_without_len_errors_and_resumes() -> None:
    ds = _UnsizedStream(100)
    loader = fastddp.PrefetchLoader(ds, batch_size=8)
    with pytest.raises(TypeError, match="object of type '_UnsizedStream' has no len"):
        len(loader)
    with pytest.raises(TypeError):
        len(torch.utils.data.DataLoader(ds, batch_size=8))  # DataLoader has none either
    full = [b.clone() for _, b in loader]
    assert len(full) == 13
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = fastddp.PrefetchLoader(_UnsizedStream(100), batch_size=8)
    resumed.load_state_dict(state)  # the resumed pass reads and drops the first 5 batches
    tail = [b.clone() for _, b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        assert torch.equal(a, b)


def test_iterable_dataset_errors_and_early_break() -> None:
    with pytest.raises(KeyError, match="record 20 is corrupt"):
        list(fastddp.PrefetchLoader(_Stream(50, fail_at=20), batch_size=4))
    before = threading.active_count()
    loader = fastddp.PrefetchLoader(_Stream(1000), batch_size=2, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before
    for kwargs in ({"shuffle": True}, {"sampler": range(4)}, {"sampler": []}, {"batch_sampler": [[0]]}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"expected unspecified {name} option"):
            torch.utils.data.DataLoader(_Stream(4), **kwargs)
        with pytest.raises(ValueError, match=f"PrefetchLoader: DataLoader with IterableDataset: expected unspecified {name} option"):
            fastddp.PrefetchLoader(_Stream(4), **kwargs)


@pytest.mark.cuda
def test_cuda_iterable_dataset_batches() -> None:
    ds = _Stream(301)
    ours = fastddp.PrefetchLoader(ds, batch_size=32, device="cuda")
    got, want = list(ours), list(torch.utils.data.DataLoader(ds, batch_size=32))
    assert len(got) == len(want) == 10
    for (gx, gy), (wx, wy) in zip(got, want):
        assert gx.is_cuda and gy.is_cuda
        assert torch.equal(gx.cpu(), wx) and torch.equal(gy.cpu(), wy)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what happens without CUDA")
@pytest.mark.parametrize("kind", ["tensors", "generic", "iterable"])
def test_pin_memory_without_cuda_warns_like_dataloader(kind: str) -> None:
    x, y = _data()
    ds = {"tensors": TensorDataset(x, y), "generic": _MapDataset(x, y), "iterable": _Stream(N)}[kind]
    with pytest.warns(UserWarning, match="no accelerator is found"):
        want = list(torch.utils.data.DataLoader(ds, batch_size=100, pin_memory=True))
    loader = fastddp.PrefetchLoader(ds, batch_size=100, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        got = list(loader)
    assert len(got) == len(want) == 10
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_mid_epoch_resume_of_a_global_generator_shuffle() -> None:
    """shuffle=True drawing from the global generator: a pass resumed from state_dict redraws the
    saved pass's order without drawing from the global generator, so a trainer that restores
    its global state from the same checkpoint continues exactly as the uninterrupted run."""
    x, y = _data()
    torch.manual_seed(21)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=100, shuffle=True)
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(3)]
    state, rng = loader.state_dict(), torch.random.get_rng_state()
    rest = [b.clone() for _, b in it]
    after = torch.rand(4)  # what the uninterrupted run draws next

    torch.manual_seed(999)  # a new process: its own global state until the trainer restores it
    resumed = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=100, shuffle=True)
    resumed.load_state_dict(state)
    torch.random.set_rng_state(rng)
    tail = [b.clone() for _, b in resumed]
    assert len(head) + len(tail) == len(loader) and all(torch.equal(a, b) for a, b in zip(tail, rest))
    assert torch.equal(torch.rand(4), after)
    assert torch.equal(torch.sort(torch.cat(head + tail)).values, torch.sort(y).values)


_TORCH_STYLE_SUITE = '''
import unittest
import torch
from torch.utils.data import DataLoader, TensorDataset


class TestDataLoader(unittest.TestCase):
    def test_batches(self):
        ds = TensorDataset(torch.arange(10.0))
        self.assertEqual(len(list(DataLoader(ds, batch_size=3))), 4)

    def test_class_in_use(self):
        self.assertEqual(DataLoader.__name__, "PrefetchLoader")

    def test_private_iterator_member(self):
        iter(torch.utils.data.DataLoader(TensorDataset(torch.zeros(4)), num_workers=0))._workers
'''


def test_torch_suite_runner_swaps_the_class_and_lists_failures(tmp_path) -> None:
    """benchmarks/torch_suites/run_dataloader.py runs a torch-style test module with
    PrefetchLoader in DataLoader's place and lists what fails, with the exception."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "torch_suites" / "run_dataloader.py"
    spec = importlib.util.spec_from_file_location("run_dataloader", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    suite = tmp_path / "test_dataloader.py"
    suite.write_text(_TORCH_STYLE_SUITE)
    rows = {tid.rsplit(".", 1)[1]: (outcome, why) for tid, outcome, why in runner.run_suite(suite)}
    assert rows["test_batches"] == ("passed", "") and rows["test_class_in_use"] == ("passed", "")
    assert rows["test_private_iterator_member"][0] == "error"
    assert "has no attribute '_workers'" in rows["test_private_iterator_member"][1]
    assert torch.utils.data.DataLoader.__name__ == "DataLoader"  # restored afterwards
