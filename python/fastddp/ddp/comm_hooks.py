"""torch DDP's communication hooks on DDPWrapper: torch's built-in hooks map onto the C++
reducer (``comm_dtype``), any other hook runs per bucket through torch's Python hook adapter."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as torch_ddp_module
from torch.nn.parallel import DistributedDataParallel

from .._torch_warnings import source_line, warn_at
from . import sparse
from .logging_data import RunLog


def hook_name(hook: Any) -> str:
    """How messages and bucket_report() name a communication hook."""
    return getattr(hook, "__qualname__", repr(hook))


def check_annotations(hook: Any, name: str) -> None:
    """torch DDP's check of a hook, with its exception types and sentences first: it must be
    callable (TypeError); the second argument must be named ``bucket`` (KeyError); an annotated
    ``bucket`` must be ``dist.GradBucket``, an annotated return type
    ``torch.futures.Future[torch.Tensor]`` (ValueError; compared as torch compares them)."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. (DDPWrapper.register_comm_hook: got "
                        f"{type(hook).__name__}; the hook is called as hook(state, bucket).)")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to inspect (a builtin): let the call decide
        return
    bucket = sig.parameters.get("bucket")
    if bucket is None:
        # torch DDP looks the argument up by name (sig.parameters["bucket"]): KeyError
        raise KeyError(f"DDPWrapper.register_comm_hook: {name} has no argument named 'bucket' (its arguments: "
                       f"{', '.join(sig.parameters) or 'none'}); torch DDP requires the signature "
                       "hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor].")
    if bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket. (DDPWrapper."
                         f"register_comm_hook: {name}'s bucket argument is annotated {bucket.annotation!r}; "
                         "annotate it dist.GradBucket or leave the annotation out.)")
    if sig.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError(f"Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
                         f"(DDPWrapper.register_comm_hook: {name} is annotated to return "
                         f"{sig.return_annotation!r}; annotate it so, or leave the annotation out.)")


