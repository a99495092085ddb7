"""Collectives that DTensor will issue for a plan's tensor-parallel placements, counted by a dry run.

The runtime executes "tp" axes as DTensor placements and lets DTensor's sharding propagation
choose every op's layout (`autopar.runtime.spmd`); the collectives it runs follow from those
rules (for the zoo GPT: an all-gather of the fused qkv output before its head split, lazily
reduced partial sums, ...), which a Megatron-style count does not reproduce. So the planner
counts them the way the runtime will issue them: the model is copied to the meta device, its
parameters distributed with the stage's tp placements over a fake process group of tp ranks
(`torch.testing._internal.distributed.fake_pg`), and one forward and backward run under
`CommDebugMode`, which attributes each collective to the module that issued it. Nothing is
allocated or communicated. Layers identical to their predecessor (same signature) are run once:
the later copies pass their input through, and take the counts of the first steady-state copy.

Counts are per micro-batch; DTensor chooses layouts by tensor size, so the dry run uses the
plan's micro-batch size. Skipped (returns None) when a
process group is already initialised in this process, or the model is not on the meta device
and too large to copy.
"""

from __future__ import annotations

import warnings

import copy
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from autopar.inter_op.layers import Layer

_KINDS = (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
          ("all_to_all", "all_to_all"), ("broadcast", "broadcast"))


def _kind(op: Any) -> Optional[str]:
    s = str(op)
    for key, kind in _KINDS:
        if key in s:
            return kind
    return None


def _counter(d: dict) -> Counter:
    out: Counter = Counter()
    for op, n in (d or {}).items():
        k = _kind(op)
        if k:
            out[k] += int(n)
    return out


class LayerCounts:
    """Per layer (index): forward and backward collectives per micro-batch; `attn_fwd` the part
    of the forward issued inside its attention children (what selective recomputation re-runs)."""

    def __init__(self, L: int) -> None:
        self.fwd = [Counter() for _ in range(L)]
        self.bwd = [Counter() for _ in range(L)]
        self.block_fwd = [Counter() for _ in range(L)]
        self.attn_fwd = [Counter() for _ in range(L)]


def dtensor_tp_counts(model: nn.Module, example_inputs: Sequence[Any], tp: int,
                      placements: dict[str, str], layers: list[Layer],
                      loss_fn: Optional[Callable[[Any], Any]] = None, batch: Optional[int] = None,
                      device: str = "meta", max_real_params: int = 50_000_000) -> Optional[LayerCounts]:
    """Per-layer collectives of one micro-batch of `batch` samples (DTensor picks layouts by
    size, so the plan's micro-batch size is used) under `placements` (FQN -> tp placement)."""
    import torch.distributed as dist

    if tp <= 1 or not dist.is_available() or dist.is_initialized():
        return None
    params = list(model.parameters())
    on_meta = all(p.device.type == "meta" for p in params)
    if not on_meta and sum(p.numel() for p in params) > max_real_params:
        return None
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from autopar.runtime.spmd import allow_implicit_replication, parallelize, register_extra_strategies
    except Exception:  # noqa: BLE001 - an optional refinement
        return None
    # DTensor's choices can depend on the kernels the device dispatches to (CPU attention takes
    # another path than the meta one): on a CPU cluster run on (uninitialised) CPU tensors
    small = sum(p.numel() for p in params) <= max_real_params
    on_cpu = device == "cpu" and small
    m = copy.deepcopy(model)
    m = m.to_empty(device="cpu") if on_cpu else (m if on_meta else m.to("meta"))
    dev = "cpu" if on_cpu else "meta"
    # run each run of identical layers once: later copies pass their input through
    rep: dict[int, int] = {}
    for i, l in enumerate(layers):
        if i >= 2 and l.signature == layers[i - 1].signature == layers[i - 2].signature and len(l.modules) == 1:
            rep[i] = rep.get(i - 1, i - 1)
    for i in rep:
        try:
            mod = m.get_submodule(layers[i].modules[0])
        except AttributeError:
            return None
        mod.forward = lambda x, *a, **k: x  # type: ignore[method-assign]
    inputs = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            shape = (batch, *x.shape[1:]) if batch and x.dim() > 0 else tuple(x.shape)
            inputs.append(torch.zeros(shape, dtype=x.dtype, device=dev))
        else:
            inputs.append(x)
    try:
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (tp,))
            register_extra_strategies()
            allow_implicit_replication()
            pm = parallelize(m, mesh, {f: (p,) for f, p in placements.items()},
                             [("R",) if isinstance(x, torch.Tensor) else None for x in inputs])
            cm = CommDebugMode()
            with cm, warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a dry run: torch's hook warnings are not the user's
                out = pm(*inputs)
                if not (isinstance(out, torch.Tensor) and out.dim() == 0):
                    from autopar.capture.export import default_loss

                    out = (loss_fn or default_loss)(out)
                out.backward()
            counts = cm.comm_module_counts
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - fall back to the analytic counts
        return None
    prefix = next((k[: -len(".embed")] for k in counts if k.endswith(".embed")), None)
    roots = [k for k in counts if k.endswith(".module")]
    root = roots[0] if roots else "SPMDModule.module"
    prefix = root + "."

    # a layer may name a module that holds other layers' modules (a Hugging Face model's
    # `model` holds the embedding, the final norm and `model.layers.*`, and is named by the first
    # and the last layer): its own collectives, without those of the layer modules inside it,
    # count once, in the first layer naming it
    names = list(dict.fromkeys(m for l in layers for m in l.modules))
    owner = {m: next(i for i, l in enumerate(layers) if m in l.modules) for m in names}

    def inner(name: str) -> list[str]:
        """The outermost layer modules strictly inside `name`."""
        sub = [m for m in names if m.startswith(name + ".")]
        return [m for m in sub if not any(m.startswith(o + ".") for o in sub)]

    def get(name: str, phase: str) -> Counter:
        c = _counter(counts.get(prefix + name, {}).get(phase, {}))
        for m in inner(name):
            c -= _counter(counts.get(prefix + m, {}).get(phase, {}))
        return c

    res = LayerCounts(len(layers))
    total_f = _counter(counts.get("Global", {}).get("forward", {}))
    total_b = _counter(counts.get("Global", {}).get("backward", {}))
    seen_f, seen_b = Counter(), Counter()
    for i, l in enumerate(layers):
        src = rep.get(i, i)
        for mod in layers[src].modules:
            if owner[mod] != src:
                continue
            f, b = get(mod, "forward"), get(mod, "backward")
            res.fwd[i] += f
            res.bwd[i] += b
            if mod == layers[src].name:
                res.block_fwd[i] += f
                for k, v in counts.items():
                    if k.startswith(prefix + mod + ".") and k.rsplit(".", 1)[-1].startswith("attn"):
                        res.attn_fwd[i] += _counter(v.get("forward", {}))
            if src == i:
                seen_f += f
                seen_b += b
    # ops of the root module itself (the loss): the last layer's stage runs them
    res.fwd[-1] += total_f - seen_f
    res.bwd[-1] += total_b - seen_b
    return res
