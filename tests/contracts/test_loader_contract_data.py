"""PrefetchLoader against DataLoader, side by side (continued): exceptions at their batch, len(),
samplers and dataset forms, errors while a pass starts, the iterator protocol and warnings."""

from __future__ import annotations

import gc
import math
import os
import pickle
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    get_worker_info,
)

import fastddp
from tests.contracts.loader_harness import (
    N,
    Noisy,
    Stream,
    outcomes,
    refusals_at_iter,
    same,
    side_by_side,
    tensors,
)


# ---------------------------------------------------------------------------- errors at a batch
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_exception_at_its_batch_then_the_next_batches(workers: int) -> None:
    side_by_side(lambda: Noisy(fail_at=13), batch_size=5, num_workers=workers, passes=1)


class _KeptError(Dataset):
    """Raises the one exception instance it keeps, at every odd index."""

    error = ValueError("odd samples are broken")

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i % 2:
            raise self.error
        return i


@pytest.mark.parametrize("batch_size", [1, None])
def test_dataset_exception_names_its_batch_once(batch_size) -> None:
    """The dataset's exception (its own type and message) carries one note naming the batch,
    also when the dataset raises one instance again and again."""
    loader = fastddp.PrefetchLoader(_KeptError(), batch_size=batch_size)
    for _ in range(2):
        it = iter(loader)
        for k in range(6):
            if k % 2 == 0:
                next(it)
                continue
            with pytest.raises(ValueError) as info:
                next(it)
            assert str(info.value) == "odd samples are broken"
            assert info.value.__notes__ == [f"PrefetchLoader: raised reading batch {k}"], info.value.__notes__


def test_stream_exception_ends_the_pass_as_dataloader() -> None:
    side_by_side(lambda: Stream(fail_at=9), batch_size=4, passes=2)


@pytest.mark.parametrize("sampler", [
    [0.0, 1.5, 2.0, 3.0],          # a float index: IndexError at its batch
    [0, 1, -1, 2, -N, 5],          # negative indices count from the end
    [0, 1, N + 4, 2, 3, -N - 1, 4],  # out of range either way: IndexError at its batch
    [0, True, 2, 3],               # a bool index is what indexing a tensor makes of it
    torch.arange(6).view(-1, 1),   # tensor([i]) indices: each sample keeps the index's dimension
    [torch.tensor(1), torch.tensor([2]), 3, torch.tensor(4)],  # 0-d and 1-element tensors mixed
    [np.array([1]), np.array([2]), np.array(3), np.int64(4)],  # arrays: what indexing makes of them
])
def test_sampler_indices_as_dataloader(sampler: list) -> None:
    side_by_side(tensors, batch_size=2, sampler=sampler, passes=1)


def test_batch_sampler_outputs_as_dataloader() -> None:
    # a uint8 tensor of indices: DataLoader's dataset[i] reads each 0-d uint8 index as a mask
    uint8 = torch.tensor([1, 2], dtype=torch.uint8)
    side_by_side(tensors, batch_sampler=[[0, 1], [], [2.5], [3, -1], [N], uint8], passes=1)


def test_own_form_float_index_raises_indexerror_at_its_batch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    got = outcomes(fastddp.PrefetchLoader((x,), batch_size=2, sampler=[0.0, 1.5, 2.0, 3.0, -1]))
    assert [o[0] for o in got] == ["error", "error", "batch"]  # 2.0 is a float too
    assert got[0][1] is IndexError and "only integers" in got[0][2]
    assert torch.equal(got[2][1][0], x[[-1]])


# ---------------------------------------------------------------------------- len()
class Growing(Dataset):
    def __init__(self) -> None:
        self.n = 10

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("kwargs", [{"batch_size": 3}, {"batch_size": 3, "drop_last": True},
                                    {"batch_size": None}, {"batch_size": 4, "shuffle": True}])
