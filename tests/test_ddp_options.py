"""torch DDP's newer constructor options (init_sync, forward_sync_buffers, device_mesh,
bucket_cap_mb_list, batched_grad_copy, ...) on DDPWrapper: the same training as torch DDP
given the same arguments, or one clear error for those the reducer does not implement."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.ddp import assign_buckets

from .ddp_common import conv_bn, make_pair, mlp, rand_vec, train_both

_TORCH_KWARGS = set(inspect.signature(TorchDDP.__init__).parameters)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return out


def _conv_bn_apart() -> tuple[nn.Module, nn.Module]:
    """Two equal conv+BatchNorm models whose BatchNorm statistics differ between ranks."""
    torch.manual_seed(7)
    a, b = conv_bn(), conv_bn()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for m in (a, b):
            for buf in m.buffers():
                if buf.is_floating_point():
                    buf.add_(dist.get_rank() + 1.0)
    return a, b


def _opt_init_sync_false(rank: int, world_size: int) -> None:
    """init_sync=False: nothing is verified or broadcast; ranks keep their own start weights."""
    ours, ref = make_pair(mlp, {"init_sync": False})
    first = _gathered(ours.module[0].weight)
    assert not torch.equal(first[0], first[1])  # make_pair offsets each rank's weights
    train_both(ours, ref, rand_vec)


def _opt_broadcast_buffers_false(rank: int, world_size: int) -> None:
    """broadcast_buffers=False: buffers are neither synced at construction nor per forward."""
    a, b = _conv_bn_apart()
    ours = fastddp.DDPWrapper(a, broadcast_buffers=False)
    ref = TorchDDP(b, broadcast_buffers=False)
    assert not torch.equal(*_gathered(ours.module[1].running_mean)[:2])
    train_both(ours, ref, _image)


def _opt_forward_sync_buffers_false(rank: int, world_size: int) -> None:
    """forward_sync_buffers=False (torch 2.13+): synced once at construction, then rank-local."""
    a, b = _conv_bn_apart()
    ours = fastddp.DDPWrapper(a, forward_sync_buffers=False)
    assert ours.broadcast_buffers is False and ours.forward_sync_buffers is False
    means = _gathered(ours.module[1].running_mean)
    assert torch.equal(means[0], means[1])  # rank 0's statistics everywhere
    if "forward_sync_buffers" in _TORCH_KWARGS:
        ref = TorchDDP(b, forward_sync_buffers=False)
    else:  # an older torch: the same is rank 0's buffers at start and no per-forward sync
        for buf in b.buffers():
            dist.broadcast(buf, src=0)
        ref = TorchDDP(b, broadcast_buffers=False)
    train_both(ours, ref, _image)


def _opt_device_mesh(rank: int, world_size: int) -> None:
    """A 1-D device mesh instead of a process group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    ours, ref = make_pair(mlp, {"device_mesh": mesh})
    assert ours.process_group is mesh.get_group(0) and ours.device_mesh is mesh
    train_both(ours, ref, rand_vec)
    # torch's exception type, with torch's sentence in the message; the attribute exists only
    # when a mesh was given, as in torch DDP
    both = "Cannot specify both process_group and device_mesh arguments."
    for cls in (TorchDDP, fastddp.DDPWrapper):
        with pytest.raises(RuntimeError, match=both):
            cls(mlp(), process_group=dist.group.WORLD, device_mesh=mesh)
    plain, torch_plain = make_pair(mlp, {})
    assert not hasattr(plain, "device_mesh") and not hasattr(torch_plain, "device_mesh")


def _opt_bucket_cap_mb_list(rank: int, world_size: int) -> None:
    """Per-bucket caps (torch 2.14's bucket_cap_mb_list): the buckets follow the list."""
    caps = [0.0005, 0.001]
    kwargs = {"bucket_cap_mb_list": caps} if "bucket_cap_mb_list" in _TORCH_KWARGS else {}
    ours, ref = make_pair(mlp, kwargs, {"bucket_cap_mb_list": caps})
    expected = assign_buckets(list(ours.module.parameters()), max(caps), caps_mb=caps)
    names = dict(enumerate(n for n, _ in ours.module.named_parameters()))
    assert [b["params"] for b in ours.bucket_report()["buckets"]] == [[names[i] for i in b] for b in expected]
    train_both(ours, ref, rand_vec)


