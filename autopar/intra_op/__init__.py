"""Intra-operator auto-sharding (Alpa §4): one ILP picks a sharding strategy for every op of a
stage on a logical mesh, minimising the training step's compute and communication (forward,
backward, gradient synchronisation) under a memory bound.

    sol = auto_shard(model, example_inputs, mesh=LogicalMesh(shape=(2, 4), alpha=..., beta=...))
    sol = solve_graph(graph.at_batch(8), mesh, nodes=[n.name for n in graph.layer_nodes("blocks.0")])
    sol.param_placements, sol.input_placements, sol.collectives, sol.objective, sol.explain("linear")

Modules: `placement` (layouts and the collectives between them), `strategy` (the label-based
enumerator), `rules/` (one module per op family), `ilp` (the formulation and CP-SAT),
`solution` (what comes back).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Sequence

from autopar.capture.graph import OpGraph
from autopar.intra_op.dims import batch_dims_of, token_dims_of
from autopar.intra_op.ilp import IntraOpProblem
from autopar.intra_op.solution import Collective, OpChoice, ShardingSolution
from autopar.schema.errors import PlanError
from autopar.schema.mesh import LogicalMesh

__all__ = ["auto_shard", "solve_graph", "batch_dims_of", "token_dims_of", "ShardingSolution", "Collective", "OpChoice",
           "IntraOpProblem"]


def solve_graph(graph: OpGraph, mesh: LogicalMesh, *, memory_budget_bytes: Optional[float] = None,
                dtype: str = "fp32", nodes: Optional[list[str]] = None, time_limit_s: float = 10,
                merge: bool = True, share_layers: bool = True, backend: str = "cbc",
                interleaved_splits: bool = True, cyclic_boundary: bool = False,
                batch_dims: Optional[dict[str, tuple[int, ...]]] = None,
                token_dims: Optional[dict[str, tuple[int, ...]]] = None,
                model_axes: Sequence[int] = (),
                fixed_params: Optional[dict[str, tuple[str, ...]]] = None,
                grad_inputs: Optional[set[str]] = None, sequence_parallel: bool = False,
                attention_kernel: str = "fused", pointwise_fusion: str = "eager",
                autocast: bool = True, fixed_inputs: Optional[dict[str, tuple[str, ...]]] = None,
                fixed_outputs: Optional[dict[str, tuple[str, ...]]] = None,
                leaving: Optional[Sequence[str]] = None,
                fixed_ops: Optional[dict[str, str]] = None) -> ShardingSolution:
    """Shard the ops of `graph` (at a concrete batch) over `mesh`.

    `nodes` restricts the problem to those call nodes (one layer, to cost a layer): tensors
    they read from outside come in with whatever layout suits them, at no cost. Identical layers
    (same `layer_signature`) share one set of choices. `backend`: "cbc" (default; the LP
    relaxation of this formulation is nearly tight, so branch-and-cut closes it fast), "highs",
    "scip" or "cp-sat". `interleaved_splits`: a fused projection's output (QKV) split along
    its split feature dim costs nothing, the weight's rows being chunk-interleaved
    (`sol.param_layouts`, Megatron's layout); with False the split needs the whole dim (an
    all-gather), as DTensor runs a contiguously sharded fused weight. `cyclic_boundary` (with
    `nodes` one layer of a stack): the tensor entering the layer comes in the layout its output
    leaves in, a reshard charged otherwise (steady state of identical layers), instead of for
    free. `model_axes` with `batch_dims` and `token_dims` (node name -> the dims of its output
    that carry the batch, or tokens: `batch_dims_of(graph)`, `token_dims_of(graph)` of the whole
    captured graph): no tensor may be split along such a dim on those mesh axes, which are then
    pure tensor (model) parallelism, as the runtime executes a "tp" axis (no data, sequence or
    Ulysses parallelism on it). `fixed_params` (parameter FQN -> its placement per mesh axis)
    pins those parameters (one placement of a weight read by several separately solved
    layers). `grad_inputs`: graph inputs whose gradient the backward pass computes (with
    `nodes`, the tensors entering the layer from an earlier one: their gradients' way back is
    costed like any activation's). `sequence_parallel` (with `model_axes`): the token dims may
    be split there between the weight GEMMs (Megatron-SP, Korthikanti et al. 2022: norms, dropout
    and residual adds on sequence slices; a row-parallel output reduce-scattered into them, an
    all-gather before the next column-parallel GEMM), the batch still whole; the solution then
    carries no `model_axes` (the executor reduce-scatters as solved). `attention_kernel`: how
    the software runs attention (`SoftwareSpec.attention_kernel`; "fused", what `autopar run`
    runs, by default): its time and what it saves. `pointwise_fusion`: whether the software runs
    a chain of element-wise ops as one kernel (`SoftwareSpec.pointwise_fusion`; "eager", one
    kernel per op, what `autopar run` runs, by default). `autocast`: the software's mixed
    precision (`SoftwareSpec.autocast`: which tensors of a bf16 run are fp32, priced at 4 bytes an
    element). Layer boundaries (with `nodes` one layer; a stage's layers are solved apart, and
    the executor runs their solutions one after another, so they must meet): `fixed_inputs`
    (tensor entering the layer -> the layout the layer making it leaves it in): each arrives
    so, and a reader wanting another layout pays the redistribution here, where the executor
    runs it; `fixed_outputs` (op -> layout): those ops produce their output so (the output the
    next copy of a stack of identical layers receives, in the layout this copy received it);
    `leaving` (ops whose output a later layer reads): none hands on a partial sum on a model
    axis. `fixed_ops` (op -> one of its strategies' names, e.g. "c@0 (vocab-parallel)"): those
    ops run so (a plan of the analytic rules runs Megatron's vocabulary-parallel embedding and
    loss as the rules price them, `inter_op.pinned_layouts`); PlanError where an op has no
    such strategy. Raises PlanError when nothing fits `memory_budget_bytes`.
    """
    gc_was_on = gc.isenabled()
    gc.disable()     # the captured graph holds many objects; collections would dominate the build
    try:
        prob = IntraOpProblem(graph, mesh, nodes=nodes, memory_budget_bytes=memory_budget_bytes,
                              dtype=dtype, merge=merge, share_layers=share_layers,
                              interleaved_splits=interleaved_splits, cyclic_boundary=cyclic_boundary,
                              batch_dims=batch_dims, token_dims=token_dims, model_axes=tuple(model_axes),
                              fixed_params=fixed_params, grad_inputs=grad_inputs,
                              sequence_parallel=sequence_parallel, attention_kernel=attention_kernel,
                              pointwise_fusion=pointwise_fusion, autocast=autocast, fixed_inputs=fixed_inputs,
                              fixed_outputs=fixed_outputs, leaving=leaving, fixed_ops=fixed_ops)
        assign, info = prob.solve(time_limit_s=time_limit_s, backend=backend)
    finally:
        if gc_was_on:
            gc.enable()
    if not assign and prob.groups:
        if memory_budget_bytes is not None:
            least = sum(min(row) for row in prob.mem)
            raise PlanError(f"no sharding of {graph.name} on mesh {tuple(mesh.shape)} fits in "
                            f"{memory_budget_bytes / 2**30:.2f} GiB per device (ILP {info['status']}); "
                            f"the least memory any choice needs is about {least / 2**30:.2f} GiB")
        raise PlanError(f"the intra-op ILP found no solution ({info['status']}) within {time_limit_s} s")
    return prob.solution(assign, info)


def auto_shard(model: Any, example_inputs: Sequence[Any], *, mesh: LogicalMesh,
               memory_budget_bytes: Optional[float] = None,
               loss_fn: Optional[Callable[[Any], Any]] = None, dtype: str = "fp32",
               time_limit_s: float = 10) -> ShardingSolution:
    """Capture `model(*example_inputs)` (its loss: the output when scalar, else `loss_fn`) and
    shard every op over `mesh` for one training step at the example inputs' batch."""
    from autopar.capture import capture

    g = capture(model, example_inputs, loss_fn=loss_fn)
    if g.batch_size is None:
        import torch

        b = next(int(x.shape[0]) for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
        g = g.at_batch(b)
    return solve_graph(g, mesh, memory_budget_bytes=memory_budget_bytes, dtype=dtype,
                       time_limit_s=time_limit_s)
