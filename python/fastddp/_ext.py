"""Loads the compiled core (``fastddp._C``) after checking it matches the running torch."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

REBUILD_HINT = "pip install --no-build-isolation --force-reinstall --no-deps ."


def _load() -> ModuleType:
    try:
        build = importlib.import_module("fastddp._build_info")
    except ImportError as exc:  # pragma: no cover - only in a broken source checkout
        raise ImportError(
            "fastddp's compiled extension is not built. Build it against the installed torch with: "
            f"{REBUILD_HINT}"
        ) from exc
    if build.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"fastddp was built against torch {build.TORCH_VERSION} but torch {torch.__version__} "
            f"is installed; the C++ ABI differs between versions. Rebuild fastddp with: {REBUILD_HINT}"
        )
    try:
        return importlib.import_module("fastddp._C")
    except ImportError as exc:
        raise ImportError(
            f"fastddp's extension failed to load ({exc}). It was built against torch "
            f"{build.TORCH_VERSION} (running {torch.__version__}). Rebuild it with: {REBUILD_HINT}"
        ) from exc


C: ModuleType = _load()