def _opt_batched_grad_copy(rank: int, world_size: int) -> None:
    """batched_grad_copy=True: one multi-tensor copy per bucket (also on the CPU)."""
    kwargs = {"batched_grad_copy": True} if "batched_grad_copy" in _TORCH_KWARGS else {}
    ours, ref = make_pair(mlp, {**kwargs, "bucket_cap_mb": 0.001}, {"batched_grad_copy": True})
    assert ours.bucket_report()["batch_copies"] is True
    train_both(ours, ref, rand_vec)


@pytest.mark.parametrize("case", [_opt_init_sync_false, _opt_broadcast_buffers_false,
                                  _opt_forward_sync_buffers_false, _opt_device_mesh, _opt_bucket_cap_mb_list,
                                  _opt_batched_grad_copy], ids=lambda f: f.__name__[len("_opt_"):])
def test_newer_constructor_options_match_torch_ddp(ranks, case) -> None:
    ranks.run(_with_shm, world_size=2, args=(case,))


def _with_shm(rank: int, world_size: int, case) -> None:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    case(rank, world_size)


def _image(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=g)


REFUSED_OPTIONS = {
    "delay_all_reduce_named_params": lambda lin: {"delay_all_reduce_named_params": list(lin.named_parameters()),
                                                  "param_to_hook_all_reduce": lin.weight},
    "mixed_precision": lambda lin: {"mixed_precision": object()},
    "skip_all_reduce_unused_params": lambda lin: {"skip_all_reduce_unused_params": True},
}


def _refused_option(rank: int, world_size: int, name: str) -> None:
    lin = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=name.split("_params")[0]) as info:
        fastddp.DDPWrapper(lin, **REFUSED_OPTIONS[name](lin))
    assert "DDPWrapper" in str(info.value)


@pytest.mark.parametrize("name", list(REFUSED_OPTIONS))
def test_unimplemented_options_are_refused_by_name(ranks, name: str) -> None:
    ranks.run(_refused_option, world_size=1, args=(name,))


def _one_of_a_pair(rank: int, world_size: int) -> None:
    """torch DDP's first check: the two delayed all-reduce options come together."""
    lin = nn.Linear(4, 4)
    for given in ({"delay_all_reduce_named_params": []}, {"param_to_hook_all_reduce": lin.weight}):
        for cls in (TorchDDP, fastddp.DDPWrapper):
            with pytest.raises(ValueError, match=r"^delay_all_reduce_named_params and param_to_hook_all_reduce "
                                                 r"need to be set at the same time\.$"):
                cls(lin, **given)


def test_one_of_the_delayed_all_reduce_pair_is_torchs_value_error(ranks) -> None:
    ranks.run(_one_of_a_pair, world_size=1)


def _refused_2d_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    for cls in (TorchDDP, fastddp.DDPWrapper):  # torch's exception type and sentence
        with pytest.raises(RuntimeError, match="Only 1D device mesh is supported"):
            cls(nn.Linear(4, 4), device_mesh=mesh)


def _refused_bad_caps(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list entry must be >= 0 \(0: one parameter per bucket\)"):
        fastddp.DDPWrapper(nn.Linear(4, 4), bucket_cap_mb_list=[1, -2])


def _refused_lazy(rank: int, world_size: int) -> None:
    lazy = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=r"^Modules with uninitialized parameters can't be used with `DistributedDataParallel`\. "
                       r".*parameter '0\.weight' is not initialised yet.*run one forward pass"):
        fastddp.DDPWrapper(lazy)
    lazy(torch.randn(2, 3))  # initialised: now it wraps
    fastddp.DDPWrapper(lazy)


