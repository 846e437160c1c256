"""Contract: sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) on DDPWrapper
as on torch.nn.parallel.DistributedDataParallel, side by side in the same gloo ranks: the
reduced ``.grad`` (layout, coalesced or not, indices and values, bit for bit) after every
backward and the parameters after every optimizer step. Where DDPWrapper refuses what torch
accepts, the test says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .test_ddp_contract import build_pair, outcome


class BagThenLinear(nn.Module):
    """A sparse EmbeddingBag and Embedding feeding two dense heads (``use_side=False``: the
    side head is unused; ``use_sparse=False``: both sparse layers are)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode="sum", sparse=True)
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 3)
        self.side = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, use_side: bool = True, use_sparse: bool = True) -> torch.Tensor:
        h = self.bag(ids) + self.emb(ids).mean(1) if use_sparse else torch.ones(ids.shape[0], 6)
        return self.head(h) + self.side(h) if use_side else self.head(h)


def sparse_only() -> nn.Module:
    """torch's own sparse DDP test model: an EmbeddingBag and nothing dense."""
    return nn.Sequential(nn.EmbeddingBag(20, 5, mode="sum", sparse=True), nn.Softmax(dim=1))


def grad_differences(ours: nn.Module, ref: nn.Module) -> list[str]:
    """Gradients that differ from torch DDP's in layout, coalescing, indices or values."""
    bad = []
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        a, b = p.grad, q.grad
        if (a is None) != (b is None):
            bad.append(f"{name}: grad presence")
        elif a is not None and a.layout != b.layout:
            bad.append(f"{name}: layout {a.layout} vs {b.layout}")
        elif a is not None and a.is_sparse:
            if a.is_coalesced() != b.is_coalesced():
                bad.append(f"{name}: coalesced {a.is_coalesced()} vs {b.is_coalesced()}")
            elif not (torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values())):
                bad.append(f"{name}: indices or values")
        elif a is not None and not torch.equal(a, b):
            bad.append(f"{name}: values")
    return bad


def train_sparse(ours: nn.Module, ref: nn.Module, rank: int, steps: int = 4, accumulate: bool = False,
                 side_on: int = -1, sparse_off_on: int = -1) -> list[str]:
    """SGD (plain: sparse gradients) steps with rank-dependent ids; every difference by step.
    ``accumulate``: every other step under no_sync(); ``side_on``: the rank whose forward leaves
    the side head unused (unused parameters differ between ranks); ``sparse_off_on``: the rank
    whose reducing forwards leave the sparse layers unused (what no_sync() accumulated is
    reduced)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, ref)]
    g = torch.Generator().manual_seed(10 + rank)
    found = []
    for step in range(steps):
        ids = torch.randint(0, 20, (4, 3), generator=g)
        quiet = accumulate and step % 2 == 0
        kwargs = {"use_side": False} if rank == side_on else {}
        if rank == sparse_off_on and not quiet:
            kwargs["use_sparse"] = False
        for model in (ours, ref):
            if quiet:
                with model.no_sync():
                    model(ids, **kwargs).pow(2).sum().backward()
            else:
                model(ids, **kwargs).pow(2).sum().backward()
        if quiet:
            continue
        found += [f"step {step}: {d}" for d in grad_differences(ours, ref)]
        for opt in opts:
            opt.step()
            opt.zero_grad()
        found += [f"step {step}: parameter {n}" for (n, p), q in zip(ours.module.named_parameters(),
                                                                     ref.module.parameters()) if not torch.equal(p, q)]
    return found


def _sparse_training(rank: int, world_size: int, factory: str, options: dict[str, Any], accumulate: bool,
                     side_on: int, sparse_off_on: int = -1) -> list[str]:
    make = {"bag then linear": BagThenLinear, "sparse only": sparse_only}[factory]
    ours, ref = build_pair(make, None, rank, **options)
    return train_sparse(ours, ref, rank, accumulate=accumulate, side_on=side_on, sparse_off_on=sparse_off_on)


CASES = {
    # name: (world size, model, options, no_sync accumulation, rank leaving the side head unused[,
    #        rank leaving the sparse layers unused in reducing steps])
    "embedding and bag with a dense head": (2, "bag then linear", {}, False, -1),
    "no_sync accumulation (uncoalesced local sums)": (2, "bag then linear", {}, True, -1),
    "find_unused_parameters, side head unused on rank 1": (
        2, "bag then linear", {"find_unused_parameters": True}, True, 1),
    "find_unused_parameters, sparse layers unused on rank 1 after no_sync": (
        2, "bag then linear", {"find_unused_parameters": True}, True, -1, 1),
    "sparse parameters only": (2, "sparse only", {}, False, -1),
    "world of one": (1, "bag then linear", {}, True, -1),
    "gradient_as_bucket_view=False": (2, "bag then linear", {"gradient_as_bucket_view": False}, False, -1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_gradients_match_torch(ranks, case: str) -> None:
    """Reduced sparse gradients and the parameters after SGD are torch DDP's, bit for bit."""
    world_size, *args = CASES[case]
    results = ranks.run(_sparse_training, world_size=world_size, args=tuple(args))
    assert results == [[]] * world_size


