"""The answer of the intra-op ILP: a placement per parameter and input, a strategy per op, the
collectives one training step runs, and its cost split the way the inter-op DP needs it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

Phase = Literal["forward", "backward", "grad_sync"]


@dataclass(frozen=True)
class Collective:
    """One collective of a training step. `bytes` is the whole buffer (nccl-tests convention):
    reduced (all_reduce), gathered (all_gather), before scattering (reduce_scatter)."""

    kind: str                       # all_reduce | all_gather | reduce_scatter | all_to_all
    mesh_axes: tuple[int, ...]
    bytes: float
    phase: Phase
    op: str = ""                    # the node it belongs to (a consumer for resharding)
    time_s: float = 0.0
    reason: str = ""                # "reshard x", "grad of w", "vocab-parallel cross-entropy", ...
    # the op whose output (or its gradient) this collective moves, for a redistribution between
    # ops (an edge): what a GEMM-communication overlap pairs it with (`inter_op.tp_overlap`);
    # "" for an op's own collectives
    tensor: str = ""


@dataclass
class OpChoice:
    strategy: str
    output_placements: list[tuple[str, ...]]
    compute_s: float                # forward + backward compute of the op
    communication_s: float          # collectives charged to it (its own and its inputs' resharding)
    input_placements: list[tuple[str, ...]] = field(default_factory=list)
    family: str = ""
    forward_s: float = 0.0          # of compute_s, the forward's (the rest is the backward's)


@dataclass
class ShardingSolution:
    param_placements: dict[str, tuple[str, ...]]
    input_placements: dict[str, tuple[str, ...]]
    collectives: list[Collective]
    objective: float
    op_choices: dict[str, OpChoice]
    forward_s: float
    backward_s: float
    grad_sync_s: float
    param_bytes_per_device: float
    activation_bytes_per_device: float
    solve_time_s: float
    gap: float
    num_variables: int
    num_constraints: int
    mesh_shape: tuple[int, ...] = ()
    status: str = ""
    # params whose rows must be laid out chunk-interleaved (fused QKV): fqn -> (dim, chunks)
    param_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)
    memory_bytes_per_device: float = 0.0          # what the budget bounds: params with state, activations, inputs
    build_time_s: float = 0.0
    num_groups: int = 0
    warnings: list[str] = field(default_factory=list)
    # the layout each op's output is consumed in (after any resharding), and the same for the
    # output of each module (its last op): a runtime that keeps activations as DTensors
    # redistributes a module's output to it (a forward hook) to run exactly the planned collectives
    activation_placements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    module_output_placements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a tensor read by several ops ("producer#output index") -> (the layout its consumers share,
    # the mesh axes along which their summed gradient stays partial before the one reduction);
    # an executor that follows the plan op by op (`autopar.intra_op.execute`) needs both
    junctions: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=dict)
    # a junction of one layer's readers ("producer#output@layer" -> those ops, in program order):
    # a stage stitched from per-layer solutions (`inter_op.stage_layouts`), where a tensor several
    # layers read has a junction in each layer's solution, each its own value and reduction;
    # the tensor's other readers read it without one. Empty for a solution of one graph
    junction_readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # mesh axes kept model-parallel (`solve_graph(model_axes=...)`): there a partial sum wanted
    # sharded is all-reduced whole, then sliced (Megatron without sequence parallelism), and the
    # executor runs it so
    model_axes: tuple[int, ...] = ()

    def collective_counts(self, phases: Optional[tuple[str, ...]] = None) -> dict[str, int]:
        """Collectives of one step by kind; a collective over k mesh axes (of size > 1) counts k
        times, as DTensor runs one per mesh dimension."""
        c: Counter = Counter()
        for x in self.collectives:
            if phases is None or x.phase in phases:
                c[x.kind] += max(1, len(x.mesh_axes))
        return dict(c)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardingSolution":
        """The solution `to_dict` wrote, through JSON (tuples restored; KeyError / TypeError on
        other data)."""
        t = lambda x: tuple(x)  # noqa: E731
        specs = lambda xs: [tuple(x) for x in xs]  # noqa: E731
        return cls(
            param_placements={k: t(v) for k, v in d["param_placements"].items()},
            input_placements={k: t(v) for k, v in d["input_placements"].items()},
            collectives=[Collective(c["kind"], t(c["mesh_axes"]), c["bytes"], c["phase"], c["op"], c["time_s"],
                                    c["reason"], c.get("tensor", "")) for c in d["collectives"]],
            objective=d["objective"],
            op_choices={k: OpChoice(v["strategy"], specs(v["output_placements"]), v["compute_s"],
                                    v["communication_s"], specs(v["input_placements"]), v["family"],
                                    v.get("forward_s", 0.0))
                        for k, v in d["op_choices"].items()},
            forward_s=d["forward_s"], backward_s=d["backward_s"], grad_sync_s=d["grad_sync_s"],
            param_bytes_per_device=d["param_bytes_per_device"],
            activation_bytes_per_device=d["activation_bytes_per_device"], solve_time_s=d["solve_time_s"],
            gap=d["gap"], num_variables=d["num_variables"], num_constraints=d["num_constraints"],
            mesh_shape=t(d["mesh_shape"]), status=d["status"],
            param_layouts={k: t(v) for k, v in d["param_layouts"].items()},
            memory_bytes_per_device=d["memory_bytes_per_device"], build_time_s=d["build_time_s"],
            num_groups=d["num_groups"], warnings=list(d["warnings"]),
            activation_placements={k: t(v) for k, v in d["activation_placements"].items()},
            module_output_placements={k: t(v) for k, v in d["module_output_placements"].items()},
            junctions={k: (t(a), t(b)) for k, (a, b) in d["junctions"].items()},
            junction_readers={k: t(v) for k, v in d.get("junction_readers", {}).items()},
            model_axes=t(d["model_axes"]))

    def apply(self, model: Any, example_inputs: Any, mesh: Any, *, loss_fn: Any = None,
              inputs: str = "full") -> Any:
        """Run `model` (materialised, the same values on every rank) as this solution plans it on
        the DeviceMesh `mesh`: `autopar.intra_op.execute.parallelize_graph`. Returns a module
        whose forward takes the model's inputs and returns the loss; the collectives it runs,
        forward and backward, are `collectives`."""
        from autopar.intra_op.execute import parallelize_graph

        return parallelize_graph(model, example_inputs, self, mesh, loss_fn=loss_fn, inputs=inputs)

    def explain(self, node: str) -> str:
        if node in self.param_placements:
            cs = [c for c in self.collectives if c.reason.endswith(node) or node in c.reason]
            return f"param {node}: {self.param_placements[node]}" + "".join(
                f"\n  {c.phase:9s} {c.kind} over axes {c.mesh_axes}: {c.bytes:.0f} B, {c.time_s * 1e6:.1f} us ({c.op})"
                for c in cs)
        ch = self.op_choices.get(node)
        if ch is None:
            return f"{node}: not part of this solution"
        lines = [f"{node} [{ch.family}]: strategy {ch.strategy!r}",
                 f"  inputs  {ch.input_placements}", f"  outputs {ch.output_placements}",
                 f"  compute {ch.compute_s * 1e6:.2f} us, communication {ch.communication_s * 1e6:.2f} us"]
        for c in self.collectives:
            if c.op == node:
                lines.append(f"  {c.phase:9s} {c.kind} over axes {c.mesh_axes}: {c.bytes:.0f} B, "
                             f"{c.time_s * 1e6:.2f} us  ({c.reason})")
        return "\n".join(lines)

    def junction_of(self, reader: str, key: str) -> str:
        """The junction through which op `reader` reads tensor `key` ("producer#output"): its
        layer's own where the tensor has one per reading layer (`junction_readers`), else `key`
        (absent from `junctions` where the tensor has none, or none for this reader's layer)."""
        if not self.junction_readers:
            return key
        by = self.__dict__.get("_junction_by")
        if by is None:
            by = self.__dict__["_junction_by"] = {(r, k.rsplit("@", 1)[0]): k
                                                  for k, rs in self.junction_readers.items() for r in rs}
        return by.get((reader, key), key)

    def junctions_done(self, reader: str) -> list[str]:
        """The per-layer junctions (`junction_readers`) whose last reader is op `reader`: their
        values are dropped after it runs, as the layer's solution counts them held."""
        if not self.junction_readers:
            return []
        last = self.__dict__.get("_junction_last")
        if last is None:
            last = self.__dict__["_junction_last"] = {}
            for k, rs in self.junction_readers.items():
                if rs:
                    last.setdefault(rs[-1], []).append(k)
        return last.get(reader, [])

    def to_dict(self) -> dict:
        """Plain JSON-able data (tuples become lists)."""
        import dataclasses

        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"objective {self.objective * 1e3:.3f} ms (fwd {self.forward_s * 1e3:.3f}, bwd "
                f"{self.backward_s * 1e3:.3f}, grad sync {self.grad_sync_s * 1e3:.3f}); "
                f"collectives {self.collective_counts()}; params {self.param_bytes_per_device / 2**20:.1f} MiB/dev, "
                f"activations {self.activation_bytes_per_device / 2**20:.1f} MiB/dev; "
                f"ILP {self.num_variables} vars / {self.num_constraints} constraints, "
                f"{self.solve_time_s:.2f} s, gap {self.gap:.2%} ({self.status})")
