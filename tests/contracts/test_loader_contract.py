"""PrefetchLoader against torch.utils.data.DataLoader with the same arguments, side by side in
one process: the batches (values, types, nesting), the exceptions (type and message, at the same
batch, and what the next next() gives), len(), attribute locks and the global and given
generators' states must be the same."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    get_worker_info,
)

import fastddp

N = 23


class Noisy(Dataset):
    """A map-style dataset whose samples draw from the global generator (as augmentation does)."""

    def __init__(self, n: int = N, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return {"i": i, "noise": torch.rand(2), "pair": (torch.tensor([i, -i]), float(i))}


class WorkerView(Dataset):
    """Samples that show what the process reading them sees: get_worker_info() and its seeds."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, int, int, int, float]:
        info = get_worker_info()
        if info is None:
            return i, -1, -1, torch.initial_seed(), float(torch.rand(()))
        return i, info.id, info.num_workers, info.seed, float(torch.rand(()))


class Stream(IterableDataset):
    def __init__(self, n: int = N, fail_at: int | None = None, sized: bool = True) -> None:
        self.n, self.fail_at, self.sized = n, fail_at, sized

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"record {i} is corrupt")
            yield torch.tensor([i]), torch.rand(1)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("Stream has no length")
        return self.n


def tensors() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, generator=g), torch.arange(N))


def outcomes(loader: Any, limit: int = 200) -> list[tuple]:
    """Every next() of one pass: ('batch', leaves, structure) or ('error', type, message)."""
    out: list[tuple] = []
    it = iter(loader)
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return out
        except Exception as exc:
            out.append(("error", type(exc), str(exc).split("\n")[0]))
            continue
        leaves, spec = tree_flatten(batch)
        out.append(("batch", [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves], str(spec)))
    raise AssertionError("the pass did not end")


def same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for k, (x, y) in enumerate(zip(a, b)):
        assert x[0] == y[0], (k, x, y)
        if x[0] == "error":
            assert x[1:] == y[1:], k
            continue
        assert x[2] == y[2], k  # the same nesting and container types
        assert len(x[1]) == len(y[1])
        for p, q in zip(x[1], y[1]):
            assert type(p) is type(q)
            assert torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q, k


def side_by_side(make_dataset: Callable[[], Any], passes: int = 2, between: Callable[[], None] = lambda: None,
                 **kwargs: Any) -> None:
    """The same passes with DataLoader and PrefetchLoader from the same global seed (and equal
    generators): equal outcomes, equal global and generator states after them."""
    results = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(1234)
        kw = dict(kwargs)
        if "generator" in kw:
            kw["generator"] = torch.Generator().manual_seed(99)
        loader = cls(make_dataset(), **kw)
        runs = []
        for _ in range(passes):
            runs.append(outcomes(loader))
            between()
        gen = kw["generator"].get_state() if "generator" in kw else None
        results.append((runs, torch.random.get_rng_state(), gen))
    (ref, ref_state, ref_gen), (ours, our_state, our_gen) = results
    for a, b in zip(ref, ours):
        same(a, b)
    assert torch.equal(ref_state, our_state), "the global generator differs after the passes"
    if ref_gen is not None:
        assert torch.equal(ref_gen, our_gen), "the given generator differs after the passes"


# ---------------------------------------------------------------------------- random state
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [None, False, True])
@pytest.mark.parametrize("kind", ["tensors", "python"])
def test_global_generator_draws_match(kind: str, shuffle: bool | None, workers: int) -> None:
    make = tensors if kind == "tensors" else Noisy
    side_by_side(make, batch_size=5, shuffle=shuffle, num_workers=workers, between=lambda: torch.rand(3))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("kind", ["tensors", "python"])
def test_given_generator_draws_match(kind: str, shuffle: bool) -> None:
    make = tensors if kind == "tensors" else Noisy
    side_by_side(make, batch_size=4, shuffle=shuffle, generator=True, drop_last=True, passes=3)