class CommHooks:
    """DDPWrapper's ``register_comm_hook`` family (a part of the wrapper: it reads and sets the
    wrapper's hook, ``comm_dtype`` and reducer)."""

    _comm_hook: Optional[Callable]
    _python_hook: Optional[tuple[object, Callable]]
    _run_log: RunLog
    _sparse_names: list[str]

    def _init_hook_state(self) -> None:
        self._comm_hook = None
        self._python_hook = None  # (state, hook) run per bucket

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch DDP's communication hook: ``hook(state, bucket) -> torch.futures.Future`` is
        called for each full gradient bucket (a :class:`torch.distributed.GradBucket` holding
        the local, undivided sum of the gradients) and the Future's value, the reduced flat
        tensor, replaces the bucket: PowerSGD, custom compression, or any other hook written
        for torch DDP. Only once, as torch, and before the first backward, as torch's
        documentation requires; the hook runs in every reduced backward, in a world of one too,
        and replaces the shared-memory transport.

        torch's ``default_hooks.allreduce_hook`` (each gradient divided by the world size,
        where the reducer without a hook multiplies by its inverse: other last bits at a world
        size that is not a power of two), ``fp16_compress_hook`` and ``bf16_compress_hook``
        (the same as ``comm_dtype=torch.float16`` / ``torch.bfloat16``) run in C++ instead of
        Python, with the shared-memory transport kept."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        known: dict[Callable, Optional[torch.dtype]] = {
            default_hooks.allreduce_hook: None,
            default_hooks.fp16_compress_hook: torch.float16,
            default_hooks.bf16_compress_hook: torch.bfloat16,
        }
        name = hook_name(hook)
        try:
            check_annotations(hook, name)
        except (TypeError, ValueError) as error:  # torch's logger keeps these (its _log_and_throw)
            self._run_log.note_error(f"{type(error)}: {error}", self._reducer.logged_error)
            raise
        if self._comm_hook is not None:
            # torch's sentence first (scripts match it)
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once. "
                               f"(DDPWrapper: {hook_name(self._comm_hook)} is registered already.)")
        if self._reducer.reductions:
            raise RuntimeError("DDPWrapper.register_comm_hook must be called before the first backward "
                               "pass (torch DDP's documentation requires it; torch does not check it and "
                               "switches hooks mid-training); register it right after wrapping the model.")
        if hook is not default_hooks.allreduce_hook:  # the others change what a sparse gradient becomes
            sparse.refuse(self._sparse_names, f"the communication hook {name}")
        if not any(hook is k for k in known) or (state is not None and state is not self.process_group):
            # torch's hook runs as it is, with its state: a built-in hook given another group
            # reduces over that group (and fails in backward as under torch on a state that is none)
            self._register_python_hook(state, hook, name)
            return
        dtype = known[hook]
        if dtype is not None and self.comm_dtype not in (None, dtype):
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} conflicts with comm_dtype={self.comm_dtype} "
                             "given to the constructor; use one of the two.")
        self._comm_hook = hook
        self._run_log.comm_hook = getattr(hook, "__qualname__", name)  # torch's logger's name for it
        if dtype is not None and dtype != self.comm_dtype:
            self.comm_dtype = dtype
        self._replace_reducer()  # the reducer runs the hook: comm_dtype, or allreduce_hook's division

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch DDP's C++ built-in hooks (``dist.BuiltinCommHookType``): ``ALLREDUCE`` is
        ``allreduce_hook`` (each gradient divided by the group size), ``FP16_COMPRESS`` is
        ``comm_dtype=torch.float16``."""
        if not isinstance(comm_hook_type, dist.BuiltinCommHookType):  # torch's binding's TypeError
            raise TypeError("_register_builtin_comm_hook(): incompatible function arguments. (DDPWrapper: "
                            "expected a torch.distributed.BuiltinCommHookType, ALLREDUCE or FP16_COMPRESS; got "
                            f"{type(comm_hook_type).__name__} {comm_hook_type!r})")
        if self._comm_hook is not None:  # torch's sentence for this path (scripts match it)
            raise RuntimeError("register_builtin_comm_hook or register_comm_hook can only be called once. "
                               f"(DDPWrapper: {hook_name(self._comm_hook)} is registered already.)")
        hooks = {"ALLREDUCE": "allreduce_hook", "FP16_COMPRESS": "fp16_compress_hook"}
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kind = comm_hook_type.name
        self.register_comm_hook(None, getattr(default_hooks, hooks[kind]))
        self._run_log.comm_hook = str(comm_hook_type)  # torch's logger names the built-in type

    def _set_static_graph(self) -> None:
        """torch DDP's late switch to ``static_graph=True`` (prefer the constructor argument):
        after construction, before the first backward, on every rank."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._run_log.iterations or self._reducer.reductions:
            # torch's words first (scripts and torch's tests match them), then the fix
            words = ("set_static_graph() should be called before training loop starts and after "
                     "DistributedDataParallel is constructed.")
            self._run_log.note_error(words, self._reducer.logged_error)
            raise RuntimeError(f"{words} (DDPWrapper: a forward with gradients on, outside no_sync(), has run; "
                               "call _set_static_graph() right after wrapping the model, or pass "
                               "static_graph=True to the constructor.)")
        sparse.refuse(self._sparse_names, "_set_static_graph()")
        self.static_graph = True
        self._replace_reducer()
        self._warn_static_graph_finds_unused()

    def _warn_static_graph_finds_unused(self, at_construction: bool = False) -> None:
        """torch DDP's warning (word for word) when static_graph joins find_unused_parameters:
        from the constructor, at torch's line that calls its ``_set_static_graph()``; from a
        script's own ``_set_static_graph()`` call, at the script's line (torch's stacklevel)."""
        if not self.find_unused_parameters:
            return
        message = ("You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will "
                   "detect unused parameters automatically, so you do not need to set find_unused_parameters=true, "
                   "just be sure these unused parameters will not change during training loop while calling "
                   "`_set_static_graph`.")
        if at_construction:
            warn_at(torch_ddp_module, source_line(DistributedDataParallel.__init__, "self._set_static_graph()"),
                    message, stacklevel=3)
        else:
            warnings.warn(message, stacklevel=3)

    def _register_python_hook(self, state: object, hook: Callable, name: str) -> None:
        """A hook the reducer calls per bucket through torch's Python hook adapter."""
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as exc:
            raise TypeError(f"DDPWrapper.register_comm_hook: {name} must take two arguments, (state, bucket), "
                            f"as torch DDP calls it: {exc}") from None
        except ValueError:  # no signature to inspect (a builtin): let the call decide
            pass
        if self.comm_dtype is not None:
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} does its own reduction and cannot be "
                             f"combined with comm_dtype={self.comm_dtype} given to the constructor; compress "
                             "inside the hook (e.g. fp16_compress_wrapper) or drop comm_dtype.")
        if self._shm_requested:
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} does its own reduction and cannot run on "
                             "the shared-memory transport requested with shm_allreduce=True; pass "
                             "shm_allreduce=None (the default).")
        self._comm_hook = hook
        self._run_log.comm_hook = getattr(hook, "__qualname__", name)  # torch's logger's name for it
        self._python_hook = (state, hook)
        self._replace_reducer()

