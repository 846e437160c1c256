"""What code written for torch DDP does with the wrapper besides training: to_kwargs, the
distributed-checkpoint state of ``ddp.module``, and which forwards sync the buffers, each the
same as torch DDP; one case per test on a pool of gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .ddp_common import conv_bn, make_pair, mlp, rand_vec


def _legacy_methods(rank: int, world_size: int) -> str:
    ours, ref = fastddp.DDPWrapper(mlp()), TorchDDP(mlp())
    x, y = torch.ones(2), torch.zeros(3)
    mine, theirs = ours.to_kwargs((x, [y]), {"k": y}, 0), ref.to_kwargs((x, [y]), {"k": y}, 0)
    assert repr(mine) == repr(theirs), (mine, theirs)  # same structure, types and values
    return "ok"


def test_to_kwargs_like_torch_ddp(ranks) -> None:
    assert ranks.run(_legacy_methods, world_size=1) == ["ok"]


def _dcp_state(rank: int, world_size: int) -> str:
    """torch.distributed.checkpoint's get_state_dict strips torch DDP's ``module.`` prefix by
    type; given ``ddp.module`` it yields, for DDPWrapper, exactly what torch DDP gets."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ours, ref = make_pair(mlp, {})
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = rand_vec(g)
        for m, o in ((ours, opt_a), (ref, opt_b)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    mine, theirs = get_state_dict(ours.module, opt_a), get_state_dict(ref, opt_b)
    assert list(mine[0]) == list(theirs[0]) and list(mine[1]["state"]) == list(theirs[1]["state"])
    for k in mine[0]:
        torch.testing.assert_close(mine[0][k], theirs[0][k])
    for k in mine[1]["state"]:
        torch.testing.assert_close(mine[1]["state"][k], theirs[1]["state"][k])
    # and a torch DDP state loads into the DDPWrapper's module
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    set_state_dict(ours.module, opt_a, model_state_dict=theirs[0], optim_state_dict=theirs[1])
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    return "ok"


def test_distributed_checkpoint_state_via_module(ranks) -> None:
    assert ranks.run(_dcp_state, world_size=2) == ["ok", "ok"]


def _buffer_sync_rule(rank: int, world_size: int, transport: str) -> list[str]:
    """Which forwards sync the buffers follows torch DDP's rule: only a forward whose
    predecessor was a reducing one (grad enabled, outside no_sync) — so evaluation forwards
    after the first, the first training forward after them and no_sync micro-steps after the
    first use each rank's own BatchNorm statistics, exactly as under torch DDP."""
    from .ddp_common import compare_models

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = make_pair(conv_bn, {})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data: its own statistics
    seen = []

    def forward(kind: str) -> None:
        x = torch.randn(4, 3, 6, 6, generator=g)
        expect = ours.will_sync_module_buffers()
        assert expect == ref.will_sync_module_buffers(), kind
        outs = []
        for m, o in zip((ours, ref), opts):
            if kind == "train":
                o.zero_grad()
                out = m(x)
                out.pow(2).mean().backward()
                o.step()
            elif kind == "no_sync":
                with m.no_sync():
                    out = m(x)
                    out.pow(2).mean().backward()
            else:
                with torch.inference_mode() if kind == "inference" else torch.no_grad():
                    out = m(x)
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], msg=lambda m: f"{kind}: {m}")
        compare_models(ours, ref, grads=False)
        seen.append(f"{kind}{'+sync' if expect else ''}")

    for kind in ("train", "train", "no_grad", "no_grad", "inference", "train", "train",
                 "no_sync", "no_sync", "no_sync", "train", "train"):
        forward(kind)
    ours.eval()
    ref.eval()
    forward("no_grad")
    forward("no_grad")
    return seen


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_buffers_are_synced_when_torch_ddp_syncs_them(ranks, transport: str) -> None:
    assert ranks.run(_buffer_sync_rule, world_size=2, args=(transport,)) == [[
        "train+sync", "train+sync", "no_grad+sync", "no_grad", "inference", "train", "train+sync",
        "no_sync+sync", "no_sync", "no_sync", "train", "train+sync", "no_grad+sync", "no_grad"]] * 2


_UNUSED_HINT_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
import fastddp
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
wrap = TorchDDP if sys.argv[2] == "torch" else fastddp.DDPWrapper


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


torch.manual_seed(0)
for use_b in (False, True):  # one parameter unused, then all used (the hint is once a process)
    model = wrap(TwoHeads(), find_unused_parameters=True)
    for _ in range(3):
        model(torch.randn(2, 4), use_b).sum().backward()
    print("all_used" if use_b else "one_unused", "DONE", file=sys.stderr, flush=True)
"""


def test_find_unused_parameters_hint_on_stderr_like_torch_ddp(tmp_path) -> None:
    """find_unused_parameters=True on a forward that used every parameter: torch DDP prints a
    hint once on stderr (C++, not a Python warning); so does DDPWrapper, in torch's words. With a
    parameter unused, neither prints it. One process per wrapper: first the unused case, then
    the used one."""
    def stderr_of(which: str) -> str:
        out = subprocess.run([sys.executable, "-c", _UNUSED_HINT_SCRIPT, str(tmp_path / f"init_{which}"), which],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error"})
        assert out.returncode == 0 and "all_used DONE" in out.stderr, out.stderr
        return out.stderr

    def hints(stderr: str) -> list[list[str]]:  # per case, the message without c10's prefix
        cases, current = [], []
        for line in stderr.splitlines():
            if line.endswith(" DONE"):
                cases.append(current)
                current = []
            elif "] Warning: " in line:
                current.append(line.split("] Warning: ", 1)[1])
        return cases

    torch_hints, our_hints = hints(stderr_of("torch")), hints(stderr_of("ours"))
    assert [len(h) for h in torch_hints] == [0, 1], torch_hints
    assert our_hints == torch_hints  # torch's words: logs are searched for them


_TEARDOWN_SCRIPT = """
import gc, os, sys, torch, torch.distributed as dist
import fastddp
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = fastddp.DDPWrapper(torch.nn.Linear(4, 4))
opt = torch.optim.AdamW(model.parameters())  # the first optimizer imports torch._dynamo
model(torch.randn(2, 4)).sum().backward()
opt.step()
fastddp.diag.stop()  # the stall watchdog holds the group until exit
del model, opt
dist.destroy_process_group()
gc.collect()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sum(n.startswith("pt_gloo") or n.startswith("gloo") for n in names))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_destroy_process_group_ends_the_gloo_threads_in_a_script_that_imports_fastddp(tmp_path) -> None:
    """torch.distributed.nn.functional binds the default group as its collectives' default
    argument when first imported (the first optimizer does, through torch._dynamo). Imported
    after init_process_group it keeps the group, and gloo's threads, alive past
    destroy_process_group(): a gloo thread still freeing a collective's tensors when the
    interpreter finalizes aborts the process ("terminate called without an active exception").
    fastddp imports it first, so the group ends with destroy_process_group()."""
    out = subprocess.run([sys.executable, "-c", _TEARDOWN_SCRIPT, str(tmp_path / "init")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", out.stdout + out.stderr
