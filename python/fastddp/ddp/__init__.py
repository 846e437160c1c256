"""``fastddp.ddp``: DDPWrapper, the drop-in for ``torch.nn.parallel.DistributedDataParallel`` on
a C++ reducer (bucketed all-reduce through c10d or shared memory, overlapped with backward).

Its parts: ``wrapper`` (the Module face), ``buckets`` (the reducer's configuration and bucket
reports), ``comm_hooks``, ``join`` (uneven inputs), ``checks`` (argument checks), ``rank_check``
(every rank built the same model), ``inputs`` (input moves and output search)."""

from __future__ import annotations

from .buckets import assign_buckets
from .wrapper import DDPWrapper

# Pickles (torch.save(model), deepcopy) name the class by the package, fastddp.ddp.DDPWrapper.
DDPWrapper.__module__ = __name__

__all__ = ["DDPWrapper", "assign_buckets"]
