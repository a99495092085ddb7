"""What a GPU rank runs where the CPU program differs: `autopar verify` of a plan for GPUs.

Verify builds and steps ranks on CPU fake tensors (a CPU-only torch cannot fake CUDA tensors
through autocast: its casts need a CUDA device guard), so a GPU plan's ranks would hold what the
CPU program holds. Five differences change what a step holds, and `cuda_program()` runs them as
CUDA does, for the ops the executor calls (a `TorchFunctionMode`: it sees `torch.ops.aten...`
and module code, above autograd as autocast is; backward ops are not autocast on either device;
not while the model's program is captured, `torch.compiler.is_exporting()`):

* autocast's op lists: under mixed precision CUDA runs layer norm, softmax, exp, rsqrt, ... in
  fp32 (saving the fp32 copy of the input and the fp32 output), CPU keeps them in the 2-byte
  dtype (`cost_models.memory`, module docstring). While CPU autocast is on, each op of CUDA's
  fp32 list (`cost_models.memory.CUDA_FP32_OPS`) runs on fp32 inputs, cast first (an
  autograd-recorded copy, as autocast's), and each op autocast gives an fp32 `dtype` instead
  (`CUDA_FP32_DTYPE_OPS`: sum, softmax, cumsum, prod, ...) is called with it;
* dropout: CUDA's `dropout` is the fused `native_dropout`, which saves a bool mask (1 byte per
  element) for its backward; CPU's is the composite `input * noise` that saves the scaled noise,
  a tensor like its input (`is_fused_kernel_acceptable` in aten's Dropout.cpp takes only CUDA
  inputs). CPU has the fused kernel too: a training dropout runs `native_dropout` here (same
  semantics: zeroes with probability p, scales the rest by 1/(1-p));
* attention with dropout: CUDA's flash and memory-efficient kernels take dropout and save q,
  k, v, the output and the fp32 log-sum-exp per query row (the dropout mask is re-made from the
  RNG state in the backward); CPU's flash kernel takes none, so CPU runs the math path, which
  saves fp32 probabilities and copies of q, k, v (`cost_models.memory.attention_is_fused`).
  `FusedDropoutAttention` keeps what the fused kernel keeps and computes attention by blocks of
  query rows (the backward re-makes each block's probabilities and mask from the saved RNG
  state), so no batch x heads x queries x keys tensor is held;
* RMSNorm: `aten.rms_norm` is CUDA's fused kernel there (`_fused_rms_norm`, torch 2.13), whose
  backward keeps the input and one fp32 rstd per row; on CPU it decomposes into fp32 ops that
  keep an fp32 copy of the input and the fp32 normalised tensor (twice the input, 4 B per
  element each, under bf16). `FusedRMSNorm` keeps what the fused kernel keeps and computes the
  same values (its backward is the kernel's formula);
* attention without dropout: CPU's flash kernel writes its output as its query is laid out,
  CUDA's kernels always [batch, queries, heads, dim] in memory, so that the heads' merge after
  them is a view (`cost_models.layouts`). A query the executor gathered along its heads is laid
  out in standard strides; CPU's kernel is handed it laid out as CUDA writes the output
  (`_query_as_cuda_lays_out`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from cost_models.memory import CUDA_FP32_DTYPE_OPS, CUDA_FP32_OUTPUT_OPS

__all__ = ["cuda_program", "FusedRMSNorm", "FusedDropoutAttention"]


def _op_name(func: Any) -> str:
    """aten's name of an op (`torch.ops.aten.layer_norm.default` -> layer_norm), or the
    function's (`torch.layer_norm`, `F.softmax`, `Tensor.softmax`)."""
    return str(getattr(func, "_opname", None) or getattr(func, "__name__", ""))


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm saving what CUDA's `_fused_rms_norm` saves for its backward: the input and the
    fp32 reciprocal RMS per row (the weight is a parameter, held anyway)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                eps: Optional[float]) -> torch.Tensor:
        dims = tuple(range(-len(normalized_shape), 0))
        xf = x.float()
        e = torch.finfo(torch.float32).eps if eps is None else eps
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + e)
        y = xf * rstd
        if weight is not None:
            y = y * weight
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, rstd, weight = ctx.saved_tensors
        dims = ctx.dims
        n = x.float() * rstd
        g = grad.float()
        gw = None
        if weight is not None:
            lead = tuple(range(g.dim() - len(dims)))
            gw = (g * n).sum(lead).to(weight.dtype) if ctx.needs_input_grad[2] else None
            g = g * weight
        gx = rstd * (g - n * (g * n).mean(dims, keepdim=True))
        return gx.to(x.dtype), None, gw, None