def _with_allreduce_hook(rank: int, world_size: int) -> list[str]:
    ours, ref = build_pair(BagThenLinear, None, rank)
    for model in (ours, ref):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return train_sparse(ours, ref, rank)


def test_sparse_gradients_with_allreduce_hook(ranks) -> None:
    """torch's allreduce_hook divides a sparse bucket itself: the same result."""
    assert ranks.run(_with_allreduce_hook, world_size=2) == [[], []]


def _unused_sparse(rank: int, world_size: int) -> dict[str, str]:
    class SkipsBag(BagThenLinear):
        def forward(self, ids: torch.Tensor, use_side: bool = True) -> torch.Tensor:
            return self.head(torch.ones(ids.shape[0], 6))  # neither sparse layer is used

    def step(model: nn.Module) -> None:
        model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()

    ours, ref = build_pair(SkipsBag, None, rank, find_unused_parameters=True)
    return {"ours": outcome(lambda: step(ours)), "torch": outcome(lambda: step(ref))}


def test_unused_sparse_parameter_raises(ranks) -> None:
    """find_unused_parameters=True and a sparse parameter the forward does not use and that
    has no gradient: both raise RuntimeError in backward (torch: 'Expected sparse gradient to
    be defined'; DDPWrapper names the parameter). One rank: a peer would wait for the
    reduction."""
    assert ranks.run(_unused_sparse, world_size=1) == [{"ours": "RuntimeError", "torch": "RuntimeError"}]


def _refusals(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    def both(make: Any) -> tuple[str, str]:
        ours_outcome = outcome(lambda: make(fastddp.DDPWrapper))
        return ours_outcome, outcome(lambda: make(TorchDDP))

    def python_hook(state, bucket):  # unannotated: torch checks annotations
        return default_hooks.allreduce_hook(state, bucket)

    return {
        "static_graph=True": both(lambda cls: cls(BagThenLinear(), static_graph=True)),
        "fp16_compress_hook": both(lambda cls: cls(BagThenLinear()).register_comm_hook(
            None, default_hooks.fp16_compress_hook)),
        "a Python hook": both(lambda cls: cls(BagThenLinear()).register_comm_hook(None, python_hook)),
        "join()": both(lambda cls: cls(BagThenLinear()).join().__enter__()),
    }


def test_unimplemented_combinations_are_refused(ranks) -> None:
    """Accepted by torch DDP with sparse gradients, refused by DDPWrapper with an error naming
    the option (static_graph, a hook that is not allreduce_hook, join())."""
    results = ranks.run(_refusals, world_size=2)
    for got in results:
        assert {k: v[0] for k, v in got.items()} == dict.fromkeys(got, "NotImplementedError"), got
        assert {k: v[1] for k, v in got.items()} == dict.fromkeys(got, "ok"), got


def _refusal_message(rank: int, world_size: int) -> str:
    try:
        fastddp.DDPWrapper(BagThenLinear(), comm_dtype=torch.bfloat16)
    except NotImplementedError as exc:
        return str(exc)
    return "accepted"


def test_refusal_names_option_and_parameter(ranks) -> None:
    """The refusal names the option and the sparse parameter."""
    [message] = ranks.run(_refusal_message, world_size=1)
    assert "comm_dtype=torch.bfloat16" in message and "'bag.weight'" in message, message
