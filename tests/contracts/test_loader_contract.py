"""PrefetchLoader against torch.utils.data.DataLoader with the same arguments, side by side in
one process: the batches (values, types, nesting), the exceptions (type and message, at the same
batch, and what the next next() gives), len(), attribute locks and the global and given
generators' states must be the same."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    TensorDataset,
)

import fastddp
from tests.contracts.loader_harness import (
    N,
    Noisy,
    Stream,
    WorkerView,
    outcomes,
    refusals_at_iter,
    same,
    side_by_side,
    tensors,
)


# ---------------------------------------------------------------------------- random state
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [None, False, True])
@pytest.mark.parametrize("kind", ["tensors", "python"])
def test_global_generator_draws_match(kind: str, shuffle: bool | None, workers: int) -> None:
    make = tensors if kind == "tensors" else Noisy
    side_by_side(make, batch_size=5, shuffle=shuffle, num_workers=workers, between=lambda: torch.rand(3))


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_kept_across_passes_hold_dataloaders_values(workers: int) -> None:
    """A script that keeps batches (no copy) over several passes: the native gather reuses its
    ring from one pass to the next, and what was kept must still be what DataLoader gave."""
    kept, states = {}, {}
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(1234)
        loader = cls(tensors(), batch_size=8, shuffle=True, num_workers=workers)
        kept[cls] = [batch for _ in range(3) for batch in loader]
        states[cls] = torch.random.get_rng_state()
    assert len(kept[DataLoader]) == len(kept[fastddp.PrefetchLoader])
    for ref, ours in zip(kept[DataLoader], kept[fastddp.PrefetchLoader]):
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    assert torch.equal(states[DataLoader], states[fastddp.PrefetchLoader])


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


class EagerBatchSampler:
    """A batch sampler whose __iter__ is a plain method: it draws its order from the global
    generator when asked for an iterator, and counts how often it is asked."""

    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self):
        self.calls += 1
        order = torch.randperm(N).tolist()
        return iter([order[i:i + 5] for i in range(0, N, 5)])

    def __len__(self) -> int:
        return -(-N // 5)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_batch_sampler_asked_for_iterators_as_by_dataloader(workers: int, persistent: bool) -> None:
    """DataLoader's worker iterator asks the batch sampler for an iterator, draws its base seed,
    then asks again as it resets itself (a persistent one only asks again at later passes): an
    order drawn in __iter__ is the second draw's, and the sampler sees as many calls."""
    got = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(11)
        sampler = EagerBatchSampler()
        loader = cls(tensors(), batch_sampler=sampler, num_workers=workers, persistent_workers=persistent)
        passes = [[y.tolist() for _, y in loader] for _ in range(2)]
        got.append((passes, sampler.calls, torch.random.get_rng_state()))
    (a, calls_a, state_a), (b, calls_b, state_b) = got
    assert a == b and calls_a == calls_b
    assert torch.equal(state_a, state_b)


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


def test_worker_init_fn_without_workers_is_never_called_and_keeps_the_native_gather() -> None:
    """DataLoader calls worker_init_fn only in worker processes; Lightning's
    seed_everything(workers=True) sets one on every loader. Without workers the batches and the
    RNG are DataLoader's, and the tensors are still gathered by fastddp's threads."""
    called = []
    side_by_side(tensors, batch_size=3, shuffle=True, worker_init_fn=called.append)
    assert not called
    assert fastddp.PrefetchLoader(tensors(), batch_size=3, worker_init_fn=called.append).transfer == "host"
    assert fastddp.PrefetchLoader(Noisy(), batch_size=3, worker_init_fn=called.append).transfer == "generic"


def test_rebuilt_from_its_attributes_keeps_its_own_options() -> None:
    """Lightning injects a DistributedSampler by calling the loader's class again with the
    arguments its public attributes hold: PrefetchLoader's own options are among them."""
    loader = fastddp.PrefetchLoader(tensors(), batch_size=3, device_resident=True, resident_max_bytes=1 << 20)
    kwargs = {name: value for name, value in vars(loader).items()
              if not name.startswith("_") and name in inspect.signature(type(loader)).parameters}
    kwargs.pop("batch_sampler")
    kwargs["sampler"] = fastddp.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    rebuilt = type(loader)(**kwargs)
    assert (rebuilt.transfer, rebuilt.resident_max_bytes) == ("resident", 1 << 20)
    reference = DataLoader(tensors(), batch_size=3, sampler=kwargs["sampler"])
    assert [b[1].tolist() for b in rebuilt] == [b[1].tolist() for b in reference]


def test_seed_with_a_sampler_names_the_sampler() -> None:
    sampler = fastddp.DistributedSampler(tensors(), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"seed=0 orders shuffle=True .* but got sampler=DistributedSampler"):
        fastddp.PrefetchLoader(tensors(), batch_size=3, shuffle=False, sampler=sampler, seed=0)


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
    ("tensors", {"batch_size": 4, "num_workers": np.int64(0)}),  # numpy integers, as DataLoader
    ("tensors", {"batch_size": 4, "num_workers": np.int64(2), "prefetch_factor": np.int64(1)}),
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


