"""Pipeline chunks cut from the traced model: pipelines for any model, its loss included.

A model whose layer chaining and loss the runtime does not know (no zoo family, no
`pipeline_loss` method: a model written by a user, a Hugging Face model) is cut by torch's own
pipeline tracer, `torch.distributed.pipelining.pipeline(model, mb_args, split_spec)` (torch.export
underneath), at the first layer of every stage after the first. Each chunk is a GraphModule that
calls the model's own submodules under their original FQNs, so plan placements, recomputation,
FSDP units and checkpoint keys address them as in the whole model, and runs the code between
them as traced: a head written `x @ emb.weight.t()`, the loss at the end of the last chunk. A
parameter read by two chunks (a tied embedding) is in each under its name; the runtime sums
their gradients (`engine._build_tied_groups`).

What torch's tracer-built stages do not do, done here (`FedChunk`):

* a later chunk that reads a model input (the targets, in the last chunk) takes it from this
  step's micro-batches, not from the pipeline's sends (torch's stages feed model inputs to the
  first stage only);
* the trace was taken on the meta device: tensors the forward creates (`arange` positions) are
  made on the rank's device, and the tracer's dtype/device assertions are dropped (the runtime
  runs the chunks under autocast, where they would not hold).

A boundary must carry one activation tensor; a model passing several between its layers (a mask
or rotary table computed once and read by every layer) is refused with a PlanError.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn

from autopar.schema.errors import PlanError

# a source of a chunk's input: ("act", 0) the activation received from the previous chunk;
# ("input", i) the model's i-th input (its micro-batch)
Source = tuple[str, int]


def split_model(model: nn.Module, example_mb: Sequence[Any], first_layers: Sequence[str],
                device: torch.device) -> list[tuple[torch.fx.GraphModule, list[Source]]]:
    """Cut `model` (on meta: it is copied) before each of `first_layers` (module FQNs, in
    order): one (GraphModule, its inputs' sources) per chunk. `example_mb`: the model's inputs
    at the micro-batch size (meta tensors do)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {f: SplitPoint.BEGINNING for f in first_layers}
    # the tracer patches the forward of the modules it splits before, in place: trace a copy
    # (of a meta model: nothing allocated), so the model can be traced again
    model = copy.deepcopy(model)
    try:
        pipe = pipeline(model, mb_args=tuple(example_mb), split_spec=spec)
    except Exception as e:  # noqa: BLE001 - the tracer's own errors, reported with the split
        raise PlanError(f"cannot trace {type(model).__name__} into pipeline stages at "
                        f"{list(first_layers)}: {type(e).__name__}: {str(e)[:300]}") from e
    if pipe.num_stages != len(first_layers) + 1:
        raise PlanError(f"the pipeline tracer cut {type(model).__name__} into {pipe.num_stages} chunks, "
                        f"the plan has {len(first_layers) + 1}: a stage boundary at "
                        f"{list(first_layers)} is not a module the forward calls in order")
    sg = pipe.split_gm
    inputs = [n for n in sg.graph.nodes if n.op == "placeholder"]
    calls = [n for n in sg.graph.nodes if n.op == "call_module"]
    out: list[tuple[torch.fx.GraphModule, list[Source]]] = []
    for i, call in enumerate(calls):
        if call.kwargs:
            raise PlanError(f"pipeline chunk {i} of {type(model).__name__} takes keyword inputs "
                            f"{sorted(call.kwargs)}; graph pipelines pass positional tensors")
        srcs: list[Source] = []
        acts = 0
        for a in call.args:
            if isinstance(a, torch.fx.Node) and a.op == "placeholder":
                srcs.append(("input", inputs.index(a)))
                continue
            prod = a.args[0] if isinstance(a, torch.fx.Node) and a.op == "call_function" and a.args else a
            if not (isinstance(prod, torch.fx.Node) and i > 0 and prod is calls[i - 1] and a is prod):
                raise PlanError(f"pipeline chunk {i} of {type(model).__name__} reads {a} from an earlier "
                                f"chunk than the previous one, or one of several tensors it passes; graph "
                                f"pipelines carry one activation between stages")
            srcs.append(("act", 0))
            acts += 1
        if i > 0 and acts != 1:
            raise PlanError(f"pipeline chunk {i} of {type(model).__name__} receives {acts} activations; "
                            f"graph pipelines carry exactly one between stages")
        gm = pipe.get_stage_module(i)
        retarget(gm, device)
        out.append((gm, srcs))
    return out


def retarget(gm: nn.Module, device: torch.device) -> None:
    """Make a chunk traced on meta run on `device`, in its graph and in the graphs of the
    tracer's submodules: tensors its ops create or move get `device` (a meta device in an op's
    arguments becomes `device`), and the tracer's metadata assertions (dtype and device as
    traced) go."""
    def fix(v: Any) -> Any:
        if isinstance(v, torch.device) and v.type == "meta":
            return device
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x) for x in v)
        return v

    for mod in gm.modules():
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph):
            continue
        for n in list(g.nodes):
            if n.op != "call_function":
                continue
            if n.target is torch.ops.aten._assert_tensor_metadata.default:
                g.erase_node(n)
                continue
            n.args = fix(n.args)
            n.kwargs = {k: fix(v) for k, v in n.kwargs.items()}
        g.lint()
        if hasattr(mod, "recompile"):
            mod.recompile()


class FedChunk(nn.Module):
    """A chunk as its PipelineStage runs it: forward(*received) takes what the schedule hands
    the stage (the previous chunk's activation; on the first chunk the micro-batch of the first
    input) and calls `inner` with its inputs in the traced order, model inputs taken from the
    micro-batches given to `start_step` (one forward per micro-batch, in order: every torch
    schedule runs a chunk's forwards in micro-batch order)."""

    def __init__(self, inner: nn.Module, sources: list[Source]) -> None:
        super().__init__()
        self.inner = inner
        self.sources = list(sources)
        self._mbs: dict[int, Sequence[Any]] = {}
        self._next = 0

    @property
    def model_inputs(self) -> set[int]:
        """The model inputs this chunk reads (indices)."""
        return {i for kind, i in self.sources if kind == "input"}

    def start_step(self, local: Sequence[Any], num_microbatches: int) -> None:
        """This step's model inputs (the rank's rows), split into micro-batches as the schedule
        splits what it is given."""
        self._mbs = {}
        for i in self.model_inputs:
            x = local[i] if i < len(local) else None
            if x is None:
                raise PlanError(f"pipeline chunk needs model input {i}, which this rank was not given")
            self._mbs[i] = (torch.tensor_split(x, num_microbatches) if isinstance(x, torch.Tensor) and x.dim() > 0
                            else [x] * num_microbatches)
        self._next = 0

    def forward(self, *received: Any) -> Any:
        mb = self._next
        self._next += 1
        args = [received[k] if kind == "act" else self._mbs[k][mb] for kind, k in self.sources]
        return self.inner(*args)
