"""register_comm_hook validates a hook's annotations as torch DDP does, with torch's exception
type, side by side with torch DDP in the same gloo group (one case per test)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .distributed import run_distributed


def _returns_int(state, bucket) -> int:
    return 0


def _bucket_is_tensor(state, bucket: torch.Tensor):
    return None


def _second_argument_not_bucket(state, grads):
    return None


def _well_annotated(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# With `from __future__ import annotations` (as here) annotations are strings: the objects
# torch compares against are set explicitly, as a hook module without that import has them.
_returns_int.__annotations__ = {"return": int}
_bucket_is_tensor.__annotations__ = {"bucket": torch.Tensor}
_well_annotated.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}
HOOKS = {"returns int": _returns_int, "bucket is a tensor": _bucket_is_tensor, "well annotated": _well_annotated,
         "second argument not named bucket": _second_argument_not_bucket, "not callable": {}}
EXPECTED = {"well annotated": "ok", "second argument not named bucket": "KeyError", "not callable": "TypeError"}


def _register(rank: int, world_size: int, hook_key: str) -> list[tuple[str, str, str]]:
    """(exception type, message, the error torch's logger kept) for DDPWrapper and torch DDP."""
    def outcome(model):
        try:
            model.register_comm_hook(None, HOOKS[hook_key])
        except Exception as exc:  # the type is what the test compares
            if isinstance(exc, KeyError) and "DDPWrapper" in str(exc):
                assert "'bucket'" in str(exc) and "grads" in str(exc), str(exc)  # names the argument
            return type(exc).__name__, str(exc), str(model._get_ddp_logging_data().get("error"))
        return "ok", "", ""

    return [outcome(fastddp.DDPWrapper(nn.Linear(2, 2))), outcome(TorchDDP(nn.Linear(2, 2)))]


@pytest.mark.parametrize("hook_key", list(HOOKS))
def test_hook_annotations_are_checked_like_torch(hook_key: str) -> None:
    [[ours, ref]] = run_distributed(_register, world_size=1, args=(hook_key,))
    assert ours[0] == ref[0] == EXPECTED.get(hook_key, "ValueError"), (ours, ref)
    if ref[0] in ("TypeError", "ValueError"):  # torch's sentence first, and kept by the logger as torch's
        assert ours[1].startswith(ref[1]) and ours[2].startswith(ref[2]), (ours, ref)
