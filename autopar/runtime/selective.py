"""Selective recomputation (Korthikanti et al. 2022) as torch's selective activation checkpointing.

The plan names the ops re-run in the backward (`StagePlan.recompute_ops`: each layer's attention
core, found by the planner from the captured ops, `cost_models.memory.selective_ops`). They run
under `torch.utils.checkpoint` with an op-level policy
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the named ops MUST_RECOMPUTE,
any other op MUST_SAVE. Everything outside the region saves as without recomputation, so the
backward keeps Q, K, V (the region's inputs) and the core's output (its reader, the output
projection, saves it) and re-makes what the core saves of its own: with unfused attention the
probabilities, the dropout's mask and output; with a fused kernel only its log-sum-exp.

A stage run op by op as solved (`intra_op.execute`) checkpoints the run of those ops itself, the
policy deciding by the op being run. A stage run module by module cannot cut inside a module's
forward: there the core must be one call (`FUSED_CALLS`, a fused attention op), which a
`TorchFunctionMode` installed on the module holding it (`StagePlan.recompute_modules`) runs under
the selective checkpoint; where the core spans several calls the planner checkpoints the module
whole, costs it so (`inter_op.layers.Layer.selective_region`) and records that in the plan
(`Plan.search["selective_fallback"]`).
"""

from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.runtime.validate import get_submodule
from autopar.schema.errors import PlanError

# capture op kind -> the torch function a module-cut stage intercepts to recompute it alone
FUSED_CALLS: dict[str, Callable[..., Any]] = {"scaled_dot_product_attention": F.scaled_dot_product_attention}
# what runs in place of a fused call where another part of the runtime takes it over
# (context parallelism's attention over gathered keys and values): the selective region is
# that function, so the backward's recomputation re-runs it, not the plain call
_OVERRIDES: ContextVar[Optional[dict]] = ContextVar("autopar_fused_call_overrides", default=None)


@contextlib.contextmanager
def fused_call_override(func: Callable[..., Any], impl: Callable[..., Any]) -> Iterator[None]:
    """Within it, a selectively recomputed call of `func` runs (and re-runs) `impl` instead."""
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), func: impl})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def _override(func: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    return (_OVERRIDES.get() or {}).get(func)


def op_kind(name: str) -> str:
    """The kind of a captured op from its name (`scaled_dot_product_attention_3` ->
    `scaled_dot_product_attention`): torch.export names ops by their target, copies numbered."""
    return re.sub(r"_\d+$", "", name)


def runs_as_one_call(ops: list[str]) -> bool:
    """Whether each of `ops` is a call a module-cut stage recomputes alone (`FUSED_CALLS`)."""
    return all(op_kind(o) in FUSED_CALLS for o in ops)


def selective_context(recompute: Callable[[], bool]) -> Callable[[], tuple]:
    """A `context_fn` for `torch.utils.checkpoint`: the op being dispatched MUST_RECOMPUTE when
    `recompute()` holds, else MUST_SAVE (torch's selective activation checkpointing)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_RECOMPUTE if recompute() else CheckpointPolicy.MUST_SAVE

    def contexts() -> tuple:
        fwd, rc = create_selective_checkpoint_contexts(policy)
        return fwd, recomputation_context(rc)

    return contexts


@contextlib.contextmanager
def recomputation_context(*first: Any) -> Any:
    """What a checkpoint's backward re-run runs under (its `context_fn`'s second context): the
    context managers `first` (torch's selective policy), then the CUDA program's recompute
    context and the label a tracked step files the re-run's tensors under
    (`memory_tracking.recomputing`); exited in reverse."""
    from autopar.runtime.cuda_program import recompute_context
    from autopar.runtime.memory_tracking import recomputing

    with contextlib.ExitStack() as stack:
        for cm in (*first, recompute_context(), recomputing()):
            stack.enter_context(cm)
        yield


def checkpoint_selective(fn: Callable[..., Any], *args: Any, recompute: Callable[[], bool] = lambda: True,
                         early_stop: bool = True, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` under torch's non-reentrant checkpoint with the policy of
    `selective_context(recompute)`."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_context(recompute),
                      early_stop=early_stop, **kwargs)


# a fused call as a traced program makes it (a pipeline chunk cut from the traced model,
# `graph_stages`): the aten op, its positional arguments in the torch function's order
_TRACED_CALLS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention}
# the keywords of a fused call's arguments after its first three (q, k, v)
_KEYWORDS: dict[Callable[..., Any], tuple[str, ...]] = {
    F.scaled_dot_product_attention: ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")}


class _CoreCalls(TorchFunctionMode):
    """Runs each call of `funcs` made inside it (or of the aten op a traced module makes of it,
    `_TRACED_CALLS`) under the selective checkpoint, all its ops MUST_RECOMPUTE; every other
    call runs as it is."""

    def __init__(self, funcs: set[Callable[..., Any]]) -> None:
        super().__init__()
        self.funcs = funcs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fused = _TRACED_CALLS.get(func, func)
        if fused in self.funcs:
            impl = _override(fused)
            if impl is not None and func is not fused:
                # the override takes the torch function's keywords: the aten op's are positional
                kwargs = {**dict(zip(_KEYWORDS[fused], args[3:])), **kwargs}
                args = args[:3]
            return checkpoint_selective(impl or func, *args, **kwargs)
        return func(*args, **kwargs)


def recompute_core_calls(module: nn.Module, ops: list[str]) -> None:
    """Recompute, in `module`'s forward, each call of the functions the captured `ops` are
    (`FUSED_CALLS`) under the selective checkpoint. Refused (PlanError) for ops that are not one
    call: a module-cut stage cannot cut a run of several calls out of a forward."""
    if not runs_as_one_call(ops):
        odd = sorted({op_kind(o) for o in ops} - FUSED_CALLS.keys())
        raise PlanError(f"recompute_ops names {', '.join(odd)}, which a stage run module by module cannot "
                        f"recompute alone (only a fused attention call: {', '.join(FUSED_CALLS)}); re-plan "
                        f"with `autopar plan`, which checkpoints such a module whole")
    funcs = {FUSED_CALLS[op_kind(o)] for o in ops}
    orig = module.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        with _CoreCalls(funcs):
            return orig(*args, **kwargs)

    module.forward = fwd  # instance attribute: hooks (fully_shard) still run around __call__


def apply_selective(root: nn.Module, modules: list[str] | None, ops: list[str]) -> None:
    """Recompute `ops` (a stage's `recompute_ops`) in each of `modules` (its `recompute_modules`,
    the modules holding the attention cores) inside `root`."""
    for fqn in modules or ():
        recompute_core_calls(get_submodule(root, fqn), ops)
