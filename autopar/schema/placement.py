"""One placement of a tensor over one mesh axis, the string every file format and module uses.

"R" (replicated), "S(d)" (dimension d split evenly over the axis) or "P" (partial: the devices of
the axis hold summands of the tensor). `Placement` is the validated type the plan's schema uses
(a plan file with "S(x)" or "shard" is refused naming the field and the forms allowed);
`shard_dim`, `is_shard`, `shard` parse and make them, here and nowhere else.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Optional

from pydantic import AfterValidator

REPLICATE = "R"
PARTIAL = "P"
_FORM = re.compile(r"^(R|P|S\((0|[1-9][0-9]*)\))$")


def _check(p: str) -> str:
    if not _FORM.match(p):
        raise ValueError(f"placement {p!r} is none of 'R' (replicated), 'P' (partial sum) or 'S(d)' "
                         f"(dimension d sharded, d a non-negative integer)")
    return p


Placement = Annotated[str, AfterValidator(_check)]


def shard(d: int) -> str:
    """The placement sharding dimension `d`."""
    return f"S({d})"


@lru_cache(maxsize=None)
def shard_dim(p: str) -> Optional[int]:
    """The dimension of "S(d)"; None for "R" and "P"."""
    return int(p[2:-1]) if p.startswith("S(") else None


def is_shard(p: str) -> bool:
    return shard_dim(p) is not None