def test_len_follows_the_dataset_at_call_time(kwargs: dict) -> None:
    for make in (Growing,):
        ref_ds, our_ds = make(), make()
        ref, ours = DataLoader(ref_ds, **kwargs), fastddp.PrefetchLoader(our_ds, **kwargs)
        assert len(ref) == len(ours)
        ref_ds.n = our_ds.n = 17
        assert len(ref) == len(ours)
        torch.manual_seed(0)
        a = outcomes(ref)
        torch.manual_seed(0)
        same(a, outcomes(ours))


def test_len_follows_replaced_tensors() -> None:
    ref_ds, our_ds = tensors(), tensors()
    ref, ours = DataLoader(ref_ds, batch_size=4), fastddp.PrefetchLoader(our_ds, batch_size=4)
    ref_ds.tensors = our_ds.tensors = (torch.arange(30.0),)
    assert len(ref) == len(ours) == 8
    same(outcomes(ref), outcomes(ours))


@pytest.mark.parametrize(("kwargs", "sized"), [({"batch_size": 4}, True), ({"batch_size": 4, "drop_last": True}, True),
                                               ({"batch_size": None}, True), ({"batch_size": 4}, False)])
def test_len_of_an_iterable_dataset(kwargs: dict, sized: bool) -> None:
    ref, ours = DataLoader(Stream(sized=sized), **kwargs), fastddp.PrefetchLoader(Stream(sized=sized), **kwargs)
    if not sized:
        for loader in (ref, ours):
            with pytest.raises(TypeError, match="Stream has no length"):
                len(loader)
        return
    want = N if kwargs["batch_size"] is None else (N // 4 if kwargs.get("drop_last") else math.ceil(N / 4))
    assert len(ref) == len(ours) == want


class PerWorker(IterableDataset):
    """Each worker process yields its own share (worker k: range(sizes[k]))."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self):
        info = get_worker_info()
        return iter(range(sum(self.sizes) if info is None else self.sizes[info.id]))

    def __len__(self) -> int:
        return sum(self.sizes)


@pytest.mark.parametrize("kwargs", [{"batch_size": None}, {"batch_size": 3}, {"batch_size": 3, "drop_last": True}])
def test_iterable_dataset_split_across_workers(kwargs: dict) -> None:
    side_by_side(lambda: PerWorker([0, 4, 9]), num_workers=3, passes=1, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_longer_than_reported_warns_as_dataloader(workers: int) -> None:
    import warnings

    texts = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(Stream(n=6), batch_size=None, num_workers=workers)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)  # no len() asked: no warning
            assert len(loader) == 6
            got = list(loader)  # twice the data with two workers: warned from the 7th on
        texts.append(([str(w.message).replace(repr(loader.dataset), "") for w in caught], len(got)))
    assert texts[0] == texts[1]


def test_list_of_tensors_is_a_sequence_of_samples() -> None:
    """DataLoader reads a list of tensors as samples (it may grow between passes); a tuple of
    tensors is PrefetchLoader's columns form (docs/compatibility.md)."""
    ref_ds, our_ds = [torch.full((3,), float(i)) for i in range(5)], [torch.full((3,), float(i)) for i in range(5)]
    ref, ours = DataLoader(ref_ds, batch_size=2), fastddp.PrefetchLoader(our_ds, batch_size=2)
    same(outcomes(ref), outcomes(ours))
    ref_ds.append(torch.ones(3))
    our_ds.append(torch.ones(3))
    assert len(ref) == len(ours) == 3
    same(outcomes(ref), outcomes(ours))


@pytest.mark.parametrize("make", [
    lambda: ["the cat sat", "a dog ran", "hello world"],
    lambda: ("the cat sat", "a dog ran", "hello world"),
    lambda: ["a.npy", "b.npy", "c.npy"],  # file names a script opens itself
    lambda: {0: torch.arange(3), 1: torch.arange(3) * 2},  # a map-style dataset keyed 0..n-1
], ids=["list of strings", "tuple of strings", "list of .npy names", "dict with int keys"])
def test_sequences_that_are_not_columns_are_samples(make: Callable[[], Any]) -> None:
    """Only a tuple of tensors or of .npy paths, and a dict of tensors under string keys, are
    PrefetchLoader's columns; anything else DataLoader can index is read as DataLoader reads it."""
    side_by_side(make, batch_size=2, shuffle=True)


@pytest.mark.parametrize("replacement", [(torch.arange(10), torch.arange(5)),
                                         (torch.arange(5), torch.arange(10)),
                                         (torch.arange(10), torch.tensor(3))],
                         ids=["second shorter", "first shorter", "a 0-d tensor"])
def test_tensor_dataset_with_replaced_tensors_of_other_lengths(replacement: tuple) -> None:
    """DataLoader reads rows until an index is past a tensor (an IndexError at that batch);
    the pass goes through the same Python reads instead of refusing the tensors up front."""
    def make() -> TensorDataset:
        ds = TensorDataset(torch.arange(10), torch.arange(10))
        ds.tensors = replacement
        return ds
    side_by_side(make, batch_size=4)


# torch's iterator, deleted half-made after its assertion, reports a missing attribute from
# its __del__ (its own bug, not a difference to compare).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("assigned_later", [None, -1], ids=["given", "assigned later"])
def test_prefetch_factor_zero_with_workers_fails_at_iter_as_dataloader(assigned_later) -> None:
    """DataLoader accepts prefetch_factor=0 with workers; its iterator fails an assertion
    after drawing the pass's seed, before any worker starts."""
    states = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(1234)
        loader = cls(tensors(), batch_size=4, shuffle=True, num_workers=2,
                     prefetch_factor=0 if assigned_later is None else 2)
        if assigned_later is not None:
            loader.prefetch_factor = assigned_later
        with pytest.raises(AssertionError, match=r"^prefetch_factor must be greater than 0 for "
                                                 r"MultiProcessingDataLoaderIter"):
            iter(loader)
        states.append(torch.random.get_rng_state())
    assert torch.equal(states[0], states[1]), "the global generator differs after the refusal"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("factor", [2.0, 2.5], ids=["2.0", "2.5"])
def test_float_prefetch_factor_with_workers_fails_at_iter_as_dataloader(factor: float) -> None:
    """DataLoader takes a float prefetch_factor at construction; its iterator fails with
    TypeError when it requests prefetch_factor * num_workers batches, after drawing the pass's
    seed. PrefetchLoader raises the same at the same point, naming the argument."""
    messages = refusals_at_iter(
        lambda cls: cls(tensors(), batch_size=4, shuffle=True, num_workers=1, prefetch_factor=factor), TypeError)
    assert messages[1].startswith(messages[0]) and "give prefetch_factor as a positive int" in messages[1], messages


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_sampler_of_tuples(workers: int) -> None:
    batches = [tuple(range(i, i + 2)) for i in range(0, 20, 5)] + [tuple(range(i + 2, i + 5)) for i in range(0, 20, 5)]
    side_by_side(tensors, batch_sampler=batches, num_workers=workers, passes=1)


def test_range_sampler() -> None:
    side_by_side(tensors, sampler=range(2, 12), batch_size=2, passes=1)


class NumpySamples(Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        return np.ones((2, 3)) * i


def test_numpy_samples_become_double_tensors() -> None:
    side_by_side(NumpySamples, batch_size=12, passes=1)


class Doubled(torch.utils.data.Subset):
    """A Subset whose batched read (``__getitems__``) transforms samples."""

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.dataset[self.indices[idx]][1] * 2

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def test_dataset_getitems_is_used() -> None:
    side_by_side(lambda: Doubled(tensors(), [0, 1, 2, 3, 7]), batch_size=2, passes=1)


class FailingStream(IterableDataset):
    def __iter__(self):
        raise RuntimeError("Error in __iter__")


def _failing_init(worker_id: int) -> None:
    raise RuntimeError("Error in worker_init_fn")


@pytest.mark.parametrize(("make", "kwargs"), [
    # (with workers, DataLoader itself sometimes reports a worker that exited instead, under load)
    (FailingStream, {"num_workers": 0}),
    (tensors, {"num_workers": 2, "worker_init_fn": _failing_init}),
])
def test_errors_while_a_pass_starts(make: Callable[[], Any], kwargs: dict, monkeypatch) -> None:
    # A worker whose worker_init_fn raised stays alive until DataLoader's shutdown gives up
    # joining it: MP_STATUS_CHECK_INTERVAL (5 s) per worker, for both loaders (both shut down
    # through torch's iterator), once the failed iterator is collected. Shorter here.
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    for cls in (DataLoader, fastddp.PrefetchLoader):
        with pytest.raises(RuntimeError, match="Error in"):
            list(cls(make(), **kwargs))
        gc.collect()  # the failed iterator shuts its workers down now, with the short interval


class Bulk(Dataset):
    """Reads a whole list of indices at once (unbatched mode with a sampler of lists)."""

    def __len__(self) -> int:
        return 35

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        assert isinstance(indices, list)
        return torch.as_tensor(indices)


@pytest.mark.parametrize("workers", [0, 2])
def test_unbatched_sampler_of_lists(workers: int) -> None:
    side_by_side(Bulk, batch_size=None, num_workers=workers, passes=1,
                 sampler=[list(range(i, min(i + 4, 35))) for i in range(0, 35, 4)])


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_sampler": [[0, 1, 2, 3, 4], [5], [6, 7]]}],
                         ids=["last batch short", "batches of several sizes"])
def test_batch_storage_is_the_batchs_own_as_dataloader(kwargs: dict) -> None:
    """Every batch's storage is its own size, a short one too (a view into a full-size ring
    slot would make torch.save(batch) write the slot and a kept batch hold it)."""
    sizes = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        sizes.append([[(t.untyped_storage().nbytes(), t.nbytes, t.storage_offset()) for t in batch]
                      for batch in cls(TensorDataset(torch.randn(N, 6), torch.arange(N)), **kwargs)])
    assert sizes[0] == sizes[1], sizes
    assert all(storage == size for batch in sizes[1] for storage, size, _ in batch)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("started_in", ["inference_mode", "grad mode"])
def test_batches_take_the_inference_mode_of_their_next(started_in: str, workers: int) -> None:
    """A batch is an inference tensor exactly when its next() runs inside
    torch.inference_mode(), as DataLoader makes it then: a pass started in inference mode (an
    evaluation on the training loader) still delivers normal batches to training steps
    afterwards, and the ring slots stay normal tensors for later passes. The reference is
    DataLoader without workers: with workers, the batches DataLoader unpickles after one
    received in inference mode are inference tensors too, or not, as the timing goes
    (docs/compatibility.md)."""
    seen = []
    for cls, count in ((DataLoader, 0), (fastddp.PrefetchLoader, workers)):
        loader = cls(TensorDataset(torch.randn(N, 6), torch.arange(N)), batch_size=4, num_workers=count)
        modes = []
        for _ in range(2):
            if started_in == "inference_mode":
                with torch.inference_mode():
                    it = iter(loader)
                    modes.append([t.is_inference() for t in next(it)])
            else:
                it = iter(loader)
            for batch in it:  # in grad mode; one batch in inference mode
                modes.append([t.is_inference() for t in batch])
                with torch.inference_mode():
                    inner = next(it, None)
                modes.append(None if inner is None else [t.is_inference() for t in inner])
                weight = torch.ones(6, requires_grad=True)
                (batch[0] * weight).sum().backward()  # torch refuses an inference tensor here
        seen.append(modes)
    assert seen[0] == seen[1], seen
    assert [True, True] in seen[1] and [False, False] in seen[1]


def test_private_collation_view() -> None:
    for kwargs in ({"batch_size": 2}, {"batch_size": None}):
        ref, ours = DataLoader(tensors(), **kwargs), fastddp.PrefetchLoader(tensors(), **kwargs)
        assert ref._auto_collation == ours._auto_collation
        assert type(ref._index_sampler) is type(ours._index_sampler)


def test_too_many_workers_warns_as_dataloader() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader running slow"):
            cls(tensors(), batch_size=2, num_workers=1000)


@pytest.mark.parametrize("persistent", [False, True], ids=["per pass", "persistent"])
def test_too_many_workers_warns_at_each_pass_as_dataloader(persistent: bool) -> None:
    """DataLoader checks the worker count at construction and whenever it makes a worker
    iterator (every pass, or the first one with persistent workers)."""
    workers = len(os.sched_getaffinity(0)) + 1
    counts = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = cls(tensors(), batch_size=2, num_workers=workers, persistent_workers=persistent)
            for _ in range(2):
                next(iter(loader))
        counts.append(sum("excessive worker creation" in str(w.message) for w in caught))
    assert counts[0] == counts[1] == (2 if persistent else 3), counts


def test_iterator_protocol() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=5)
        it = iter(loader)
        assert iter(it) is it and len(it) == len(loader) == 5
        stream_it = iter(cls(Stream(), batch_size=5))
        with pytest.raises(TypeError, match="has no len"):
            len(stream_it)  # its sampler is endless, whatever the stream's length


