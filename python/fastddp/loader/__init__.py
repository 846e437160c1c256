"""``fastddp.PrefetchLoader``, a drop-in for torch's DataLoader (see :mod:`.prefetch_loader`).

Parts: ``prefetch_loader`` (the Python face), ``settings`` (argument checks), ``sources`` (what
a dataset is to the loader), ``plan`` and ``shuffle`` (the batch plan and sampler plumbing),
``passes`` and ``iterator`` (one pass: the native pipeline binding, or torch's machinery).
"""

from .prefetch_loader import PrefetchLoader

__all__ = ["PrefetchLoader"]
