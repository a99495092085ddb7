"""Context parallelism as the runtime executes it: a stage's "cp" axis splits every sequence.

Each of the cp ranks holds two of the 2 cp equal chunks of every sample, i and 2 cp - 1 - i
(Llama 3's causal load balance, Dubey et al. 2024 section 3.3.2), taken from its data-parallel
rows (`ContextParallel.local_tokens`). Every op but attention is token-local and runs as is on
the rank's tokens; the model reads their positions in the whole sequence through
`models.positions.token_positions` (set for the step by `ContextParallel.active`). Each fused
attention call (`F.scaled_dot_product_attention`, causal or unmasked) is taken over by a torch
function mode entered by every module's forward (`ContextParallel.install`: a recomputation
re-runs a checkpointed module's forward inside the backward, where no mode entered around the
step is active): K and V are all-gathered along the sequence over the cp group with torch's
autograd functional collective (its backward reduce-scatters their gradients), and the local
queries attend to them under the causal mask of their global positions (under selective
recomputation that function is the region the selective checkpoint re-runs, its gather
included: `runtime.selective.fused_call_override`). The loss of a rank is
its tokens' mean; parameters' gradients are averaged over dp x cp (the engine's sync group), so
the step equals one process's on the whole batch.

torch's `context_parallel` (torch.distributed.tensor.experimental) is not used: it takes over
the CUDA flash / efficient / cuDNN attention ops only, not the CPU kernel gloo runs reach.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from autopar.models.positions import positions_set, reads
from autopar.runtime.selective import fused_call_override
from autopar.schema import PlanError


def chunk_order(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) rank `rank` of cp holds."""
    return rank, 2 * cp - 1 - rank


def chunk_positions(rank: int, cp: int, seq: int) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens of a `seq`-token sequence, in its order."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_order(rank, cp)])


class ContextParallel:
    """One rank's context parallelism: its rank in the cp `group` of `size`, over sequences of
    `seq` tokens."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, size: int, seq: int) -> None:
        if seq % (2 * size):
            raise PlanError(f"context parallelism over {size} ranks needs the sequence ({seq} tokens) to divide "
                            f"into {2 * size} chunks; re-plan with a cp dividing it")
        self.group, self.rank, self.size, self.seq = group, rank, size, seq
        self.positions = chunk_positions(rank, size, seq)
        self._depth = 0                 # forwards of installed modules running (`install`)
        self._checked = False           # whether a forward was seen to read the positions
        # every rank's positions, in the order the all-gather lays their chunks out
        self.key_positions = torch.cat([chunk_positions(r, size, seq) for r in range(size)])

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s tokens (dim 1, the whole sequence) this rank holds; other tensors as they are."""
        if x.dim() < 2 or x.shape[1] != self.seq:
            return x
        c = self.seq // (2 * self.size)
        return torch.cat([x.narrow(1, i * c, c) for i in chunk_order(self.rank, self.size)], dim=1)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """A forward (and its backward's recomputation) on this rank's tokens: their positions
        for the model, and (the outermost installed module's forward entering it) the attention
        over the gathered keys and values."""
        with positions_set(self.positions):
            yield

    def install(self, root: nn.Module) -> None:
        """Every module of `root` runs its forward under the attention mode unless an enclosing
        forward already does (an instance attribute, set before recomputation wraps them, so a
        checkpointed module's re-run forward enters it too)."""
        for mod in root.modules():
            mod.forward = self._wrapped(mod.forward)

    def _wrapped(self, fwd: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fwd(*args, **kwargs)
            self._depth += 1
            before = reads()
            try:
                mode = _CPAttention(self)
                with positions_set(self.positions), mode, \
                        fused_call_override(F.scaled_dot_product_attention, mode.attention):
                    out = fwd(*args, **kwargs)
            finally:
                self._depth -= 1
            if not self._checked:
                if reads() == before:
                    raise PlanError("under context parallelism the model must take its token positions from "
                                    "autopar.models.positions.token_positions (the zoo's Llama and GPT do); this "
                                    "one did not, so its position encodings would place every rank's chunks at "
                                    "the sequence's start: re-plan with cp=1")
                self._checked = True
            return out
        return forward


class _CPAttention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` on a rank's queries against every rank's K and V."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, **kw: Any) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            raise PlanError("context parallelism runs attention without an explicit mask or dropout; this "
                            "model's has one: re-plan with cp=1")
        if isinstance(q, DTensor):
            # tensor parallelism by DTensor propagation: each tp rank's heads (or all of them,
            # replicated) attend on its local tensors, K and V laid out as Q
            mesh, placements = q.device_mesh, q.placements
            if any(not (p.is_replicate() or (p.is_shard() and p.dim == 1)) for p in placements):
                raise PlanError(f"context parallelism under tensor parallelism needs the attention's query split "
                                f"along its heads or replicated, not {placements}; re-plan with tp=1")
            k, v = (x.redistribute(mesh, placements) if isinstance(x, DTensor) else x for x in (k, v))
            out = self._local_attention(q.to_local(), k.to_local(), v.to_local(), is_causal, **kw)
            return DTensor.from_local(out, mesh, placements, run_check=False)
        return self._local_attention(q, k, v, is_causal, **kw)

    def _local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         **kw: Any) -> torch.Tensor:
        cp = self.cp
        k = all_gather_single_autograd(k.contiguous(), gather_dim=k.dim() - 2, group=cp.group)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=v.dim() - 2, group=cp.group)
        mask = None
        if is_causal:
            mask = cp.positions.to(q.device)[:, None] >= cp.key_positions.to(q.device)[None, :]
        # the aten op, which no mode takes for the fused call (this function may run under the
        # cp mode: inside selective recomputation's region, `runtime.selective`)
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def unexecuted_parts(pp: int, ep: int) -> list[str]:
    """What of a context-parallel layout this runtime does not execute with it (empty where it
    runs): it runs it on one stage (tensor parallelism by DTensor propagation, any ZeRO stage
    over dp x cp, any recomputation) without expert parallelism in this version."""
    return [w for w, bad in (("pipeline stages", pp > 1), ("expert parallelism", ep > 1)) if bad]


def unexecuted(plan: Any) -> str:
    """Why this runtime does not execute `plan`'s context parallelism ("" where it does, or
    where the plan has none: `unexecuted_parts`)."""
    if plan.cp <= 1:
        return ""
    why = unexecuted_parts(plan.pp, plan.ep)
    return (f"context parallelism (cp={plan.cp}) is executed on one stage without "
            f"expert parallelism in this version; the plan has {', '.join(why)}"
            ) if why else ""


def check_executable(plan: Any) -> None:
    """PlanError unless this runtime executes the plan's context parallelism (`unexecuted`)."""
    why = unexecuted(plan)
    if why:
        raise PlanError(f"{why}: re-plan with Constraints(pp=1), or cp=1")
