"""Context parallelism as the runtime executes it: a stage's "cp" axis splits every sequence.

Each of the cp ranks holds two of the 2 cp equal chunks of every sample, i and 2 cp - 1 - i
(Llama 3's causal load balance, Dubey et al. 2024 section 3.3.2), taken from its data-parallel
rows (`ContextParallel.local_tokens`). Every op but attention is token-local and runs as is on
the rank's tokens; the model reads their positions in the whole sequence through
`models.positions.token_positions` (set for the step by `ContextParallel.active`); a model that
makes its own (a Hugging Face model wrapped by its user) runs as its program traced at the
rank's tokens, its positions `arange`s made the op that reads them and a shift of its labels
inside it done on the whole sequence before the split (`capture.own_positions`,
`ContextParallel.adopt_positions`, `split_input`). Each fused
attention call (`F.scaled_dot_product_attention`, causal or unmasked) is taken over by a torch
function mode entered by every module's forward (`ContextParallel.install`: a recomputation
re-runs a checkpointed module's forward inside the backward, where no mode entered around the
step is active): K and V are all-gathered along the sequence over the cp group with torch's
autograd functional collective (its backward reduce-scatters their gradients). Unmasked, the
rank's queries attend to them as gathered (one call). Causal, as Llama 3 and torchtitan run it:
K and V are put in sequence order (one copy each, `ContextParallel.key_prefixes`) and each of
the rank's two query chunks attends to the keys up to its own end in one call, query chunk i to
keys [0, (i + 1) c) and chunk 2 cp - 1 - i to [0, (2 cp - i) c), under a causal mask aligned to
the bottom right (`causal_lower_right`, `_causal_lower_right`): no mask of the rank's queries by
the sequence is made. The two outputs are concatenated in the rank's order, laid out as one
fused kernel lays out its output (tokens outer, heads inner: the model's
`out.transpose(1, 2).reshape(...)` stays a view of it). Under selective recomputation that
function is the region the selective checkpoint re-runs, its gather included
(`runtime.selective.fused_call_override`). Parameters' gradients are averaged over dp x cp (the
engine's sync group). A loss that is a mean over tokens (`F.cross_entropy`, `F.nll_loss`: mean
reduction, class-index targets, no class weights), which on a rank would be the mean over its
own tokens that count (targets other than `ignore_index`, in number unequal across ranks where
some are ignored: BERT's masked LM), is made the cp group's mean, as Megatron does: the rank's
count of them is all-reduced over the cp group (one all-reduce of one number per loss call, i.e.
per micro-batch: `inter_op.context_parallel.collectives` predicts it) and the rank's loss scaled
by count x cp / total, so the cp group's average of the gradients and of the reported losses is
one process's on those sequences (dp replicas, as without cp, average their own means). Another
loss stays the rank's tokens' mean: equal to one
process's only where every rank holds as many of the tokens it averages (a mean over every
position, as a causal LM's without ignored targets).

What runs the bottom-right causal mask (read in torch 2.13's `torch.nn.attention.bias`; the CPU
path measured, the CUDA one not run here): on CUDA, `F.scaled_dot_product_attention` with a
`torch.nn.attention.bias.CausalBias` (`CausalBias._dispatch`) calls the flash kernel
(`_scaled_dot_product_flash_attention`, whose causal mask is bottom-right aligned; fp16/bf16,
sm80 and later) or else the memory-efficient one (`_efficient_attention_forward` with
`custom_mask_type=2`, fp32 too): no mask tensor. Where neither applies (CPU; dtypes or head
sizes they refuse on CUDA) it materialises the (query, key) bool mask in every call, which the
kernel converts to q's dtype and saves. `is_causal=True` means top-left alignment unless square
(torch routes a non-square causal call away from the flash kernel for that reason). So on CPU
the runtime passes an additive mask in q's dtype, made once per shape in a micro-batch
(`ContextParallel.causal_mask`) and shared by every layer's call: (S / 2 cp) x (i + 1) S / 2 cp
and (S / 2 cp) x (2 cp - i) S / 2 cp elements, not a (S / cp) x S mask per layer. A square call
(chunk 0's) runs with `is_causal=True`, no mask on any device.

A stage run op by op as solved (tensor parallelism with `op_layouts`: `autopar.intra_op.execute`)
does not call the modules' forwards: its program is exported at the rank's tokens, positions an
op read when it runs, and the executor hands its attention op (on each tp rank's heads) and its
loss to `ProgramContext`, which runs them as above.

torch's `context_parallel` (torch.distributed.tensor.experimental) is not used: it takes over
the CUDA flash / efficient / cuDNN attention ops only, not the CPU kernel gloo runs reach.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.tensor import DTensor
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.overrides import TorchFunctionMode

from autopar.inter_op.context_parallel import unexecuted_parts
from autopar.models.positions import positions_set, reads, traced_op
from autopar.runtime.selective import fused_call_override
from autopar.schema import PlanError


def chunk_order(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) rank `rank` of cp holds."""
    return rank, 2 * cp - 1 - rank