# query rows per block of `FusedDropoutAttention` (what it holds at once: heads x rows x keys fp32)
ATTENTION_ROW_BLOCK = 128


# calls of `FusedDropoutAttention` in this process: with `torch.initial_seed()`, each call's seed
ATTENTION_CALLS = itertools.count()


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed % 2**63)


def _attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    p: float, causal: bool, scale: float, r0: int, sq: int,
                    gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Attention of the query rows `q` (rows r0.. of a sequence of `sq` queries) in fp32 or wider
    (SDPA's math: scores, top-left causal mask, the mask added or applied, softmax with fully
    masked rows at zero, dropout, product with v); k and v already have q's heads."""
    r1 = r0 + q.shape[-2]
    at = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(at), k.to(at).transpose(-2, -1)) * scale
    if causal:
        rows = torch.arange(r0, r1, device=s.device)[:, None]
        cols = torch.arange(s.shape[-1], device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    if mask is not None:
        m = mask[..., r0:r1, :] if mask.dim() >= 2 and mask.shape[-2] == sq else mask
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(at)
    a = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    if p > 0:
        keep = torch.rand(a.shape, generator=gen, dtype=a.dtype, device=a.device) >= p
        a = a * keep / (1.0 - p)
    return torch.matmul(a, v.to(at))


class FusedDropoutAttention(torch.autograd.Function):
    """`scaled_dot_product_attention` with dropout as CUDA's fused kernels run it: saves q, k, v,
    the output and an fp32 log-sum-exp per query row (their saved tensors; the dropout mask is
    re-made from the generator's state in the backward), computed by blocks of
    `ATTENTION_ROW_BLOCK` query rows so that nothing of batch x heads x queries x keys is held."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                p: float, causal: bool, scale: Optional[float], gqa: bool) -> torch.Tensor:
        # the generator's seed, not its state (a 5 KB CPU tensor per call, where CUDA's kernels
        # keep two integers): the backward re-makes the masks from a generator seeded alike
        ctx.seed = torch.initial_seed() + next(ATTENTION_CALLS)
        ctx.gen = _generator(ctx.seed, q.device)
        ctx.args = (p, causal, scale if scale is not None else q.shape[-1] ** -0.5, gqa)
        sq = q.shape[-2]
        kh, vh = _heads(q, k, v, gqa)
        out = torch.cat([_attention_rows(q[..., r0:r0 + ATTENTION_ROW_BLOCK, :], kh, vh, mask, ctx.args[0], causal,
                                         ctx.args[2], r0, sq, ctx.gen)
                         for r0 in range(0, sq, ATTENTION_ROW_BLOCK)], dim=-2).to(q.dtype)
        del kh, vh
        if out.dim() == 4:
            # the kernels write [batch, queries, heads, dim] in memory: the heads' merge after
            # them (transpose, reshape) is a view, as `cost_models.layouts` says
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        del ctx.gen
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, _out, _lse, mask = ctx.saved_tensors
        p, causal, scale, gqa = ctx.args
        dq = torch.empty_like(q)
        at = torch.promote_types(q.dtype, torch.float32)
        dk = torch.zeros_like(k, dtype=at)
        dv = torch.zeros_like(v, dtype=at)
        gen = _generator(ctx.seed, q.device)
        sq = q.shape[-2]
        with torch.enable_grad():
            kd, vd = k.detach().requires_grad_(), v.detach().requires_grad_()
            kh, vh = _heads(q, kd, vd, gqa)
            for r0 in range(0, sq, ATTENTION_ROW_BLOCK):
                r1 = min(r0 + ATTENTION_ROW_BLOCK, sq)
                # the block's rows only: no query-sized gradient per block
                qd = q[..., r0:r1, :].detach().requires_grad_()
                o = _attention_rows(qd, kh, vh, mask, p, causal, scale, r0, sq, gen)
                gq, gk, gv = torch.autograd.grad(o, (qd, kd, vd), grad[..., r0:r1, :].to(at),
                                                 retain_graph=r1 < sq)
                dq[..., r0:r1, :] = gq
                dk += gk
                dv += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with q's heads (grouped-query attention repeats each key/value head)."""
    if gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        return k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    return k, v


def _fused_dropout_attention(args: Sequence[Any], kwargs: dict) -> Optional[torch.Tensor]:
    """An attention call with dropout as CUDA's fused kernels run it (`FusedDropoutAttention`);
    None where CPU runs a fused kernel anyway (no dropout), the mask needs a gradient (the fused
    kernels take none) or the tensors are DTensors (their own dispatch)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    a = dict(zip(names, defaults))
    a.update(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in a})
    q, k, v, mask, p = a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"]
    if (not isinstance(p, (int, float)) or p <= 0 or not all(isinstance(t, torch.Tensor) for t in (q, k, v))
            or any(isinstance(t, DTensor) for t in (q, k, v, mask))
            or (isinstance(mask, torch.Tensor) and mask.requires_grad)):
        return None
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(low) if t.is_floating_point() else t for t in (q, k, v))
    with torch.autocast("cpu", enabled=False):
        return FusedDropoutAttention.apply(q, k, v, mask, float(p), bool(a["is_causal"]), a["scale"],
                                           bool(a["enable_gqa"]))


def _query_as_cuda_lays_out(args: Sequence[Any], kwargs: dict) -> Sequence[Any]:
    """`args` of an attention call without dropout (CPU's flash kernel runs it), with the query
    laid out [batch, queries, heads, dim] in memory where it is not: CUDA's flash and
    memory-efficient kernels write their output so whatever the query's strides, CPU's flash
    kernel as its query is laid out (`cost_models.layouts._attention_out`). A query the
    executor gathered along its heads (a replicated attention reading a head-split RoPE
    output: `execute._gather` concatenates into standard strides) would give an output in
    standard strides, whose heads' merge (transpose, reshape) copies, where on CUDA it is a
    view: a column-parallel output projection then saved that copy, [b, s, h] a layer that a
    GPU does not hold (llama-small tp 4: +3.3% of the activations). The kernel saves the
    re-laid query in place of the one it was given (the same bytes); plain tensors only."""
    q = args[0]
    if (not isinstance(q, torch.Tensor) or isinstance(q, DTensor) or q.dim() != 4
            or q.stride(1) < q.stride(2) or q.shape[1] == 1 or q.shape[2] == 1):
        return args
    return (q.transpose(1, 2).contiguous().transpose(1, 2), *args[1:])


class cuda_program(TorchFunctionMode):
    """While active: CUDA's autocast fp32 list (when CPU autocast is on), its fused dropout,
    attention with dropout and RMSNorm.
    Autograd runs a checkpoint's recomputation without the modes of the forward (a
    TorchFunctionMode sees nothing inside the backward): the runtime's checkpoints enter
    `recompute_context()` there, which re-enters this mode when one is active."""

    active = 0          # how many are entered (verify steps one rank at a time in a process)

    def __enter__(self) -> "cuda_program":
        type(self).active += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        type(self).active -= 1
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if torch.compiler.is_exporting():
            return func(*args, **kwargs)      # capturing the model's program: its own ops
        if name == "rms_norm" and args:
            x, shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")
            return FusedRMSNorm.apply(x, tuple(shape), weight, eps)
        if name == "scaled_dot_product_attention" and args:
            fused = _fused_dropout_attention(args, kwargs)
            if fused is not None:
                return fused
            args = _query_as_cuda_lays_out(args, kwargs)
        if name == "dropout" and args:
            fused = _fused_dropout(args, kwargs)
            if fused is not None:
                return fused
        if name not in CUDA_FP32_OUTPUT_OPS or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype("cpu")
        if name in CUDA_FP32_DTYPE_OPS:
            # autocast's fp32_set_opt_dtype: a 2-byte input read as it is, with an fp32 dtype
            if kwargs.get("dtype") is None and any(isinstance(x, torch.Tensor) and x.dtype == low
                                                  for x in args[:1]):
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **{**kwargs, "dtype": torch.float32})
            return func(*args, **kwargs)

        def up(x: Any) -> Any:
            return x.to(torch.float32) if isinstance(x, torch.Tensor) and x.dtype == low else x

        args, kwargs = tree_map(up, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)


def _fused_dropout(args: Sequence[Any], kwargs: dict) -> Optional[torch.Tensor]:
    """A training dropout (`F.dropout(input, p, training, inplace)` or `aten.dropout(input, p,
    train)`) as CUDA's fused kernel runs it, `native_dropout`; None where CUDA runs no kernel
    either (p of 0 or 1, not training, empty) or the call is in place."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    if (not isinstance(x, torch.Tensor) or not train or inplace or not isinstance(p, (int, float))
            or not 0 < p < 1 or x.numel() == 0):
        return None
    return torch.native_dropout(x, float(p), True)[0]


def recompute_context() -> contextlib.AbstractContextManager:
    """The context a checkpoint's recomputation runs in: `cuda_program()` while one is active
    (so the re-run makes what the forward made: fp32 norms, the fused RMSNorm), else nothing."""
    return cuda_program() if cuda_program.active else contextlib.nullcontext()