# torch's iterator, deleted half-made after its assertion, reports a missing attribute from
# its __del__ (its own bug, not a difference to compare).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("dataset", [tensors, Noisy], ids=["tensors", "python"])
@pytest.mark.parametrize(("value", "error"), [(-1, AssertionError), (1.5, TypeError), (2.0, TypeError),
                                              (None, TypeError)])
def test_num_workers_assigned_later_fails_at_iter_as_dataloader(value, error, dataset) -> None:
    """DataLoader checks num_workers only at construction; assigned later, its worker iterator
    draws the pass's seed, then fails (an assertion for a negative count, a comparison
    otherwise); ours fails with the same type after the same draw, naming the attribute (a
    Python data set too, whose pass runs on a DataLoader made with the assigned values)."""
    def make(cls: type) -> Any:
        loader = cls(dataset(), batch_size=2, shuffle=True)
        loader.num_workers = value
        return loader

    _, ours = refusals_at_iter(make, error)
    assert f"num_workers={value} assigned" in ours or f"got {value} " in ours, ours


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("dataset", [tensors, Noisy], ids=["tensors", "python"])
@pytest.mark.parametrize("how", ["workers assigned later", "prefetch_factor None assigned"])
def test_workers_without_a_prefetch_factor_fail_at_iter_as_dataloader(how: str, dataset) -> None:
    """Workers with prefetch_factor None (a loader made without workers keeps None; or None
    assigned): DataLoader's worker iterator draws the pass's seed, then fails comparing None;
    ours raises the same TypeError after the same draw, with the fix."""
    def make(cls: type) -> Any:
        if how == "workers assigned later":
            loader = cls(dataset(), batch_size=2, shuffle=True)
            loader.num_workers = 2
        else:
            loader = cls(dataset(), batch_size=2, shuffle=True, num_workers=1)
            loader.prefetch_factor = None
        return loader

    messages = refusals_at_iter(make, TypeError)
    assert messages[1].startswith(messages[0]) and "loader.prefetch_factor = 2" in messages[1], messages


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("attr", "value"), [("collate_fn", None), ("generator", 5), ("timeout", -1)])
def test_attribute_assigned_later_fails_as_dataloader(attr: str, value: Any, workers: int) -> None:
    """DataLoader checks these at construction only. Assigned later: ``collate_fn = None`` is
    called for every batch (a TypeError at each next()), a generator that is not one fails the
    base-seed draw of iter(), a negative timeout fails iter()'s assertion after that draw (with
    workers it is no timeout)."""
    seen = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(5)
        loader = cls(tensors(), batch_size=4, shuffle=True, num_workers=workers)
        setattr(loader, attr, value)
        try:
            got: Any = outcomes(loader)
        except Exception as exc:
            got = (type(exc), str(exc).split("\n")[0])
        seen.append((got, torch.random.get_rng_state()))
    (ref, ref_state), (ours, our_state) = seen
    if isinstance(ref, tuple):
        assert ours == ref
    else:
        same(ref, ours)
    assert torch.equal(ref_state, our_state), "the global generator differs"


def test_num_workers_zero_float_is_single_process_as_dataloader() -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=4)
        loader.num_workers = 0.0
        assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in DataLoader(tensors(), batch_size=4)]


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_locked_attributes(attr: str) -> None:
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=2)
        with pytest.raises(ValueError, match=f"{attr} attribute should not be set after {cls.__name__} is initialized"):
            setattr(loader, attr, getattr(loader, attr))


class _Repeating:
    """Yields its batch sampler's passes one after another, without end."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches

    def __iter__(self):
        while True:
            yield from iter(self.batches)


def _epochs_loader(base: type) -> type:
    """A loader subclass that keeps one iterator over every epoch, by replacing its batch
    sampler after construction through DataLoader's own lock flag (as timm's
    MultiEpochsDataLoader does)."""

    class EpochsLoader(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._DataLoader__initialized = False
            self.batch_sampler = _Repeating(self.batch_sampler)
            self._DataLoader__initialized = True
            self.iterator = super().__iter__()

        def __len__(self) -> int:
            return len(self.batch_sampler.batches)

        def __iter__(self):
            for _ in range(len(self)):
                yield next(self.iterator)

    return EpochsLoader


def test_lock_flag_of_dataloader_unlocks_as_for_dataloader() -> None:
    """DataLoader's lock on its attributes is its ``_DataLoader__initialized`` flag; subclasses
    written for DataLoader clear it to replace the batch sampler: PrefetchLoader honours it."""
    seen = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(0)
        loader = _epochs_loader(cls)(tensors(), batch_size=3, shuffle=True)
        seen.append([[batch[1].tolist() for batch in loader] for _ in range(3)])
        seen[-1].append(torch.random.get_rng_state())
        with pytest.raises(ValueError, match="batch_sampler attribute should not be set after EpochsLoader"):
            loader.batch_sampler = None
    assert seen[0][:3] == seen[1][:3] and len(seen[0][0]) == -(-len(tensors()) // 3)
    assert torch.equal(seen[0][3], seen[1][3])


def test_is_a_dataloader_to_code_that_asks() -> None:
    """Lightning skips its iter() probe of a DataLoader (which draws a base seed from the global
    generator) and injects its DistributedSampler only into one: PrefetchLoader is a DataLoader
    subclass. The DataLoader method it does not define only reads the attributes both set (the
    worker-count check); its __setattr__ adds its own read-only attributes to DataLoader's lock,
    which it calls; its _get_iterator, which code built on DataLoader calls for a new iterator,
    gives PrefetchLoader's iterator."""
    loader = fastddp.PrefetchLoader(tensors(), batch_size=3)
    assert isinstance(loader, DataLoader)
    inherited = {name for name, value in vars(DataLoader).items()
                 if inspect.isfunction(value) and name not in vars(fastddp.PrefetchLoader)}
    assert inherited == {"check_worker_number_rationality"}, inherited
    seen = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(0)
        it = cls(tensors(), batch_size=3, shuffle=True)._get_iterator()
        seen.append(([b[1].tolist() for b in it], torch.random.get_rng_state()))
    assert seen[0][0] == seen[1][0] and torch.equal(seen[0][1], seen[1][1])