def chunk_positions(rank: int, cp: int, seq: int) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens of a `seq`-token sequence, in its order."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_order(rank, cp)])


def sequence_order(cp: int) -> list[int]:
    """The 2 cp chunks of an all-gather of every rank's tokens (rank r's chunks r and
    2 cp - 1 - r at places 2 r and 2 r + 1) in sequence order: entry g is the place of chunk g."""
    place = {chunk: i for i, chunk in enumerate(x for r in range(cp) for x in chunk_order(r, cp))}
    return [place[g] for g in range(2 * cp)]


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
        self.order = sequence_order(size)     # the gathered chunks in sequence order
        self._masks: dict[tuple, torch.Tensor] = {}     # `causal_mask`'s, by shape, dtype, device
        # model inputs the model shifts along the sequence itself, shifted here on the whole
        # sequence before the split (`capture.own_positions`): input index -> (places, fill)
        self.shifts: dict[int, tuple[int, Any]] = {}

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s tokens (dim 1, the whole sequence) this rank holds; other tensors as they are."""
        if x.dim() < 2 or x.shape[1] != self.seq:
            return x
        c = self.seq // (2 * self.size)
        return torch.cat([x.narrow(1, i * c, c) for i in chunk_order(self.rank, self.size)], dim=1)

    def split_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Model input `i` (a batch of whole sequences) as this rank holds it: shifted first
        where the model shifts it along the sequence itself (`shifts`: taken out of the program
        it runs, `capture.own_positions`), so that each chunk's last token reads the next
        chunk's first, then its tokens (`local_tokens`)."""
        if i in self.shifts and x.dim() >= 2 and x.shape[1] == self.seq:
            k, fill = self.shifts[i]
            tail = torch.full((x.shape[0], k, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
            x = torch.cat([x.narrow(1, k, self.seq - k), tail], dim=1)
        return self.local_tokens(x)

    def adopt_positions(self, traced: nn.Module, trace_whole: Callable[[int], nn.Module],
                        inputs: dict[str, int]) -> None:
        """Program `traced` (a rank's tokens) made to take the rank's positions where the model
        makes its own (`capture.own_positions.adopt`, against `trace_whole(seq)`, its trace at
        the whole sequence), the inputs it shifts itself noted (`split_input`)."""
        from autopar.capture.own_positions import adopt

        self.shifts.update(adopt(traced, trace_whole, self.seq // self.size, self.seq, inputs))

    def adopt_chunks(self, chunks: list, split: Callable[[tuple], list], example: tuple) -> None:
        """`adopt_positions` for traced pipeline chunks (`graph_stages.Chunk`s cut from the
        model at a rank's tokens `example`; `split(inputs)`: the same cut at other inputs)."""
        from autopar.capture.own_positions import adopt_chunks, widened
        from autopar.models.positions import traced_positions

        l = self.seq // self.size

        def whole(s: int) -> list[nn.Module]:
            with traced_positions():
                return [ch.module for ch in split(widened(example, l, s))]

        inputs = [{h.name: i for h, (kind, i) in zip([n for n in ch.module.graph.nodes if n.op == "placeholder"],
                                                     ch.sources) if kind == "input"} for ch in chunks]
        self.shifts.update(adopt_chunks([ch.module for ch in chunks], whole, l, self.seq, inputs))

    def key_prefixes(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, ...]:
        """`x` all-gathered over the cp ranks (dim -2: every rank's tokens in rank order) in
        sequence order, its first `lengths[j]` tokens for each j (`_KeyPrefixes`)."""
        return _KeyPrefixes.apply(x, self.order, lengths)

    def causal_mask(self, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive (q_len, kv_len) causal mask aligned to the bottom right (query r sees
        keys up to kv_len - q_len + r), made once per shape in a micro-batch's forward and
        backward (`active`): the kernels that take it save it by reference, so the layers share
        one."""
        key = (q_len, kv_len, dtype, device)
        if key not in self._masks:
            keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
            self._masks[key] = torch.zeros(q_len, kv_len, dtype=dtype, device=device).masked_fill_(
                ~keep, float("-inf"))
        return self._masks[key]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """A forward (and its backward's recomputation) on this rank's tokens: their positions
        for the model, and (the outermost installed module's forward entering it) the attention
        over the gathered keys and values."""
        self._masks = {}
        try:
            with positions_set(self.positions):
                yield
        finally:
            self._masks = {}

    def program(self) -> "ProgramContext":
        """What the op-by-op executor (`autopar.intra_op.execute`) needs to run a program of this
        rank's tokens under this context parallelism (`ProgramContext`)."""
        return ProgramContext(self)

    def install(self, root: nn.Module, check: bool = True) -> None:
        """Every module of `root` runs its forward under the attention mode unless an enclosing
        forward already does (an instance attribute, set before recomputation wraps them, so a
        checkpointed module's re-run forward enters it too). `check=False` where the caller
        checked that the model reads its positions (`check_traced_positions`: a pipeline chunk
        may hold no op that reads them, the zoo GPT's chunks after its embedding)."""
        self._checked = self._checked or not check
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
                                    "autopar.models.positions.token_positions (the zoo's Llama and GPT do) or "
                                    "make them as an arange in a program the pipeline tracer can trace (a Hugging "
                                    "Face model does); this one did neither, so its position encodings would "
                                    "place every rank's chunks at the sequence's start: re-plan with cp=1")
                self._checked = True
            return out
        return forward


class _KeyPrefixes(torch.autograd.Function):
    """(x, order, lengths) -> for each length L, the first L tokens (dim -2) of `x`'s chunks
    taken in `order` (x: every rank's tokens in rank order, `order`: `sequence_order`), views of
    one sequence-ordered copy. Its backward writes the prefixes' gradients straight back in rank
    order, chunk by chunk (the longest one's, the others' added where they overlap, zeros past
    it): one full-length buffer, where narrow's backward would zero-fill one per prefix and the
    reordering's another."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: list[int], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        c = x.shape[-2] // len(order)
        ctx.shape, ctx.order, ctx.lengths = x.shape, order, lengths
        ordered = torch.cat([x.narrow(-2, place * c, c) for place in order], dim=-2)
        return tuple(ordered.narrow(-2, 0, length) for length in lengths)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], None, None]:
        n = len(ctx.order)
        c = ctx.shape[-2] // n
        live = [(g, length) for g, length in zip(grads, ctx.lengths) if g is not None]
        if not live:
            return None, None, None
        out = live[0][0].new_empty(ctx.shape)
        for chunk, place in enumerate(ctx.order):
            dst = out.narrow(-2, place * c, c)
            parts = [g.narrow(-2, chunk * c, c) for g, length in live if length > chunk * c]
            if not parts:
                dst.zero_()
            elif len(parts) == 1:
                dst.copy_(parts[0])
            else:
                torch.add(parts[0], parts[1], out=dst)
                for p in parts[2:]:
                    dst.add_(p)
        return out, None, None


# the token-mean losses made the cp group's mean (`_CPAttention._group_mean`), with their signatures
_TOKEN_MEAN_LOSSES = {f: inspect.signature(f) for f in (F.cross_entropy, F.nll_loss)}
# the same losses as a traced program (a pipeline chunk, `graph_stages`) calls them: aten ops whose
# `reduction` is an int (`torch.nn._reduction.get_enum`: 1 is the mean)
_ATEN_LOSSES = {torch.ops.aten.cross_entropy_loss.default: ("input", "target", "weight", "reduction",
                                                            "ignore_index", "label_smoothing"),
                torch.ops.aten.nll_loss.default: ("input", "target", "weight", "reduction", "ignore_index")}
_ATEN_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
# the fused attention as a traced program calls it, its arguments after q, k, v in order
_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _aten_loss_arguments(func: Any, args: tuple, kwargs: dict) -> dict:
    """A traced loss call's arguments by name, its reduction as `F.cross_entropy` spells it."""
    a = {**_ATEN_DEFAULTS, **dict(zip(_ATEN_LOSSES[func], args)), **kwargs}
    a["reduction"] = {0: "none", 1: "mean", 2: "sum"}.get(a["reduction"], a["reduction"])
    return a


def _token_mean(a: dict) -> bool:
    """Whether a loss call's bound arguments `a` average over the tokens whose target is not
    `ignore_index` (mean reduction, class-index targets, no class weights)."""
    reduction = a["reduction"]
    if a.get("size_average") is not None or a.get("reduce") is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    t = a["target"]
    return reduction == "mean" and a["weight"] is None and isinstance(t, torch.Tensor) and not t.is_floating_point()


class _CPAttention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` on a rank's queries against every rank's K and V, and a
    token-mean loss as the mean over the cp group's tokens (the module docstring)."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp
        self._busy = 0      # attention calls running (their own kernel calls run as they are)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _TOKEN_MEAN_LOSSES or func in _ATEN_LOSSES:
            return self._group_mean(func, args, kwargs)
        if func is _ATEN_SDPA and not self._busy:
            # a traced program's fused attention (a pipeline chunk, `graph_stages`)
            named = dict(zip(_SDPA_ARGS, args[3:]))
            return self.attention(*args[:3], **named, **kwargs)
        if func is not F.scaled_dot_product_attention or isinstance(kwargs.get("attn_mask"), CausalBias):
            # a chunk's call over the gathered keys (`_causal_lower_right`) runs as it is
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)

    def _group_mean(self, func: Any, args: tuple, kwargs: dict, out: Any = None) -> Any:
        """The loss `func(*args, **kwargs)` (`out` where already computed), a mean over this
        rank's counted tokens, scaled to count x cp / (the cp group's count): one all-reduce of
        the count over the group."""
        out = func(*args, **kwargs) if out is None else out
        if func in _ATEN_LOSSES:
            a = _aten_loss_arguments(func, args, kwargs)
        else:
            bound = _TOKEN_MEAN_LOSSES[func].bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
        if not _token_mean(a):
            return out
        t = a["target"]
        t = t.full_tensor() if isinstance(t, DTensor) else t
        n = (t != a["ignore_index"]).sum().to(torch.float64)
        total = n.clone()
        if self.cp.size > 1 and dist.is_initialized():
            dist.all_reduce(total, group=self.cp.group)
        local = out.to_local() if isinstance(out, DTensor) else out
        # a rank with no counted token has a NaN mean (0 / 0): it adds nothing
        local = torch.where(n > 0, local * (n * self.cp.size / total).to(local.dtype), torch.zeros_like(local))
        return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False) \
            if isinstance(out, DTensor) else local

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, **kw: Any) -> torch.Tensor:
        self._busy += 1
        try:
            return self._attention(q, k, v, attn_mask, dropout_p, is_causal, **kw)
        finally:
            self._busy -= 1

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                   dropout_p: float, is_causal: bool, **kw: Any) -> torch.Tensor:
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
        if not is_causal:
            # the aten op, which no mode takes for the fused call (this function may run under
            # the cp mode: inside selective recomputation's region, `runtime.selective`)
            return torch.ops.aten.scaled_dot_product_attention(q, self._gathered(k), self._gathered(v), **kw)
        c = q.shape[-2] // 2
        chunks = chunk_order(cp.rank, cp.size)
        lengths = [(i + 1) * c for i in chunks]
        # each gathered copy freed once its sequence-ordered one is made
        ks, vs = (cp.key_prefixes(self._gathered(x), lengths) for x in (k, v))
        outs = [self._causal_lower_right(q.narrow(-2, j * c, c), ks[j], vs[j], **kw) for j in range(len(chunks))]
        # tokens outer, heads inner, as a fused kernel lays out its output
        return torch.cat([o.transpose(-3, -2) for o in outs], dim=-3).transpose(-3, -2)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """`x` all-gathered along the sequence (dim -2) over the cp group, in rank order."""
        return all_gather_single_autograd(x.contiguous(), gather_dim=x.dim() - 2, group=self.cp.group)

    def _causal_lower_right(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        """Causal attention of the last q_len of kv_len tokens (the mask aligned to the bottom
        right) without a mask tensor where the kernel allows (see the module docstring)."""
        q_len, kv_len = q.shape[-2], k.shape[-2]
        if q_len == kv_len:
            return torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        if q.device.type != "cpu":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, kv_len), **kw)
        if _as_cuda_on_fake(q):
            # `autopar verify` of a GPU plan: CUDA's flash kernel takes the bottom-right mask
            # without a tensor and saves what CPU's flash kernel saves (the output and the
            # log-sum-exp); on fake tensors no value is computed, so the mask is left out rather
            # than held as CPU's (S / 2 cp) x S additive mask (2 GiB of Llama 3 8B at 131072
            # tokens on cp 8, 4 GiB at cp 4, which the memory model rightly does not count)
            return torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        mask = self.cp.causal_mask(q_len, kv_len, q.dtype, q.device)
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def _as_cuda_on_fake(q: torch.Tensor) -> bool:
    """Whether `q` is a fake tensor of a rank run as CUDA runs it (`cuda_program`, verify)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from autopar.runtime.cuda_program import cuda_program

    return bool(cuda_program.active) and isinstance(q, FakeTensor)


class ProgramContext:
    """Context parallelism for the op-by-op executor (`autopar.intra_op.execute`, a stage with
    solved per-op layouts): the program it runs is exported at this rank's tokens (the
    micro-batch's S / cp of every sequence, `ContextParallel.local_tokens`) with the positions
    recorded as the `autopar::token_positions` op (`models.positions.traced_positions`: read
    when the program runs, the rank's, `ContextParallel.active`, as the traced pipeline chunks
    read theirs), its nodes named as the capture the plan was solved on names them
    (`execute.positions_named_as_captured`). Every op but attention is token-local and runs as
    solved; the executor hands the fused attention op, on its tp-local heads, to `attention`
    (K and V all-gathered over the cp group, `_CPAttention`), and a token-mean loss's output to
    `loss` (the cp group's mean: one all-reduce of the rank's count)."""

    def __init__(self, cp: ContextParallel) -> None:
        self.cp = cp
        self._mode = _CPAttention(cp)

    def attention(self, target: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The fused attention op `target` (aten's `scaled_dot_product_attention` as exported)
        on local tensors: the rank's queries against every cp rank's keys and values."""
        if target is not _ATEN_SDPA:
            raise PlanError(f"context parallelism runs the fused attention op, not {target}; re-plan with cp=1")
        return self._mode.attention(*args[:3], **dict(zip(_SDPA_ARGS, args[3:])), **kwargs)

    def loss(self, target: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """`out` of loss op `target`: a token-mean loss made the cp group's mean (`_group_mean`),
        other losses as they are."""
        if target not in _ATEN_LOSSES:
            return out
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if isinstance(t, DTensor) and any(p.is_shard() for p in t.placements):
            # a loss over a batch split by the solution (`execute._shard_loss`): each tp rank's
            # mean over its rows' tokens, summed; made the cp group's mean over those rows
            t = t.to_local()
            args, kwargs = ((args[0], t, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "target": t})
        return self._mode._group_mean(target, args, kwargs, out)

    def check(self, program: Any) -> None:
        """PlanError unless `program` reads the tokens' positions (`check_traced_positions`)."""
        check_traced_positions([program.graph_module], "exported for the executor")


def unexecuted(plan: Any) -> str:
    """Why this runtime does not execute `plan`'s context parallelism ("" where it does, or
    where the plan has none: `unexecuted_parts`)."""
    if plan.cp <= 1:
        return ""
    why = unexecuted_parts(plan.ep, plan.tp, plan.pp)
    return (f"context parallelism (cp={plan.cp}) is executed with expert and tensor parallelism only in "
            f"one stage in this version; the plan has {', '.join(why)}") if why else ""


def check_executable(plan: Any) -> None:
    """PlanError unless this runtime executes the plan's context parallelism (`unexecuted`)."""
    why = unexecuted(plan)
    if why:
        raise PlanError(f"{why}: re-plan with Constraints(ep=1), or cp=1")


def check_traced_positions(chunks: list[nn.Module], how: str = "traced into pipeline stages") -> None:
    """PlanError unless the pipeline chunks (or the executor's program) traced under
    `models.positions.traced_positions` (a rank's chunks of every sequence) read the tokens'
    positions somewhere: a model that makes its own `arange` would have it baked in at the
    traced length, every rank's chunks placed at the sequence's start. `how`: how the model was
    traced, for the message."""
    op = traced_op()
    for root in chunks:
        for mod in root.modules():
            g = getattr(mod, "graph", None)
            if isinstance(g, torch.fx.Graph) and any(n.op == "call_function" and n.target is op for n in g.nodes):
                return
    raise PlanError("under context parallelism the model must take its token positions from "
                    f"autopar.models.positions.token_positions (the zoo's Llama and GPT do); this one did not "
                    f"when {how}, so its position encodings would place every rank's "
                    "chunks at the sequence's start: re-plan with cp=1")