def test_pin_memory_warnings_without_an_accelerator() -> None:
    if torch.accelerator.is_available():
        pytest.skip("what happens without an accelerator")
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=5, pin_memory=True)
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator is found"):
            got = outcomes(loader)
        assert len(got) == 5 and not got[0][1][0].is_pinned()


@pytest.mark.parametrize("inference", [False, True], ids=["tensors", "inference tensors"])
@pytest.mark.parametrize("layout", ["transposed", "pin_dataset", "device_resident"])
def test_tensors_changed_in_place_between_passes(layout: str, inference: bool) -> None:
    # DataLoader reads the dataset's current values in every pass; a copy the loader made of a
    # non-contiguous (or pinned, or device-resident) tensor is made again once it changed (an
    # inference tensor, which has no version counter, changes only under inference_mode).
    if layout == "pin_dataset" and not torch.cuda.is_available():
        pytest.skip("pin_dataset needs a CUDA device")
    extra = {"transposed": {}, "pin_dataset": {"pin_dataset": True, "device": "cuda"},
             "device_resident": {"device_resident": True}}[layout]
    passes = []
    for cls, kwargs in ((DataLoader, {}), (fastddp.PrefetchLoader, extra)):
        with torch.inference_mode(inference):
            base = torch.arange(24.0).reshape(3, 8)
        loader = cls(TensorDataset(base.t(), torch.arange(8)), batch_size=3, **kwargs)
        first = outcomes(loader)
        with torch.inference_mode(inference):
            base.mul_(-1)
        passes.append((first, outcomes(loader)))
    for ref, ours in zip(*passes):
        same(ref, [(k, [t.cpu() for t in leaves], spec) for k, leaves, spec in ours])
    assert passes[0][1][0][1][0][1, 1] == -9.0  # DataLoader saw the new values


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_tensors_changed_unseen_by_the_version_counter(how: str) -> None:
    # A write through numpy (a Fortran-ordered array: torch.from_numpy of it is not contiguous)
    # or `.data =` leaves the version counter as it was: the contiguous copy is made every pass.
    passes = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        array = np.asfortranarray(np.zeros((8, 3), dtype=np.float32))
        x = torch.from_numpy(array)
        loader = cls(TensorDataset(x), batch_size=8)
        seen = []
        for value in (1.0, 2.0, 3.0):
            if how == "numpy":
                array[:] = value
            else:
                x.data = torch.full((3, 8), value).t()
            seen.append(next(iter(loader))[0][0, 0].item())
        passes.append(seen)
    assert passes == [[1.0, 2.0, 3.0]] * 2


