"""Checks of the launcher's flags that can run before a process group or data exist: each
refusal names the flag, the value and the fix."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .config import naming_config_key
from .errors import UsageError
from .models import MODES, load_factory

# torch.manual_seed takes 64 bits; per-rank and per-epoch seeds are derived by adding to it.
MAX_SEED = 2**63 - 1
# c10d counts a timeout in 64-bit nanoseconds (at most 9.2e9 s); beyond that the store's
# connect times out at once or the conversion overflows.
MAX_TIMEOUT = 10**9
# Below a second a collective cannot reliably cross even a local gloo link, and c10d rounds a
# timeout below a millisecond to 0 (every collective then fails at once).
MIN_TIMEOUT = 1.0

# Flags (and their defaults) that configure DDPWrapper or the process group, which only
# --multi-gpu ddp has: anything else given with another mode would be ignored.
DDP_ONLY = {"comm_dtype": ("none", "DDPWrapper's all-reduce"),
            "find_unused_parameters": (False, "DDPWrapper's gradient reduction"),
            "sync_batchnorm": (False, "BatchNorm statistics across the DDP ranks"),
            "backend": ("auto", "the process group of the DDP ranks"),
            "timeout": (300.0, "how long a collective of the DDP ranks waits for a lost rank")}



def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "LOCAL_RANK" in os.environ
    )


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def launch_variable(name: str) -> int:
    """``RANK``, ``LOCAL_RANK`` or ``WORLD_SIZE`` as torchrun set it for this process; 0 outside torchrun (a
    stray variable in a single process's environment does not make it another rank, whose
    errors rank 0 would be left to print) and where the value is not an integer
    (:func:`check_launch_environment` refuses that)."""
    if not under_torchrun():
        return 0
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def check_fastddp_environment(args: argparse.Namespace) -> None:
    """fastddp's own environment settings that a distributed run reads, checked as the wrapper
    checks them, so a mistyped one is one line naming it (not a traceback from the wrapper)."""
    if args.multi_gpu != "ddp":
        return
    from ..ddp.checks import env_flag
    from ..diag.watchdog import stall_threshold_s

    try:
        for name in ("FASTDDP_BATCH_GRAD_COPIES", "FASTDDP_WORLD1_PASSTHROUGH"):
            env_flag(name)
        stall_threshold_s(None, float(args.timeout))
    except ValueError as exc:
        raise UsageError(str(exc).removeprefix("DDPWrapper: ")) from None


def check_launch_environment(args: argparse.Namespace) -> None:
    """torchrun's variables, where a distributed run reads them, are integers that fit
    together: a mistyped one is named instead of failing inside torch with a traceback."""
    if not (under_torchrun() or args.multi_gpu == "ddp"):
        return
    values = {}
    for name in LAUNCH_VARIABLES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            values[name] = -1
        if values[name] < (1 if name.endswith("WORLD_SIZE") else 0):
            raise UsageError(f"{name}={raw!r} in the environment is not a valid {name.lower().replace('_', ' ')} "
                             "(torchrun sets it for each process): unset it, or start the run with "
                             "torchrun --nproc_per_node=N -m fastddp.train ...")
    world = values.get("WORLD_SIZE", 1)
    for name, bound in (("RANK", world), ("LOCAL_RANK", values.get("LOCAL_WORLD_SIZE", world))):
        if values.get(name, 0) >= bound:
            raise UsageError(f"{name}={values[name]} in the environment is not below the world it is a "
                             f"rank of ({bound} process(es)): unset it, or start the run with torchrun")


# Flags naming a file or directory. An empty value (an unset shell variable: --save-dir
# "$OUT") is "." to pathlib: the run's files would land in the working directory, a --config
# would be skipped.
PATH_FLAGS = {"save_dir": "a directory for the run's files (default runs/har)",
              "resume": "auto, none or a checkpoint file",
              "data_dir": "the UCI HAR directory, or leave the flag out for the built-in data",
              "config": "a YAML or JSON file, or leave the flag out"}


def check_paths(args: argparse.Namespace) -> None:
    """Refuse an empty (or blank) value of a :data:`PATH_FLAGS` flag, naming what to give; a
    leading ``~`` or ``~user`` is the home directory, as the shell would have made it (it does
    not after ``=``, as in ``--save-dir=~/runs``, nor in a config file), not a folder named ``~``."""
    for name, what in PATH_FLAGS.items():
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{name.replace('_', '-')} is empty ({value!r}); give {what}")
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))


def validate(args: argparse.Namespace, cuda_count: int) -> None:
    """Check every flag that can be checked before a process group or data exist; an error
    about a flag the config file set names the file's key."""
    try:
        _validate(args, cuda_count)
    except UsageError as exc:
        raise naming_config_key(exc, args) from None