@pytest.mark.parametrize("attr, value, fix", [("device", "cpu", "build a new PrefetchLoader"),
                                              ("epoch", 3, r"set_epoch\(epoch\)"),
                                              ("transfer", "host", "cannot be assigned")])
def test_own_attributes_are_refused_by_name(attr: str, value: Any, fix: str) -> None:
    # DataLoader has no such attribute, so a script may assign one as its own: PrefetchLoader's
    # mean something, and the assignment is refused naming it, before any pass reads it
    loader = fastddp.PrefetchLoader(TensorDataset(torch.arange(6.0)), batch_size=4)
    with pytest.raises(AttributeError, match=f"^PrefetchLoader.{attr} .*{fix}"):
        setattr(loader, attr, value)
    assert [b.tolist() for (b,) in loader] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]


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
                   {"num_workers": 2, "batch_size": 2},
                   {"num_workers": np.int64(2), "prefetch_factor": np.int32(3), "batch_size": 2}):
        ref, ours = DataLoader(tensors(), **kwargs), fastddp.PrefetchLoader(tensors(), **kwargs)
        for name in ("batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory", "timeout",
                     "worker_init_fn", "in_order", "persistent_workers", "generator", "pin_memory_device"):
            assert getattr(ref, name) == getattr(ours, name), name
            assert type(getattr(ref, name)) is type(getattr(ours, name)), name  # kept as given
        for name in ("sampler", "batch_sampler", "collate_fn"):
            assert type(getattr(ref, name)) is type(getattr(ours, name)), name
    warned = []
    for cls in (DataLoader, fastddp.PrefetchLoader):  # more workers than CPUs: DataLoader's warning
        loader = cls(tensors(), batch_size=2, num_workers=4096)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.check_worker_number_rationality()
        warned.append([str(w.message) for w in caught])
    assert len(warned[0]) == 1 and warned[0] == warned[1]


@pytest.mark.parametrize(("workers", "value"), [(0, "spawn"), (0, None), (2, "bogus"), (2, 3), (2, "spawn"), (2, None)])
def test_multiprocessing_context_assigned_after_construction(workers: int, value: Any) -> None:
    # DataLoader's property checks the value against num_workers and turns a name into a context
    seen = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(tensors(), batch_size=4, num_workers=workers)
        try:
            loader.multiprocessing_context = value
            seen.append(("ok", type(loader.multiprocessing_context)))
        except (ValueError, TypeError) as exc:
            seen.append((type(exc), str(exc)))
    assert seen[0] == seen[1]


def test_generic_as_dataloader() -> None:
    """DataLoader is ``Generic[T_co]``: a script's ``DataLoader[list[Tensor]]`` annotation (run
    when its function is defined) and a loader built through the alias work after the swap."""
    assert [(t.__name__, t.__covariant__) for t in fastddp.PrefetchLoader.__parameters__] == \
        [(t.__name__, t.__covariant__) for t in DataLoader.__parameters__] == [("_T_co", True)]
    alias = fastddp.PrefetchLoader[list[torch.Tensor]]
    assert alias.__origin__ is fastddp.PrefetchLoader and alias.__args__ == (list[torch.Tensor],)
    data = TensorDataset(torch.arange(6.0))
    found = []
    for loader in (alias(data, batch_size=4, shuffle=True),
                   DataLoader[list[torch.Tensor]](data, batch_size=4, shuffle=True)):
        torch.manual_seed(3)
        found.append(([b[0].tolist() for b in loader], torch.random.get_rng_state()))
    (our_batches, our_rng), (their_batches, their_rng) = found
    assert our_batches == their_batches and torch.equal(our_rng, their_rng)
    assert alias(data).__orig_class__ == alias