class DrawingSampler:
    """A sampler that draws from the global generator for every index it yields: the moments
    the loader reads it show in the indices and in the global generator's state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for _ in range(self.n):
            yield int(torch.randint(0, N, ()))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("workers", [0, 2])
def test_sampler_read_at_dataloaders_moments(workers: int) -> None:
    """Draws between batches (as dropout makes) interleave with the sampler's draws exactly as
    with DataLoader: without workers one batch per next(), with workers prefetch_factor *
    num_workers ahead."""
    results = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(77)
        loader = cls(tensors(), batch_size=3, sampler=DrawingSampler(17), num_workers=workers)
        got = []
        for _, y in loader:
            got.append((y.clone(), torch.rand(())))  # the training step's draw
        results.append((got, torch.random.get_rng_state()))
    (a, sa), (b, sb) = results
    assert len(a) == len(b) == 6
    for (ya, ra), (yb, rb) in zip(a, b):
        assert torch.equal(ya, yb) and torch.equal(ra, rb)
    assert torch.equal(sa, sb)


def test_iterable_dataset_draws_match() -> None:
    side_by_side(Stream, batch_size=4, between=lambda: torch.rand(1))


def test_each_iterator_draws_its_seed_even_unused() -> None:
    states = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(5)
        loader = cls(tensors(), batch_size=4, shuffle=True)
        iter(loader)
        iter(loader)
        states.append(torch.random.get_rng_state())
    assert torch.equal(*states)


@pytest.mark.parametrize("kind", ["tensors", "python"])
def test_sampler_draws_at_the_first_next_as_dataloader(kind: str) -> None:
    """shuffle=True draws its permutation's seed at the first next(), after the iterator's seed:
    a draw made between iter() and next() changes the order as it does for DataLoader."""
    got = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(7)
        it = iter(cls(tensors() if kind == "tensors" else Noisy(), batch_size=4, shuffle=True))
        torch.rand(1)
        batches = list(it)
        got.append((batches[0], torch.random.get_rng_state()))
    (a, sa), (b, sb) = got
    same(outcomes([a]), outcomes([b]))
    assert torch.equal(sa, sb)


def test_early_break_leaves_the_same_generator_states() -> None:
    states = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(4)
        loader = cls(tensors(), batch_size=2, shuffle=True, generator=g)
        for k, _ in enumerate(loader):
            if k == 2:
                break
        states.append((torch.random.get_rng_state(), g.get_state()))
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_persistent_workers_draw_one_seed_and_reuse_the_iterator() -> None:
    states = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(8)
        loader = cls(tensors(), batch_size=6, num_workers=1, persistent_workers=True)
        first = iter(loader)
        list(first)
        assert iter(loader) is first
        list(loader)
        states.append(torch.random.get_rng_state())
    assert torch.equal(*states)


# ---------------------------------------------------------------------------- what Python code sees
@pytest.mark.parametrize("workers", [0, 2])
def test_worker_info_and_seeds_seen_by_the_dataset(workers: int) -> None:
    side_by_side(WorkerView, batch_size=3, num_workers=workers, passes=1)


def _init_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)


def test_worker_init_fn_runs_as_dataloaders() -> None:
    side_by_side(WorkerView, batch_size=3, num_workers=2, worker_init_fn=_init_worker, passes=1)


def test_collate_fn_sees_dataloaders_samples() -> None:
    side_by_side(Noisy, batch_size=4, collate_fn=lambda samples: [s["i"] for s in samples], shuffle=True)


# ---------------------------------------------------------------------------- modes and arguments
@pytest.mark.parametrize("make", [tensors, Noisy, Stream])
def test_unbatched_mode(make: Callable[[], Any]) -> None:
    side_by_side(make, batch_size=None)


@pytest.mark.parametrize(("kind", "kwargs"), [
    ("tensors", {"batch_size": 4, "drop_last": True}),
    ("tensors", {"batch_sampler": BatchSampler(RandomSampler(range(N)), 5, False)}),
    ("tensors", {"sampler": [3, 1, 4, 1, 5], "batch_size": 2}),
    ("python", {"batch_size": 4, "in_order": False}),
    ("python", {"batch_size": 3, "num_workers": 2, "prefetch_factor": 1}),
])
def test_batching_arguments(kind: str, kwargs: dict) -> None:
    side_by_side(tensors if kind == "tensors" else Noisy, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"batch_size": 0}, {"num_workers": -1}, {"timeout": -1},
    {"prefetch_factor": 2}, {"num_workers": 1, "prefetch_factor": -1}, {"persistent_workers": True},
    {"shuffle": True, "sampler": [0, 1]}, {"batch_sampler": [[0]], "batch_size": 2},
    {"batch_sampler": [[0]], "drop_last": True}, {"batch_size": None, "drop_last": True},
    {"multiprocessing_context": "spawn"}, {"num_workers": 1, "multiprocessing_context": "nonsense"},
])
def test_invalid_arguments_raise_dataloaders_error(kwargs: dict) -> None:
    with pytest.raises(Exception) as ref:
        DataLoader(tensors(), **kwargs)
    with pytest.raises(type(ref.value)) as ours:
        fastddp.PrefetchLoader(tensors(), **kwargs)
    assert str(ours.value) == f"PrefetchLoader: {ref.value}"


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}])
def test_iterable_dataset_refuses_orders(kwargs: dict) -> None:
    with pytest.raises(ValueError) as ref:
        DataLoader(Stream(), **kwargs)
    with pytest.raises(ValueError) as ours:
        fastddp.PrefetchLoader(Stream(), **kwargs)
    assert str(ours.value) == f"PrefetchLoader: {ref.value}"


def test_timeout_without_workers_fails_at_iter_as_dataloader() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=2, timeout=5)
        with pytest.raises(AssertionError, match="requires timeout == 0"):
            iter(loader)


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_locked_attributes(attr: str) -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=2)
        with pytest.raises(ValueError, match=f"{attr} attribute should not be set after {cls.__name__} is initialized"):
            setattr(loader, attr, getattr(loader, attr))


def test_settable_attributes_take_effect() -> None:
    def run(cls: type) -> list:
        loader = cls(Noisy(), batch_size=4, num_workers=2)
        loader.collate_fn = lambda s: [x["i"] for x in s]
        loader.num_workers = 0
        return outcomes(loader)

    torch.manual_seed(0)
    ref = run(DataLoader)
    torch.manual_seed(0)
    same(ref, run(fastddp.PrefetchLoader))


def test_public_attributes_are_dataloaders() -> None:
    for kwargs in ({"batch_size": 3}, {"batch_size": None}, {"shuffle": True, "batch_size": 2},
                   {"num_workers": 2, "batch_size": 2}):
        ref, ours = DataLoader(tensors(), **kwargs), fastddp.PrefetchLoader(tensors(), **kwargs)
        for name in ("batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory", "timeout",
                     "worker_init_fn", "in_order", "persistent_workers", "generator", "pin_memory_device"):
            assert getattr(ref, name) == getattr(ours, name), name
        for name in ("sampler", "batch_sampler", "collate_fn"):
            assert type(getattr(ref, name)) is type(getattr(ours, name)), name


# ---------------------------------------------------------------------------- errors at a batch
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_exception_at_its_batch_then_the_next_batches(workers: int) -> None:
    side_by_side(lambda: Noisy(fail_at=13), batch_size=5, num_workers=workers, passes=1)


def test_stream_exception_ends_the_pass_as_dataloader() -> None:
    side_by_side(lambda: Stream(fail_at=9), batch_size=4, passes=2)


@pytest.mark.parametrize("sampler", [
    [0.0, 1.5, 2.0, 3.0],          # a float index: IndexError at its batch
    [0, 1, -1, 2, -N, 5],          # negative indices count from the end
    [0, 1, N + 4, 2, 3, -N - 1, 4],  # out of range either way: IndexError at its batch
    [0, True, 2, 3],               # a bool index is what indexing a tensor makes of it
])
def test_sampler_indices_as_dataloader(sampler: list) -> None:
    side_by_side(tensors, batch_size=2, sampler=sampler, passes=1)


def test_batch_sampler_outputs_as_dataloader() -> None:
    side_by_side(tensors, batch_sampler=[[0, 1], [], [2.5], [3, -1], [N]], passes=1)


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
def test_errors_while_a_pass_starts(make: Callable[[], Any], kwargs: dict) -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        with pytest.raises(RuntimeError, match="Error in"):
            list(cls(make(), **kwargs))


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


def test_private_collation_view() -> None:
    for kwargs in ({"batch_size": 2}, {"batch_size": None}):
        ref, ours = DataLoader(tensors(), **kwargs), fastddp.PrefetchLoader(tensors(), **kwargs)
        assert ref._auto_collation == ours._auto_collation
        assert type(ref._index_sampler) is type(ours._index_sampler)


def test_too_many_workers_warns_as_dataloader() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader running slow"):
            cls(tensors(), batch_size=2, num_workers=1000)


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
