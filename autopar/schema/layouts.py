"""The per-op layouts of a stage's tensor-parallel axis, as solved: what `autopar run` executes.

A stage's ops are those of its layers; identical layers (same signature) share one list of
layouts, so a 96-layer model stores one block's. `StageLayouts.layers` names each layer's ops
(the names of the captured graph, which the runtime's program of the same model carries) in the
order of its signature's list. `solution()` expands it into the
`autopar.intra_op.solution.ShardingSolution` the executor (`autopar.intra_op.execute`) runs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from autopar.schema.placement import Placement  # "R", "S(d)", "P": one per mesh axis

Layout = tuple[Placement, ...]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpLayout(_Model):
    """One op's chosen strategy: the layout it reads each tensor input in, and gives its outputs."""

    strategy: str
    family: str = ""
    inputs: list[Layout] = Field(default_factory=list)
    outputs: list[Layout] = Field(default_factory=list)


class LayerOps(_Model):
    """One layer: its ops, in the order of its signature's layouts."""

    name: str
    signature: int = Field(ge=0, description="index into StageLayouts.signatures")
    ops: list[str] = Field(description="op names of the captured graph")
    recomputed: list[int] = Field(default_factory=list, description="indices into `ops` of the ops the "
                                  "stage's recomputation re-runs in the backward (one checkpointed region)")
    discarded: list[list[int]] = Field(
        default_factory=list, description="under recompute \"norm_act\": its regions (the norms', the routed "
        "experts' activations': `cost_models.memory.norm_act_regions`), each the indices into `ops` of its "
        "ops in program order, whose outputs are freed once saved and re-made in the backward; not "
        "checkpointed (`recomputed` is empty)")

    @model_serializer(mode="wrap")
    def _omit_no_regions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without `discarded` when empty: a plan without "norm_act" (and its digest,
        `tests/test_planner_unchanged.py`) is what it was."""
        out = handler(self)
        if isinstance(out, dict) and not out.get("discarded", True):
            out.pop("discarded")
        return out


class Junction(_Model):
    """A tensor several ops read: redistributed once to `layout`; its consumers' summed gradient
    stays partial along `partial_axes` until one reduction."""

    layout: Layout
    partial_axes: tuple[int, ...] = ()
    readers: list[str] = Field(default_factory=list, description="the ops of one layer reading the tensor "
                               "through this junction (key 'op#output@layer'): a tensor several layers read has "
                               "one junction per layer's solution; empty: every reader of the tensor")


class StageLayouts(_Model):
    """The solved layouts of a stage's ops over its "tp" mesh axis (`mesh_axis`)."""

    mesh_axis: str = "tp"
    model_axes: tuple[int, ...] = Field(default=(), description="axes of the layouts' mesh kept "
                                        "model-parallel: a partial sum wanted sharded is reduced whole")
    signatures: list[list[OpLayout]] = Field(min_length=1)
    layers: list[LayerOps] = Field(min_length=1)
    inputs: dict[str, Layout] = Field(default_factory=dict, description="model inputs' layouts")
    params: dict[str, Layout] = Field(default_factory=dict, description="parameter FQN -> layout")
    param_layouts: dict[str, tuple[int, int]] = Field(
        default_factory=dict, description="parameter FQN -> (dim, chunks): a fused weight whose rows along "
        "dim are `chunks` blocks (q, k, v) held chunk-interleaved, each device's shard holding its share of "
        "every block (Megatron's QKV layout), so splitting the output into the blocks needs no gather")
    junctions: dict[str, Junction] = Field(default_factory=dict, description="'op#output' -> junction")
    receives: dict[str, Layout] = Field(
        default_factory=dict, description="a pipeline chunk after the first: every tensor it receives from "
        "the chunk before (made earlier, read by it or a later chunk; the program's order), in the layout its "
        "producer's op leaves it in, which is the layout every later reader's solution assumed; replicated "
        "after a chunk of another tp degree, which redistributes what it sends to replicated")
    collectives: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="per phase (forward, backward, grad_sync, and recompute: the "
        "forward collectives the backward re-runs): collectives of one micro-batch by kind, as the executor "
        "issues them")

    @model_validator(mode="after")
    def _check(self) -> "StageLayouts":
        for lay in self.layers:
            if lay.signature >= len(self.signatures):
                raise ValueError(f"layer {lay.name!r} names signature {lay.signature}, but there are "
                                 f"{len(self.signatures)}")
            if len(lay.ops) != len(self.signatures[lay.signature]):
                raise ValueError(f"layer {lay.name!r} lists {len(lay.ops)} ops for a signature of "
                                 f"{len(self.signatures[lay.signature])} layouts")
            if any(not 0 <= i < len(lay.ops) for r in lay.discarded for i in r):
                raise ValueError(f"layer {lay.name!r}: a discarded region's index is not one of its "
                                 f"{len(lay.ops)} ops")
        return self

    def recompute_regions(self) -> list[list[str]]:
        """The checkpointed regions, one per layer that recomputes: its ops' names."""
        return [[lay.ops[i] for i in lay.recomputed] for lay in self.layers if lay.recomputed]

    def discard_regions(self) -> list[list[str]]:
        """Under "norm_act": its regions, each its ops' names (`LayerOps.discarded`)."""
        return [[lay.ops[i] for i in r] for lay in self.layers for r in lay.discarded]

    @property
    def num_ops(self) -> int:
        return sum(len(lay.ops) for lay in self.layers)

    def solution(self, mesh_shape: tuple[int, ...]) -> Any:
        """The ShardingSolution the executor runs on a mesh of `mesh_shape` (the stage's tp axis)."""
        from autopar.intra_op.solution import OpChoice, ShardingSolution

        ops = {}
        for lay in self.layers:
            for name, ol in zip(lay.ops, self.signatures[lay.signature]):
                ops[name] = OpChoice(ol.strategy, [tuple(o) for o in ol.outputs], 0.0, 0.0,
                                     [tuple(i) for i in ol.inputs], ol.family)
        return ShardingSolution(
            param_placements={k: tuple(v) for k, v in self.params.items()},
            input_placements={k: tuple(v) for k, v in self.inputs.items()}, collectives=[],
            objective=0.0, op_choices=ops, forward_s=0.0, backward_s=0.0, grad_sync_s=0.0,
            param_layouts={k: (int(v[0]), int(v[1])) for k, v in self.param_layouts.items()},
            param_bytes_per_device=0.0, activation_bytes_per_device=0.0, solve_time_s=0.0, gap=0.0,
            num_variables=0, num_constraints=0, mesh_shape=tuple(mesh_shape), status="from plan",
            junctions={k: (tuple(j.layout), tuple(j.partial_axes)) for k, j in self.junctions.items()},
            junction_readers={k: tuple(j.readers) for k, j in self.junctions.items() if j.readers},
            model_axes=tuple(self.model_axes))
