"""Datasets and the side-by-side harness of the PrefetchLoader contract tests: run a loader and
DataLoader on the same arguments and compare what each pass yields and raises."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
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


def refusals_at_iter(make_loader: Callable[[type], Any], error: type[BaseException],
                     call: Callable[[Any], Any] = iter) -> list[str]:
    """``call(loader)`` (``iter`` by default) for a DataLoader and a PrefetchLoader made by
    ``make_loader(cls)`` from the same global seed: both raise ``error`` and leave the global
    generator in the same state (DataLoader's draws before the failure included). Returns the
    two messages, DataLoader's first."""
    messages, states = [], []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(1234)
        loader = make_loader(cls)
        try:
            call(loader)
        except error as exc:
            messages.append(str(exc))
        else:
            raise AssertionError(f"{cls.__name__}: {call.__name__} did not raise {error.__name__}")
        states.append(torch.random.get_rng_state())
    assert torch.equal(states[0], states[1]), "the global generator differs after the refusal"
    return messages
