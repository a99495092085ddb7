"""A fused cross-entropy kernel, as the cost models see it (`SoftwareSpec.loss_kernel == "fused"`).

Eager PyTorch computes a language model's loss as the model writes it: the logits upcast to fp32
(`logits.float()`, or autocast's fp32 list), `log_softmax` saving its fp32 output, and a backward
holding fp32 gradients of the logits' size. A fused kernel (apex's xentropy, which the
flash-attn training stack runs with `inplace_backward: True`; flash-attn's Triton cross-entropy
since) reads the 2-byte logits, computes in fp32 registers, saves only the logits it was given and
one fp32 log-sum-exp per row, and writes the logits' gradient into their own storage.

`fuse_losses` rewrites a captured graph the way such software runs it, so that the time and
memory models price the fused kernel with their ordinary rules: every cross-entropy keeps its op
(`OpNode.op` stays "cross_entropy_loss": every rule keyed by op still applies) and is marked
fused by its target's overload (`FUSED_OVERLOAD`), and an fp32 upcast whose only reader is that
loss becomes a view of the logits (the kernel's own upcast in registers: no tensor, no traffic).
`cost_models.memory` then saves the logits at the training dtype plus the per-row statistic
(`saved_tensors`) and holds no gradient beside them (`activation_memory`'s `loss_read`).

`fuse_losses(graph, HALF_OVERLOAD)` rewrites it as software that runs the eager cross-entropy on
the 2-byte logits (`SoftwareSpec.loss_kernel == "half"`: NeMo AutoModel's `MaskedCrossEntropy`
with `fp32_upcast: false`, `F.cross_entropy` on bf16 logits): the upcast read only by the loss
becomes a view likewise, the loss keeps its eager kernels (`log_softmax` writing and saving the
log-probabilities, the backward their gradient and the logits'), each tensor at the training
dtype instead of fp32 (`cost_models.memory`, `cost_models.compute.fp32_extra_bytes`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.capture.flops import FUSED_LOSS_OPS, FUSED_OVERLOAD, HALF_OVERLOAD, is_fused_loss, is_half_loss, is_view

__all__ = ["fuse_losses", "is_fused_loss", "is_half_loss", "HALF_OVERLOAD"]
_CASTS = ("to", "_to_copy")


def _upcast(node: Any) -> bool:
    return node.kind == "call" and node.op in _CASTS and (
        "float32" in node.args[1:] or node.kwargs.get("dtype") == "float32")


def fuse_losses(graph: Any, overload: str = FUSED_OVERLOAD) -> Any:
    """A copy of `graph` (an `OpGraph`) whose cross-entropy losses run as one fused kernel each
    (`overload` FUSED_OVERLOAD) or eagerly on the 2-byte logits (HALF_OVERLOAD; see the module
    docstring); `graph` itself is left as it is. A graph with no such loss is returned as it is."""
    by_name = {n.name: n for n in graph.nodes}
    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    losses = [n for n in graph.nodes if n.kind == "call" and n.op in FUSED_LOSS_OPS and n.inputs
              and not is_fused_loss(n) and not is_half_loss(n)]
    if not losses:
        return graph
    changed: dict[str, Any] = {}
    for loss in losses:
        changed[loss.name] = replace(loss, target=f"aten.{loss.op}.{overload}")
        # back from the logits through views to an upcast read by nothing but this loss
        chain, cur = [], by_name.get(loss.inputs[0])
        while cur is not None and cur.kind == "call" and is_view(cur) and cur.inputs:
            chain.append(cur.name)
            cur = by_name.get(cur.inputs[0])
        if cur is None or not _upcast(cur) or not cur.inputs:
            continue
        if readers.get(cur.name, []) != ([chain[-1]] if chain else [loss.name]):
            continue
        if any(readers.get(v, []) != [w] for v, w in zip(chain, [loss.name] + chain[:-1])):
            continue
        changed[cur.name] = replace(cur, target="aten.alias.default", args=(cur.args[0],), kwargs={},
                                    flops=0.0, bytes_moved=0.0)
    return replace(graph, nodes=[changed.get(n.name, n) for n in graph.nodes])