@pytest.mark.parametrize("kwargs", [{}, {"device_resident": True}], ids=["copied", "device_resident"])
def test_tensors_replaced_by_new_ones_each_pass(kwargs: dict) -> None:
    # The old tensors are freed before the new ones are made, which often take their memory
    # (and id()) at the same version: the copies are of the tensors, not of their ids.
    passes = []
    for cls, extra in ((DataLoader, {}), (fastddp.PrefetchLoader, kwargs)):
        dataset = TensorDataset(torch.zeros(4, 8).t())
        loader = cls(dataset, batch_size=8, **extra)
        seen = []
        for value in range(1, 9):
            dataset.tensors = ()
            gc.collect()
            dataset.tensors = (torch.full((4, 8), float(value)).t(),)
            seen.append(next(iter(loader))[0][0, 0].item())
        passes.append(seen)
    assert passes == [[float(v) for v in range(1, 9)]] * 2


@pytest.mark.parametrize("workers", [0, 1])
def test_sampler_list_changed_during_the_pass(workers: int) -> None:
    # DataLoader's batch sampler walks a list item by item: what is left of it may be reordered
    # or extended by the loop (hard examples appended), and the pass yields the new order.
    passes = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        order = list(range(12))
        loader = cls(TensorDataset(torch.arange(12)), batch_size=2, sampler=order, num_workers=workers)
        seen = []
        for k, (x,) in enumerate(loader):
            seen.append(x.tolist())
            if k == 0:
                order[6:] = order[6:][::-1]
                order.extend([0, 1])
        passes.append(seen)
    assert passes[0] == passes[1] == [[0, 1], [2, 3], [4, 5], [11, 10], [9, 8], [7, 6], [0, 1]]