def _validate(args: argparse.Namespace, cuda_count: int) -> None:
    check_paths(args)  # again: a --config may have set them
    check_exclusive(args)
    if args.mode not in MODES and not args.model:
        raise UsageError(f"unknown --mode {args.mode!r}: choose one of {', '.join(MODES)}",
                         flag="--mode")
    check_numbers(args)
    check_factories(args)
    check_devices(args, cuda_count)
    check_mode_flags(args, cuda_count)
    check_files(args)


def check_numbers(args: argparse.Namespace) -> None:
    """Counts, rates, sizes and seeds: each in its range, every float finite."""
    for name in ("epochs", "batch_size", "grad_accum_steps", "log_interval"):
        value = getattr(args, name)
        if not isinstance(value, int) or value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    # argparse takes "nan" and "inf" for float flags; NaN compares False both ways, so each
    # float check starts with math.isfinite.
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise UsageError(f"--weight-decay must be a finite number >= 0 (0 disables), got {args.weight_decay}")
    max_workers = max(32, 8 * (os.cpu_count() or 1))
    if not 0 <= args.num_workers <= max_workers:
        # each is a thread of the C++ loader; past the system's thread limit the loader's
        # start fails ("Resource temporarily unavailable"), long before that they only contend
        raise UsageError(f"--num-workers must be 0..{max_workers} (loader threads per process, "
                         f"at most 8 per CPU core of this machine), got {args.num_workers}")
    if not (math.isfinite(args.clip_grad) and args.clip_grad >= 0):
        raise UsageError(f"--clip-grad must be a finite number >= 0 (0 disables), got {args.clip_grad}")
    if not (math.isfinite(args.warmup_epochs) and args.warmup_epochs >= 0):
        raise UsageError(f"--warmup-epochs must be a finite number >= 0, got {args.warmup_epochs}")
    if args.warmup_epochs > args.epochs:
        raise UsageError(f"--warmup-epochs {args.warmup_epochs:g} is longer than the run "
                         f"(--epochs {args.epochs}): the learning rate would still be rising "
                         "when training ends; give at most --epochs")
    if not (math.isfinite(args.timeout) and MIN_TIMEOUT <= args.timeout <= MAX_TIMEOUT):
        raise UsageError(f"--timeout must be a number of seconds >= {MIN_TIMEOUT:g} and <= "
                         f"{MAX_TIMEOUT:.0e} (about 31 years), got {args.timeout:g}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer in 0..{MAX_SEED} (2**63 - 1), got {args.seed}")
    if args.max_nan_steps < 1:
        raise UsageError(f"--max-nan-steps must be >= 1 (1 stops at the first non-finite loss), "
                         f"got {args.max_nan_steps}")
    if args.save_interval < 0:
        raise UsageError(f"--save-interval must be >= 0 (0: a checkpoint per epoch only), "
                         f"got {args.save_interval}")


def check_factories(args: argparse.Namespace) -> None:
    """``--model`` and ``--dataset`` name an importable ``pkg.module:factory``."""
    for flag, spec in (("--model", args.model), ("--dataset", args.dataset)):
        if spec:
            try:
                load_factory(spec, flag)
            except ValueError as exc:
                raise UsageError(f"{exc}; the module must be importable from here (add its "
                                 "folder to PYTHONPATH, e.g. PYTHONPATH=. python -m "
                                 "fastddp.train ...)") from None


def check_devices(args: argparse.Namespace, cuda_count: int) -> None:
    """GPUs, the backend and the world size fit this machine and the way the run was started;
    sets ``args.gpu_list``."""
    check_launch_environment(args)
    check_fastddp_environment(args)
    args.gpu_list = parse_gpu_ids(args.gpu_ids, cuda_count)
    if args.multi_gpu == "dp" and cuda_count == 0:
        raise UsageError("--multi-gpu dp needs at least one CUDA GPU and none is visible; "
                         "use --multi-gpu ddp (works on CPU with gloo) or none")
    check_world(args)
    if args.multi_gpu == "ddp" and not under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--multi-gpu ddp with WORLD_SIZE>1 must be started by torchrun "
                         "(torchrun --nproc_per_node=N -m fastddp.train ...)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if args.backend == "nccl":
        if cuda_count == 0:
            raise UsageError("--backend nccl needs CUDA GPUs and none is visible; use gloo")
        usable = len(args.gpu_list) if args.gpu_list else cuda_count
        if local_world > usable:
            raise UsageError(f"{local_world} ranks on this node but only {usable} GPU(s) usable "
                             "with NCCL: lower --nproc_per_node or use --backend gloo",
                             flag="--backend")
    if args.sync_batchnorm and args.multi_gpu == "ddp" and (cuda_count == 0 or args.backend == "gloo"):
        raise UsageError("--sync-batchnorm needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs "
                         "only) and none is used here; drop the flag on CPU ranks")


