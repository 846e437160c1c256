"""Desynchronisation detection for DDPWrapper's reductions.

Every gradient reduction carries a small fingerprint (csrc/reducer/fingerprint.h): the reducing
step's number, the bucket count and a hash of the bucket layout, which parameters require grad,
the number of ``no_sync()`` steps since the last reduction, the forward's autocast state, the
parameters that got no gradient, and a sequence number of the collectives. The ranks compare
fingerprints as a by-product of the last bucket's reduction (a slot per rank in the shared-memory
mapping or in a header after the bucket's gradients; one small MAX all-reduce beside it where the
bucket cannot carry one: GPU, bf16/fp16); when they differ, every rank raises
:class:`DesyncError` with one message naming the ranks and what differs.
"""

from __future__ import annotations

import os


class DesyncError(RuntimeError):
    """The ranks of a DDPWrapper are out of step in a gradient reduction (raised on every rank,
    from ``loss.backward()``); the message says which ranks differ and how."""


def fingerprint_setting() -> tuple[bool, bool]:
    """``(on, compare_used_set)`` from ``FASTDDP_FINGERPRINT``: unset or ``1`` on; ``0`` (also
    ``false``/``no``/``off``) off; ``strict`` on, and with ``find_unused_parameters=True`` the set
    of parameters each rank's forward used must match too (torch DDP allows it to differ)."""
    value = os.environ.get("FASTDDP_FINGERPRINT", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False, False
    if value in ("", "1", "true", "yes", "on"):
        return True, False
    if value == "strict":
        return True, True
    raise ValueError(f"FASTDDP_FINGERPRINT={value!r}: expected 1 (on, the default), 0 (off) or strict "
                     "(also compare the used-parameter sets under find_unused_parameters=True)")