def _refused_meta(rank: int, world_size: int) -> None:
    """A module built on the meta device: torch DDP raises RuntimeError at construction (its
    cross-rank check reads the meta tensors); DDPWrapper too, naming the parameter and the fix."""
    for cls in (TorchDDP, fastddp.DDPWrapper):
        with pytest.raises(RuntimeError):
            cls(nn.Linear(4, 2, device="meta"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, device="meta"))
    with pytest.raises(RuntimeError, match=r"parameter '1\.weight' is on the meta device \(2 of 4.*to_empty"):
        fastddp.DDPWrapper(model)
    model.to_empty(device="cpu")  # materialised: now it wraps and trains
    fastddp.DDPWrapper(model)(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize("case", [_refused_2d_mesh, _refused_bad_caps, _refused_lazy, _refused_meta],
                         ids=lambda f: f.__name__[len("_refused_"):])
def test_invalid_arguments_are_refused_clearly(ranks, case) -> None:
    ranks.run(case, world_size=1)


def test_per_bucket_caps() -> None:
    params = [torch.zeros(2**18) for _ in range(6)]  # 1 MiB each (fp32)
    # bucket k closes once it reaches caps[k] MiB, the last cap repeats; at construction the
    # parameters are taken in registration order and the buckets listed in reverse
    assert assign_buckets(params, 3, caps_mb=[1, 3]) == [[4, 5], [1, 2, 3], [0]]
    assert assign_buckets(params, 3, caps_mb=[1, 3], order=[5, 4, 3, 2, 1, 0]) == [[5], [4, 3, 2], [1, 0]]
    assert assign_buckets(params, 2, caps_mb=[2]) == [[4, 5], [2, 3], [0, 1]]
    # per (device, dtype): each dtype's first bucket takes the first cap
    mixed = [torch.zeros(2**18), torch.zeros(2**19, dtype=torch.bfloat16), torch.zeros(2**18)]
    assert assign_buckets(mixed, 2, caps_mb=[1, 2]) == [[2], [1], [0]]


def _trained_conv_pair():
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(conv_bn, {})
    train_both(ours, ref, _image, steps=2)
    return ours, ref


def _copy_deepcopy(rank: int, world_size: int) -> None:
    """deepcopy (e.g. an EMA model of the wrapped model): the copy is a working wrapper, trained
    step for step like torch DDP's own deepcopy; the original keeps working."""
    import copy

    ours, ref = _trained_conv_pair()
    ours_c, ref_c = copy.deepcopy(ours), copy.deepcopy(ref)
    assert isinstance(ours_c, fastddp.DDPWrapper) and ours_c.module is not ours.module
    assert ours.transport == "shm" and ours_c.transport == "c10d"  # no set-up collective for a copy
    train_both(ours_c, ref_c, _image, steps=2)
    train_both(ours, ref, _image, steps=1)


def _copy_pickle(rank: int, world_size: int) -> None:
    """torch.save(model) / torch.load(weights_only=False): a working wrapper, as torch DDP's."""
    import io

    blobs = []
    for m in _trained_conv_pair():
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        blobs.append(torch.load(buf, weights_only=False))
    train_both(*blobs, _image, steps=2)


def _copy_on_one_rank(rank: int, world_size: int) -> None:
    """A copy made on one rank only issues no collective (the other rank goes on to a barrier)."""
    import copy

    ours, _ = _trained_conv_pair()
    if rank == 0:
        copy.deepcopy(ours).eval()
    dist.barrier()


def _local_only_hook(state, bucket):  # unannotated: torch checks the annotation, a string here
    """A communication hook that reduces nothing: each rank keeps its own gradients."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _copy_drops_comm_hook(rank: int, world_size: int) -> None:
    """torch's copy is built without the original's communication hook (plain averaging) and
    takes a hook of its own; the original keeps its hook."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for hook in (default_hooks.fp16_compress_hook, _local_only_hook):
        ours, ref = make_pair(mlp, {})
        for m in (ours, ref):
            m.register_comm_hook(None, hook)
        train_both(*(copy.deepcopy(m) for m in (ours, ref)), rand_vec, steps=2)
        ours_c, ref_c = copy.deepcopy(ours), copy.deepcopy(ref)
        for m in (ours_c, ref_c):
            m.register_comm_hook(None, default_hooks.fp16_compress_hook)  # bf16: CUDA builds only
        train_both(ours_c, ref_c, rand_vec, steps=2)
        train_both(ours, ref, rand_vec, steps=1)


def _copy_subgroup_refused(rank: int, world_size: int) -> None:
    """A wrapper on another process group cannot be pickled (as with torch DDP): one clear error."""
    import copy

    sub = fastddp.DDPWrapper(mlp(), process_group=dist.new_group(list(range(world_size))))
    with pytest.raises(RuntimeError, match="supported only for a wrapper on the default process group"):
        copy.deepcopy(sub)


@pytest.mark.parametrize("case", [_copy_deepcopy, _copy_pickle, _copy_on_one_rank, _copy_drops_comm_hook,
                                  _copy_subgroup_refused],
                         ids=lambda f: f.__name__[len("_copy_"):])
def test_deepcopy_and_pickle_like_torch_ddp(ranks, case) -> None:
    ranks.run(case, world_size=2)


class _LocalHead(nn.Module):
    """A shared body and a rank-local head (its parameters and BatchNorm statistics ignored),
    and a parameter of the root module (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4))
        self.logit_scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.head(self.body(x)) * self.logit_scale


def _ignored(rank: int, world_size: int) -> list[str]:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ignore = ["head.0.weight", "head.0.bias", "head.1.running_mean", "head.1.running_var", "body.1.running_var",
              "logit_scale"]
    torch.manual_seed(3)
    a, b = _LocalHead(), _LocalHead()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # every rank starts apart, parameters and buffers
        for m in (a, b):
            for t in list(m.parameters()) + [t for t in m.buffers() if t.is_floating_point()]:
                t.add_(0.1 * (rank + 1))
    fastddp.DDPWrapper._set_params_and_buffers_to_ignore_for_model(a, ignore)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(b, ignore)
    # torch marks the named tensors too (_ddp_ignored, read by Dynamo's DDPOptimizer and
    # torch's _get_data_parallel_params)
    marked = [[n for n, t in [*m.named_parameters(), *m.named_buffers()] if getattr(t, "_ddp_ignored", False)]
              for m in (a, b)]
    assert marked[0] == marked[1] and marked[0], marked
    ours, ref = fastddp.DDPWrapper(a), TorchDDP(b)
    assert ours.will_sync_module_buffers() == ref.will_sync_module_buffers() is True
    reduced = {n for b in ours.bucket_report()["buckets"] for n in b["params"]}
    # torch's reducer matches f"{module_name}.{name}": a root parameter is never ignored there
    # (its key is ".logit_scale"), though the broadcast at construction skips it
    assert reduced == {n for n, _ in a.named_parameters()} - set(ignore) | {"logit_scale"}
    train_both(ours, ref, rand_vec, steps=3)  # every parameter, gradient and buffer equals torch's
    ours.eval()
    with torch.no_grad():  # broadcasts the synced buffers; eval mode leaves them as they are
        ours(torch.randn(2, 8))
    state = ours.module.state_dict()
    for name in state:  # the ignored entries stayed rank-local, the others are equal
        gathered = _gathered(state[name].float())
        assert torch.equal(gathered[0], gathered[1]) == (name not in ignore), name
    return ["ignored"]


def test_params_and_buffers_to_ignore_like_torch_ddp(ranks) -> None:
    assert ranks.run(_ignored, world_size=2) == [["ignored"]] * 2


def _private_set_static_graph(rank: int, world_size: int) -> None:
    """_set_static_graph() after construction: reentrant checkpointing reaches `shared` twice,
    which only static_graph accepts."""
    from .ddp_common import SharedCheckpointed

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(SharedCheckpointed, {"bucket_cap_mb": 0.0005})
    for m in (ours, ref):
        m._set_static_graph()
    assert ours.static_graph and ours.transport == "shm"
    train_both(ours, ref, rand_vec, steps=3)
    for m in (ours, ref):  # torch's warning, word for word
        with pytest.warns(UserWarning, match="^You've set static_graph to be True, no need to set it again.$"):
            m._set_static_graph()
    _late_set_static_graph_as_torch()
    # static_graph with find_unused_parameters, in the constructor or later: torch's warnings
    said = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(mlp(), static_graph=True, find_unused_parameters=True)
            cls(mlp(), find_unused_parameters=True)._set_static_graph()
        said.append([(str(w.message), w.filename, w.lineno) for w in caught
                     if "_set_static_graph" in str(w.message)])
    # the same words, named at the same place: torch's line in its constructor, then the script's
    assert len(said[0]) == 2 and said[0] == said[1], said
    assert said[0][0][1].endswith("torch/nn/parallel/distributed.py") and said[0][1][1] == __file__


def _late_set_static_graph_as_torch() -> None:
    """torch's rule: refused once a forward with gradients on, outside no_sync(), has run (its
    reducer's iteration count), backward or not, in torch's words; after forwards without
    gradients or under no_sync() it still applies."""
    def forward_only(m: nn.Module) -> None:
        m(torch.randn(2, 8))

    def no_sync_step(m: nn.Module) -> None:
        with m.no_sync():
            m(torch.randn(2, 8)).sum().backward()

    def no_grad_forward(m: nn.Module) -> None:
        with torch.no_grad():
            m(torch.randn(2, 8))

    for before, refused in ((lambda m: m(torch.randn(2, 8)).sum().backward(), True), (forward_only, True),
                            (no_sync_step, False), (no_grad_forward, False)):
        outcomes = []
        for cls in (TorchDDP, fastddp.DDPWrapper):
            m = cls(mlp())
            before(m)
            try:
                m._set_static_graph()
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append(str(e))
        assert (outcomes[0] is not None) == refused, outcomes
        if refused:
            assert outcomes[1] is not None and outcomes[1].startswith(outcomes[0]), outcomes
        else:
            assert outcomes[1] is None, outcomes


def _private_builtin_comm_hook(rank: int, world_size: int) -> None:
    """_register_builtin_comm_hook(FP16_COMPRESS) is comm_dtype=torch.float16, as torch's C++ hook."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(mlp, {})
    for m in (ours, ref):
        m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert ours.comm_dtype == torch.float16
    train_both(ours, ref, rand_vec, steps=2, tol={"rtol": 2**-10, "atol": 2**-20})  # as test_ddp_hooks.PARITY


def _private_attributes(rank: int, world_size: int) -> None:
    """The descriptive attributes code written for torch DDP reads."""
    for kwargs in ({}, {"bucket_cap_mb": 0.5}):
        ours, ref = make_pair(mlp, kwargs)
        for name in ("bucket_bytes_cap", "is_multi_device_module", "device_type", "device", "mixed_precision",
                     "require_backward_grad_sync", "static_graph", "find_unused_parameters", "dim",
                     "broadcast_buffers", "device_ids", "output_device"):
            assert getattr(ours, name) == getattr(ref, name), (name, getattr(ours, name), getattr(ref, name))


@pytest.mark.parametrize("case", [_private_set_static_graph, _private_builtin_comm_hook, _private_attributes],
                         ids=lambda f: f.__name__[len("_private_"):])
def test_private_torch_ddp_api_used_by_libraries(ranks, case) -> None:
    ranks.run(case, world_size=2)


def test_inputs_are_moved_like_torch_ddp_moves_them() -> None:
    """forward's input move for device_ids (checked here with the meta device; the CUDA test
    below runs it end to end): tensors inside containers move, the containers keep their kinds."""
    from collections import OrderedDict, namedtuple

    from fastddp.ddp.inputs import to_device

    Pair = namedtuple("Pair", "x y")
    meta = torch.device("meta")
    args = (torch.ones(2), [torch.ones(1), "tag", 3], {"k": Pair(torch.ones(3), None)},
            OrderedDict(a=torch.ones(1)), (), [])
    moved = to_device(args, meta)
    assert isinstance(moved, tuple) and len(moved) == len(args)
    assert moved[0].is_meta and moved[1][0].is_meta and moved[1][1:] == ["tag", 3]
    assert isinstance(moved[2]["k"], Pair) and moved[2]["k"].x.is_meta and moved[2]["k"].y is None
    assert type(moved[3]) is OrderedDict and moved[3]["a"].is_meta
    assert moved[4] == () and moved[5] == []
    on_device = torch.empty(1, device="meta")
    assert to_device(on_device, meta) is on_device  # nothing to move: the same tensor


@pytest.mark.cuda
def test_cpu_inputs_reach_a_cuda_module_like_torch_ddp() -> None:
    from .ddp_common import nccl_world_one

    with nccl_world_one():
        torch.manual_seed(0)
        a, b = mlp().cuda(), mlp().cuda()
        b.load_state_dict(a.state_dict())
        ours, ref = fastddp.DDPWrapper(a, device_ids=[0]), TorchDDP(b, device_ids=[0])
        x = torch.randn(6, 8).pin_memory()
        for m in (ours, ref):
            out = m(x)  # a CPU batch: both wrappers move it to cuda:0
            assert out.device == torch.device("cuda", 0)
            out.pow(2).mean().backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
