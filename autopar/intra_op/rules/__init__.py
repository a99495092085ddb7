"""Strategy rules: one module per op family, each registering its ops here.

A rule takes an `OpContext` (the node, its tensor inputs' shapes, the mesh) and returns every
valid `Strategy` of the op. `follow=True` marks ops that only follow one operand (element-wise
unary ops, views, softmax): the ILP merges them into that operand's choice (Alpa §4.2).

    matmul       linear mm addmm bmm baddbmm matmul convolution        (matmul.py)
    embedding    embedding                                             (embedding.py)
    norm         layer_norm rms_norm native_layer_norm                 (norm.py)
    softmax      softmax _softmax log_softmax _log_softmax             (softmax.py)
    attention    scaled_dot_product_attention (GQA; q heads over K/V)  (attention.py)
    elementwise  add mul div pow gelu silu relu dropout where ...      (elementwise.py)
    view         view reshape transpose permute split cat slice ...    (view.py)
    reduction    sum mean amax var ...                                 (reduction.py)
    loss         cross_entropy_loss nll_loss mse_loss ...              (loss.py)
    indexing     gather index_select index                            (indexing.py)
    creation     arange zeros full ...                                 (creation.py)

An op no rule knows runs replicated (all inputs gathered), with a warning naming it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from autopar.intra_op.strategy import OpContext, Strategy, replicate_strategy

log = logging.getLogger(__name__)

RuleFn = Callable[[OpContext], list[Strategy]]


@dataclass(frozen=True)
class Rule:
    op: str
    family: str
    fn: RuleFn
    follow: bool = False


_REGISTRY: dict[str, Rule] = {}
_WARNED: set[str] = set()


def register(*ops: str, family: str, follow: bool = False) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _REGISTRY[op] = Rule(op, family, fn, follow)
        return fn
    return deco


def rule_for(op: str) -> Optional[Rule]:
    _load()
    return _REGISTRY.get(op)


def registered_ops() -> dict[str, str]:
    """op -> family, for every op a rule covers."""
    _load()
    return {op: r.family for op, r in sorted(_REGISTRY.items())}


def strategies(ctx: OpContext) -> tuple[list[Strategy], str]:
    """The strategies of `ctx.node` and the family of the rule that gave them ("fallback" for
    unknown ops, which run replicated)."""
    rule = rule_for(ctx.node.op)
    if rule is not None:
        try:
            out = rule.fn(ctx)
        except Exception as e:  # noqa: BLE001 - an odd signature: run it replicated
            log.debug("rule %s failed on %s", rule.family, ctx.node.name, exc_info=True)
            out = []
            _warn(ctx.node.op, f"rule {rule.family} failed ({type(e).__name__}: {e})")
        n_in, n_out = len(ctx.in_metas), len(ctx.out_metas)
        bad = [st for st in out if len(st.in_specs) != n_in or len(st.out_specs) != n_out
               or len(st.grad_partial) != n_in]
        if bad:
            _warn(ctx.node.op, f"rule {rule.family} gave {len(bad[0].in_specs)} input layouts for "
                               f"{n_in} inputs")
            out = []
        if out:
            return out, rule.family
    else:
        _warn(ctx.node.op, "no sharding rule")
    return [replicate_strategy(ctx)], "fallback"


def _warn(op: str, why: str) -> None:
    if op not in _WARNED:
        _WARNED.add(op)
        warnings.warn(f"autopar.intra_op: {why} for op {op!r}; it runs replicated", stacklevel=3)


_LOADED = False


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from autopar.intra_op.rules import (  # noqa: F401
        attention,
        creation,
        elementwise,
        embedding,
        indexing,
        loss,
        matmul,
        norm,
        reduction,
        softmax,
        view,
    )
