"""Command line of ``fastddp.train``: the flags of the classic ``main_multi_gpu.py`` and a
config file (YAML or JSON) that can set every flag. Checking them is validate.py's."""

from __future__ import annotations

import argparse

from .config import load_config
from .models import MODES
from .validate import check_paths, under_torchrun


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser: every flag, grouped as ``--help`` shows them."""
    p = argparse.ArgumentParser(
        prog="python -m fastddp.train",
        description=(
            "Train the HAR activity-recognition task (UCI HAR or the embedded synthetic data) "
            "with fastddp's DDPWrapper, GradScaler, DistributedSampler and PrefetchLoader. "
            "Multi-process: torchrun --nproc_per_node=N -m fastddp.train --multi-gpu ddp ..."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _parallelism_flags(p)
    _model_and_data_flags(p)
    _optimisation_flags(p)
    _pipeline_flags(p)
    _output_flags(p)
    return p


def _parallelism_flags(p: argparse.ArgumentParser) -> None:
    """How the ranks run and talk: the mode, GPUs, process group and DDPWrapper options."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--multi-gpu", choices=["none", "dp", "ddp"], default=None,
                   help="ddp: one process per GPU/CPU rank through DDPWrapper (default under "
                        "torchrun); dp: torch.nn.DataParallel in one process (needs >= 1 GPU; "
                        "DDP is faster, prefer it); none: a single process (default otherwise)")
    g.add_argument("--gpu-ids", default=None,
                   help="comma-separated GPU ids to use, e.g. 0,1 (dp: the replicas; ddp: "
                        "LOCAL_RANK indexes into this list)")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="process-group backend (auto: nccl on GPUs, gloo on CPU)")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for a lost rank before the job stops")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="let DDPWrapper tolerate parameters that get no gradient in a step")
    g.add_argument("--sync-batchnorm", action="store_true",
                   help="convert BatchNorm layers to SyncBatchNorm (ddp only)")
    g.add_argument("--comm-dtype", choices=["none", "bf16", "fp16"], default="none",
                   help="compress gradients to this dtype for the all-reduce")


def _model_and_data_flags(p: argparse.ArgumentParser) -> None:
    """Which model trains on which data."""
    g = p.add_argument_group("model and data")
    g.add_argument("--mode", default=None,
                   help=f"model: {', '.join(MODES)} (flatten, the default: MLP over the 9x128 "
                        "window; conv1d and lstm over the sequence)")
    g.add_argument("--model", default=None, help="your own model: pkg.module:factory")
    g.add_argument("--dataset", default=None,
                   help="your own data: pkg.module:factory returning (train, test) datasets of "
                        "(x, y) tensors, e.g. two TensorDatasets")
    g.add_argument("--data-dir", default=None,
                   help="root of the real UCI HAR data set (default: the embedded synthetic data)")
    g.add_argument("--class-weights", choices=["auto", "none"], default="none",
                   help="auto: weight the loss by inverse class frequency")


def _optimisation_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer, its schedule, precision and the step."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=5, help="training epochs")
    g.add_argument("--batch-size", type=int, default=64,
                   help="batch size per process (effective = batch x world x accum)")
    g.add_argument("--lr", type=float, default=1e-3, help="base learning rate (AdamW)")
    g.add_argument("--scale-lr", choices=["linear", "sqrt", "none"], default="none",
                   help="scale --lr by the world size x accumulation steps")
    g.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="linear warm-up epochs, then cosine decay")
    g.add_argument("--weight-decay", type=float, default=1e-2, help="AdamW weight decay")
    g.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step (no_sync on all but the last)")
    g.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="mixed precision (default: on with CUDA, off on CPU)")
    g.add_argument("--amp-dtype", choices=["fp16", "bf16"], default=None,
                   help="autocast dtype (default: fp16 with CUDA, bf16 on CPU); fp16 uses "
                        "fastddp.GradScaler")
    g.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                   help="replay the whole training step as one CUDA graph (auto: on a GPU in a "
                        "single process with fp16 AMP and --grad-accum-steps 1)")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="max global grad norm (0 disables clipping)")
    g.add_argument("--seed", type=int, default=42, help="random seed (per-rank streams derived)")
    g.add_argument("--max-nan-steps", type=int, default=5,
                   help="abort after this many consecutive non-finite losses (checked "
                        "unless fp16 AMP's GradScaler skips such steps itself)")


def _pipeline_flags(p: argparse.ArgumentParser) -> None:
    """The input pipeline."""
    g = p.add_argument_group("input pipeline")
    g.add_argument("--num-workers", type=int, default=2, help="loader threads per process")


def _output_flags(p: argparse.ArgumentParser) -> None:
    """Checkpoints, resuming, logs and progress."""
    g = p.add_argument_group("output")
    g.add_argument("--save-dir", default="runs/har", help="checkpoints, metrics, plots")
    g.add_argument("--resume", default="auto",
                   help="auto: continue from SAVE_DIR/last.pt if present; a path; or none")
    g.add_argument("--save-interval", type=int, default=0,
                   help="also write last.pt every N optimizer steps (mid-epoch resume); 0: per epoch")
    g.add_argument("--sync-checkpoints", action="store_true",
                   help="write each checkpoint before training goes on (default: rank 0 writes "
                        "it in the background; it is on disk by the next checkpoint or the end)")
    g.add_argument("--log-interval", type=int, default=50,
                   help="optimizer steps between progress reports: the bar's loss, accuracy and "
                   "samples/s, or, without a bar (--no-progress), a log line")
    g.add_argument("--tensorboard", action="store_true", help="write TensorBoard events")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    g.add_argument("--debug", action="store_true",
                   help="show the traceback of an input error too (also: FASTDDP_DEBUG=1)")
    g.add_argument("--config", default=None,
                   help="YAML or JSON file setting any flag (flag names at the top level, or "
                        "the classic keys training.lr, distributed.backend, ...: other "
                        "sections are refused); flags on the command line win")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    check_paths(pre)
    values: dict = {}
    keys: dict[str, str] = {}
    if pre.config:
        values, keys = load_config(pre.config, parser)
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    if args.multi_gpu is None:
        args.multi_gpu = "ddp" if under_torchrun() else "none"
    if args.mode is None and not args.model:  # unset, so that --model with a --mode is refused
        args.mode = "flatten"
    # the flags whose value the config file set (the command line did not change it), named by
    # the file's key in the errors about them (config.naming_config_key)
    args.config_keys = {dest: key for dest, key in keys.items() if getattr(args, dest) == values[dest]}
    return args