def check_files(args: argparse.Namespace) -> None:
    """``--data-dir`` is a readable directory, a ``--resume`` path a checkpoint file."""
    if args.data_dir is not None:
        root = Path(args.data_dir)
        if not root.is_dir() or not os.access(root, os.R_OK):
            raise UsageError(f"--data-dir {args.data_dir}: not a readable directory")
    if args.resume not in ("auto", "none") and Path(args.resume).is_dir():
        raise UsageError(f"--resume {args.resume}: is a directory; give the checkpoint file in it "
                         f"({Path(args.resume) / 'last.pt'}), or --save-dir {args.resume} to "
                         "continue the run there with --resume auto")
    if args.resume not in ("auto", "none") and not Path(args.resume).is_file():
        raise UsageError(f"--resume {args.resume}: no such checkpoint file "
                         "(use auto, none or a path to a .pt written by fastddp.train)")


def check_world(args: argparse.Namespace) -> None:
    """Refuse a single-process mode (``--multi-gpu none``/``dp``) in a world of several
    processes (torchrun --nproc_per_node=N): each would train alone, all into one --save-dir."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if args.multi_gpu != "ddp" and world > 1:
        raise UsageError(f"--multi-gpu {args.multi_gpu} trains in one process, but this is one "
                         f"of WORLD_SIZE={world} processes (torchrun --nproc_per_node={world}?): "
                         "each would train alone into the same --save-dir. Use --multi-gpu ddp "
                         "(the default under torchrun), or start a single process with python "
                         "-m fastddp.train")


def check_mode_flags(args: argparse.Namespace, cuda_count: int) -> None:
    """Refuse flags that the chosen mode would ignore: DDP's flags without --multi-gpu ddp,
    --amp-dtype with AMP off."""
    if args.multi_gpu != "ddp":
        for name, (default, what) in DDP_ONLY.items():
            value = getattr(args, name)
            if value != default:
                flag = f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                raise UsageError(f"{flag} only applies to --multi-gpu ddp (it sets {what}); this "
                                 f"run is --multi-gpu {args.multi_gpu}: drop it, or start the run "
                                 "with torchrun --nproc_per_node=N -m fastddp.train --multi-gpu ddp")
    amp_on_by_default = cuda_count > 0 and args.backend != "gloo"
    if args.amp_dtype is not None and not (args.amp or (args.amp is None and amp_on_by_default)):
        why = "--no-amp is given" if args.amp is False else "AMP is off by default without a GPU"
        raise UsageError(f"--amp-dtype {args.amp_dtype} sets the autocast dtype but {why}; add "
                         "--amp to train in mixed precision, or drop --amp-dtype")


def check_exclusive(args: argparse.Namespace) -> None:
    """Refuse two flags that choose the same thing: one of them would be ignored."""
    if args.dataset and args.data_dir is not None:
        raise UsageError(f"--dataset {args.dataset} and --data-dir {args.data_dir} both choose the "
                         "training data; give one (--data-dir: the UCI HAR files, --dataset: "
                         "your own pkg.module:factory)")
    if args.model and args.mode is not None:
        raise UsageError(f"--model {args.model} and --mode {args.mode} both choose the model; "
                         "give one (--mode: a built-in HAR model, --model: your own "
                         "pkg.module:factory)")


def parse_gpu_ids(spec: str | None, cuda_count: int) -> list[int]:
    if spec in (None, ""):
        return []
    try:
        ids = [int(s) for s in str(spec).split(",") if s.strip() != ""]
    except ValueError:
        raise UsageError(f"--gpu-ids must be comma-separated integers, got {spec!r}") from None
    if not ids:
        raise UsageError(f"--gpu-ids must name at least one GPU id, e.g. 0,1, got {spec!r}")
    absent = [i for i in ids if i < 0 or i >= cuda_count]
    if absent:
        raise UsageError(f"--gpu-ids {spec}: GPU(s) {absent} not present "
                         f"({cuda_count} visible: ids 0..{cuda_count - 1})" if cuda_count
                         else f"--gpu-ids {spec}: no CUDA GPU is visible on this machine")
    if len(set(ids)) != len(ids):
        raise UsageError(f"--gpu-ids {spec}: an id is repeated")
    return ids
