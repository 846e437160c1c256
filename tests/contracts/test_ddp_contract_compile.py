"""Contract: ``torch.compile`` with DDPWrapper, side by side with torch DDP in the same two gloo
ranks, in both orders a script writes it: ``DDP(torch.compile(model))`` (nanoGPT's) and
``torch.compile(DDP(model))``.

torch DDP's forward is not traced by Dynamo: only the module under it is compiled, and while it
runs torch's class names it as the active DDP module, so Dynamo's DDPOptimizer splits the
compiled graph at the wrapper's ``bucket_bytes_cap`` and each bucket's gradients are ready
before the whole backward ends. DDPWrapper must compile the same graphs (no warnings, no graph
breaks or recompilations in its own code) and train to the same parameters bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from ..ddp_common import compare_models, nccl_world_one


def _model() -> nn.Module:
    """Eight 1 MiB-ish layers: with a 1 MiB bucket cap the DDPOptimizer makes several graphs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.ReLU(), *[nn.Linear(512, 512) for _ in range(3)],
                         nn.Linear(512, 4))


def _counting_backend(graph_sizes: list[int]) -> Any:
    """aot_eager, recording the node count of every graph it is given."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graph_sizes.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    return backend


def _train(cls: type, order: str, kwargs: dict[str, Any], rank: int,
           device: str) -> tuple[nn.Module, list[int], list[str]]:
    import torch._dynamo

    torch._dynamo.reset()  # each contender compiles from scratch
    graph_sizes: list[int] = []
    backend = _counting_backend(graph_sizes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "outer":
            wrapper = cls(_model().to(device), bucket_cap_mb=1, **kwargs)
            model = torch.compile(wrapper, backend=backend)
        else:
            wrapper = cls(torch.compile(_model().to(device), backend=backend), bucket_cap_mb=1, **kwargs)
            model = wrapper
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(1 + rank)
        for _ in range(4):
            loss = model(torch.randn(8, 16, device=device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    recompiles = dict(torch._dynamo.utils.counters["recompiles"])
    assert not recompiles, recompiles
    return wrapper, graph_sizes, [f"{w.category.__name__}: {w.message}" for w in caught]


def _compiled_side_by_side(rank: int, world_size: int, order: str, kwargs: dict[str, Any],
                           device: str = "cpu") -> list[int]:
    ours, our_graphs, our_warnings = _train(fastddp.DDPWrapper, order, kwargs, rank, device)
    ref, ref_graphs, ref_warnings = _train(TorchDDP, order, kwargs, rank, device)
    compare_models(ours, ref, rtol=0, atol=0)
    assert our_graphs == ref_graphs, (our_graphs, ref_graphs)
    assert our_warnings == ref_warnings, (our_warnings, ref_warnings)
    return our_graphs


def test_compiled_module_inside_is_split_into_buckets_as_under_torch_ddp(ranks) -> None:
    graphs = ranks.run(_compiled_side_by_side, args=("inner", {}))[0]
    assert len(graphs) > 2, graphs  # the DDPOptimizer split the module at the bucket cap


def test_compiled_module_inside_with_find_unused_parameters(ranks) -> None:
    ranks.run(_compiled_side_by_side, args=("inner", {"find_unused_parameters": True}))


@pytest.mark.parametrize("kwargs", [{}, {"static_graph": True}], ids=["default", "static_graph"])
def test_compiled_wrapper_compiles_what_torch_ddp_compiles(ranks, kwargs) -> None:
    ranks.run(_compiled_side_by_side, args=("outer", kwargs))


@pytest.mark.cuda
@pytest.mark.parametrize("passthrough", ["1", "0"], ids=["passthrough", "buckets"])
@pytest.mark.parametrize("order", ["inner", "outer"])
def test_compiled_on_nccl_world_one_as_under_torch_ddp(monkeypatch, order: str, passthrough: str) -> None:
    """On a GPU (NCCL, world 1): the same graphs as under torch DDP and the same parameters, with
    the gradients passed through and through the buckets (FASTDDP_WORLD1_PASSTHROUGH=0)."""
    monkeypatch.setenv("FASTDDP_WORLD1_PASSTHROUGH", passthrough)
    with nccl_world_one():
        graphs = _compiled_side_by_side(0, 1, order, {}, device="cuda")
    assert order == "outer" or len(graphs) > 2, graphs


def _python_reducer_mode(rank: int, world_size: int) -> str:
    import torch._dynamo

    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        with pytest.raises(NotImplementedError) as refused:
            fastddp.DDPWrapper(_model())
    finally:
        torch._dynamo.config.optimize_ddp = previous
    fastddp.DDPWrapper(_model())  # the default mode builds
    return str(refused.value)


def test_compiled_autograd_python_reducer_mode_is_refused_naming_the_setting(ranks) -> None:
    message = ranks.run(_python_reducer_mode)[0]
    assert "optimize_ddp='python_reducer'" in message and "'ddp_optimizer'" in message, message
