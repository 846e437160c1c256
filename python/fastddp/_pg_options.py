"""What a c10d process group's CPU backend tells of its options. torch keeps them behind private
attributes (``group._get_backend(device).options``): this module is the one place that reads
them, each reader falling back where a backend hides the value."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


def _cpu_options(group: Any) -> Any:
    return group._get_backend(torch.device("cpu")).options


def group_timeout_s(group: Any) -> float:
    """The process group's timeout in seconds (its CPU backend's), else torch's default for
    process groups."""
    try:
        return float(_cpu_options(group)._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return getattr(dist, "default_pg_timeout", timedelta(minutes=30)).total_seconds()


def gloo_threads(group: Any) -> Optional[int]:
    """The gloo backend's thread count, which torch DDP's logger records (None if not readable)."""
    try:
        return int(_cpu_options(group)._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
