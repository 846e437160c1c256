"""Warnings given as the torch code fastddp replaces gives them: at the line of torch's source
that torch's ``warnings.warn`` names, in that torch module's registry, so that filters by
module (``-W ignore::UserWarning:torch.nn.parallel.distributed``) and the once-per-location
rule treat them as torch's own."""

from __future__ import annotations

import functools
import inspect
import warnings
from types import ModuleType
from typing import Any, Callable, Optional


@functools.cache
def source_line(function: Callable[..., Any], text: str) -> Optional[int]:
    """The number of the first line of ``function``'s source that contains ``text``; None when
    the source cannot be read (or does not contain it)."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    return next((first + i for i, line in enumerate(lines) if text in line), None)


def warn_at(module: ModuleType, line: Optional[int], message: str, category: type[Warning] = UserWarning,
            stacklevel: int = 2) -> None:
    """``message`` as given at ``line`` of torch's ``module``; without a line (no source), at
    ``stacklevel`` as a ``warnings.warn`` in the caller of this function counts it."""
    if line is None:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
        return
    warnings.warn_explicit(message, category, module.__file__, line, module=module.__name__,
                           registry=vars(module).setdefault("__warningregistry__", {}),
                           module_globals=vars(module))
