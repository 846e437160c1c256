"""PrefetchLoader with a batch_sampler, an IterableDataset and a global-generator shuffle
resumed mid-epoch: DataLoader's batches; and the torch-suite runner."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp
from tests.loader_common import N, _data, _MapDataset


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
    assert threading.active_count() <= before  # (threads of earlier tests may end meanwhile)
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


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("taken", [0, 3])
def test_mid_epoch_resume_of_a_global_generator_shuffle(taken: int, workers: int) -> None:
    """shuffle=True drawing from the global generator: a pass resumed from state_dict redraws the
    saved pass's draws (up to state_dict, even one taken after iter() before the first batch)
    without drawing from the global generator, so a trainer that restores its global state from
    the same checkpoint continues exactly as the uninterrupted run."""
    x, y = _data()
    torch.manual_seed(21)
    loader = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=100, shuffle=True, num_workers=workers)
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(taken)]
    state, rng = loader.state_dict(), torch.random.get_rng_state()
    rest = [b.clone() for _, b in it]
    after = torch.rand(4)  # what the uninterrupted run draws next

    torch.manual_seed(999)  # a new process: its own global state until the trainer restores it
    resumed = fastddp.PrefetchLoader(TensorDataset(x, y), batch_size=100, shuffle=True, num_workers=workers)
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