def test_iterator_cannot_be_pickled() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        for dataset in (tensors(), Noisy()):
            with pytest.raises(NotImplementedError, match="cannot be pickled"):
                pickle.dumps(iter(cls(dataset, batch_size=4)))


class _Tagged(torch.Tensor):
    """A tensor subclass: torch.stack of its rows keeps the type."""


TENSOR_KINDS = {
    "conjugate_view": lambda: torch.tensor([1 + 2j, 3 - 1j, 2 + 2j, -1j, 5]).conj(),
    "subclass": lambda: torch.arange(5.0).as_subclass(_Tagged),
    "parameter": lambda: torch.nn.Parameter(torch.arange(5.0)),
    "requires_grad": lambda: torch.arange(5.0, requires_grad=True),
    "sparse": lambda: torch.eye(5).to_sparse(),
    "inference": lambda: _inference(torch.arange(5.0)),  # e.g. features from a frozen model
    "quantized": lambda: _quantized(torch.arange(5.0) / 4),
    "nested": lambda: _nested([torch.arange(3.0) + k for k in range(5)]),
}


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning for the strided layout
        return torch.nested.nested_tensor(rows)


def _quantized(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of quantized tensors
        return torch.quantize_per_tensor(t, 0.25, 3, torch.qint8)


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("kind", sorted(TENSOR_KINDS))
def test_tensor_dataset_of_tensors_that_are_not_plain_data(kind: str) -> None:
    # the batches DataLoader's torch.stack makes of them: the conjugated values, the subclass,
    # the autograd history (a learned dataset, e.g. dataset distillation), sparse's error, the
    # quantizer and a nested tensor's rows (read through torch's collation), inference tensors
    # (gathered)
    side_by_side(lambda: TensorDataset(TENSOR_KINDS[kind]()), batch_size=2)
    grads = [[b[0].requires_grad for b in cls(TensorDataset(TENSOR_KINDS[kind]()), batch_size=2)]
             for cls in (DataLoader, fastddp.PrefetchLoader)] if kind != "sparse" else [[], []]
    assert grads[0] == grads[1]


@pytest.mark.parametrize("kind", ["requires_grad", "sparse", "subclass", "quantized", "nested"])
def test_own_form_columns_must_be_plain_data(kind: str) -> None:
    with pytest.raises(ValueError, match=r"tensor 0 is a .*Wrap them in a TensorDataset"):
        fastddp.PrefetchLoader((TENSOR_KINDS[kind](),), batch_size=2)
