"""Tracked memory of one training step: what a rank holds, by the categories the plan predicts.

`track_step(pm, batch)` runs `pm.train_step(batch)` of an `engine.ParallelModel` under torch's
`MemTracker` (`torch.distributed._tools.mem_tracker`, a TorchDispatchMode: it sees every tensor an
op creates, on CPU as on GPU, and keeps a live byte count per storage and category) and returns a
`MemoryReport`: the step's peak tracked bytes, the breakdown by category at that moment, and the
peak of each phase of the step. Bytes are tensor storages (`numel * element_size`, each storage
once however many views or DTensors share it); allocator rounding, the caching allocator's
reserve, and memory that bypasses the dispatcher (gloo's own buffers, Python objects) are not in
it: on GPU `torch.cuda.max_memory_allocated` stays the figure of record.

Registration. Tensors alive before the step are invisible to a dispatch mode unless registered
(`MemTracker.track_external`); `track_step` registers everything the rank holds, each labelled:

* every local module's parameters and buffers (plain, DTensor, FSDP2 sharded DTensor), with
  gradient hooks (accumulated gradients, FSDP2's sharded gradients: it calls post-accumulate
  hooks on the sharded parameter after its reduce-scatter);
* FSDP2's unsharded parameter storages (`FSDPParam.all_gather_outputs`, size 0 between steps):
  the tracker's patched `UntypedStorage.resize_` follows their allocation and freeing;
* fp32 masters: `pm.masters.masters` (ZeRO 0 under bf16), `pm.flat_shard` (ZeRO-1/2), FSDP2's
  fp32 sharded parameters (ZeRO-3 under bf16: FSDP's shards are the masters);
* optimizer states; pipeline receive buffers alive at the start (none: the runtime makes
  them when it posts a receive and drops them after the micro-batch's backward,
  `pipeline_p2p.JustInTimeStage`; those made in the step are labelled as they are made,
  `pipeline_receives`); the step's batch.

Then a sweep of the garbage collector's tensors registers, as "other", every storage on the
device alive at the start that none of these covers (minus a `baseline()` of what the process
held before building the model): `MemoryReport.untracked_bytes` and `untracked` say what, so
memory the runtime keeps that this module does not know of is counted and named, not missed.
(Seen: gloo keeping the previous step's flat all-reduce / all-gather buffer alive until its next
collective; the runtime now frees those buffers' storage itself, `tied_grads.release`.)

Categories (`MemoryReport.detail`), and the plan category each counts in (`PLAN_CATEGORY`):

==================  =================================================================  ===========
params              module parameters as the rank holds them (bf16 copies under bf16;     weights
                    fp32 weights or FSDP's fp32 shards under fp32)
gathered_params     FSDP2's unsharded (all-gathered) parameters, live between a unit's      weights
                    all-gather and its reshard
master              fp32 masters (see above)                                               optimizer
optimizer_state     AdamW's moments and step counters (registered: they exist before the    optimizer
                    tracked step)
optimizer_temps     what the optimizer step makes (AdamW's `exp_avg_sq.sqrt()` and its      buffers
                    quotient), as the plan counts them (`cost_models.memory.ADAMW_TEMPORARIES`)
gradients           parameter gradients (incl. the masters' fp32 gradients, the flat        gradients
                    shard's gradient and FSDP2's unsharded gradients, accumulated over the
                    micro-batches until a unit's reduce-scatter; from their creation)
activations         tensors made in forward (and in recomputation during the backward)      activations
temporaries         tensors made in the backward that are not parameter gradients           buffers
                    (activation gradients, FSDP's reduce-scatter inputs)
sync_buffers        tensors made during the gradient sync / update outside the optimizer    buffers
                    step (flat all-reduce / reduce-scatter / all-gather buffers)
comm_buffers        a forward redistribution's gather buffer and result while it runs       buffers
                    (`communication_buffers`: the executor's `_gather`; the result is an
                    activation once the gather is done), as the plan counts them there
pipeline_buffers    pipeline receive buffers (activations received, output gradients)       buffers
module_buffers      module buffers (rotary tables, masks)                                  buffers
inputs              the step's batch                                                       buffers
other               anything else registered                                               buffers
==================  =================================================================  ===========

Phases (`MemoryReport.phases`): "forward_backward" (`pm.forward_backward`, every micro-batch and
pipeline schedule), "grad_sync" (`pm.sync_and_update` up to the update: gradients moved to their
layouts, dp all-reduce or reduce-scatter, tied-weight sync), "optimizer" (the update: the fp32
gradient copies of the masters, the optimizer step and what follows it: the masters' copy into
the parameters, ZeRO-1/2's all-gather of the updated shard), as the plan's phases
(`cost_models.memory.runtime_phases`: "optimizer_step" there) divide the step.

Workarounds of MemTracker's limits, each for a reason seen on this runtime:

* MemTracker raises NotImplementedError when a root module runs forward twice in a step (it
  takes that for a second iteration); micro-batches and pipeline schedules do exactly that, so
  a repeated root forward outside the backward is accepted here (only MemTracker's per-module
  snapshots, unused here, skip it).
* DTensor: MemTracker steps aside for DTensor and tracks the local ops DTensor runs, and
  `get_untyped_storages` unwraps a DTensor into its local storage: parameters, gradients and
  activations of tp stages count their local shards.
* FSDP2 on CPU (gloo): unsharded parameters are resized storages, followed through the
  patched `resize_` (registered above); what FSDP frees by dropping references is seen by the
  weak-reference callbacks as for any tensor.
* torch.pipelining: receive buffers are made mid-step by the runtime's stages, labelled
  through `pipeline_receives`. Its p2p ops (isend/irecv) allocate nothing through the
  dispatcher.
* Not worked around: after a step under MemTracker (its ModTracker: seen with ModTracker
  alone, not with a plain dispatch mode), the ParallelModel's parameters stay alive when the
  model is dropped (the modules are freed). A job that tracks several plans in one process
  keeps the earlier plans' parameters; `baseline()` keeps them out of the next plan's figures.

Cost: a Python dispatch per op (a few times a small CPU step's time); `worker.train` tracks one
step (the second: the first allocates AdamW's state lazily, mid-step) unless told otherwise
(`AUTOPAR_TRACK_MEMORY`, see `worker`).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _RefType
from torch.distributed.tensor import DTensor as _DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

_DEVICE = torch.ops.prim.device.default
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_SCALARS = (int, float, bool)
PLAN_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "buffers")
PHASES = ("forward_backward", "grad_sync", "optimizer")


class _Ref(_RefType):
    """Labels beyond MemTracker's own (`_MemRefType`)."""

    GATHERED = "gathered_params"
    MASTER = "master"
    SYNC = "sync_buffers"
    COMM = "comm_buffers"
    OPT_TMP = "optimizer_temps"
    PIPE = "pipeline_buffers"
    INPUT = "inputs"


_STICKY = frozenset({_Ref.GATHERED, _Ref.MASTER, _Ref.PIPE, _Ref.INPUT})
_DETAIL = {
    _MemRefType.PARAM: "params", _Ref.GATHERED: "gathered_params", _Ref.MASTER: "master",
    _MemRefType.OPT: "optimizer_state", _Ref.OPT_TMP: "optimizer_temps", _MemRefType.GRAD: "gradients",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries", _Ref.SYNC: "sync_buffers", _Ref.COMM: "comm_buffers",
    _Ref.PIPE: "pipeline_buffers",
    _MemRefType.BUFFER: "module_buffers", _Ref.INPUT: "inputs", _MemRefType.OTH: "other",
}
DETAIL_CATEGORIES = tuple(_DETAIL.values())
PLAN_CATEGORY = {
    "params": "weights", "gathered_params": "weights", "master": "optimizer",
    "optimizer_state": "optimizer", "optimizer_temps": "buffers", "gradients": "gradients",
    "activations": "activations",
    "temporaries": "buffers", "sync_buffers": "buffers", "comm_buffers": "buffers",
    "pipeline_buffers": "buffers",
    "module_buffers": "buffers", "inputs": "buffers", "other": "buffers",
}


def to_plan_categories(detail: dict[str, int]) -> dict[str, int]:
    """Sum detail categories into the plan's (`PLAN_CATEGORIES`)."""
    out = dict.fromkeys(PLAN_CATEGORIES, 0)
    for k, v in detail.items():
        out[PLAN_CATEGORY[k]] += int(v)
    return out


# Moments within this fraction of a peak are "at the peak" too (`PhasePeak.near`): a step often
# reaches its peak at several moments a few bytes apart (the loss's backward, then an MLP's
# backward freeing as much as it makes), and which of them torch reaches first says nothing of
# the memory model; the plan predicts one moment, which should be one of them.
NEAR_PEAK = 0.01


@dataclass
class PhasePeak:
    """The peak of one phase: total bytes and the detail categories at that moment; `near`: the
    plan categories of the other moments of the phase within `NEAR_PEAK` of its peak (distinct
    ones, each with its bytes under "bytes")."""

    peak_bytes: int = 0
    detail: dict[str, int] = field(default_factory=dict)
    near: list[dict] = field(default_factory=list)

    @property
    def categories(self) -> dict[str, int]:
        return to_plan_categories(self.detail)

    def moments(self) -> list[dict[str, int]]:
        """The plan categories of every moment at the peak: the peak's, then the `near` ones."""
        return [self.categories] + [{c: m[c] for c in PLAN_CATEGORIES} for m in self.near]

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "categories": self.categories, "detail": dict(self.detail),
                "near": [dict(m) for m in self.near]}


@dataclass
class MemoryReport:
    """One step's tracked memory on this rank (bytes)."""

    peak_bytes: int                       # the step's peak (tracked storages, all categories)
    detail: dict[str, int]                # detail categories at the peak moment
    peak_phase: str                       # the phase the peak fell in
    phases: dict[str, PhasePeak]          # peak of each phase that ran
    start_bytes: int                      # what the rank held when the step began
    end_bytes: int                        # ... and when it ended
    untracked_bytes: int = 0              # alive at the start, not registered, counted as "other"
    untracked: list[str] = field(default_factory=list)   # the largest of them
    notes: list[str] = field(default_factory=list)
    peak_tensors: list[dict] = field(default_factory=list)   # `track_step(top=N)`: what the peak holds
    near: list[dict] = field(default_factory=list)           # other moments at the peak (`PhasePeak.near`)
    timeline: list[dict] = field(default_factory=list)       # `track_step(timeline=True)`: every change

    @property
    def categories(self) -> dict[str, int]:
        """The peak's breakdown in the plan's categories (`PLAN_CATEGORIES`)."""
        return to_plan_categories(self.detail)

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "categories": self.categories,
                "detail": dict(self.detail), "phases": {k: v.to_dict() for k, v in self.phases.items()},
                "start_bytes": self.start_bytes, "end_bytes": self.end_bytes,
                "untracked_bytes": self.untracked_bytes, "untracked": list(self.untracked),
                "notes": list(self.notes), "peak_tensors": list(self.peak_tensors),
                "near": [dict(m) for m in self.near],
                **({"timeline": list(self.timeline)} if self.timeline else {})}


class StepMemTracker(MemTracker):
    """MemTracker with the labels and phases above (see the module docstring). Use through
    `track_step`; `phase` is set by the wrappers `track_step` installs."""

    def __init__(self, device: torch.device, top: int = 0, timeline: bool = False) -> None:
        super().__init__()
        self._ref_class = [*_MemRefType, *_Ref]   # iterated for a device's snapshot keys only
        self.device = device
        self.phase = "forward_backward"
        self.comm_depth = 0                       # inside `communication_buffers`
        self.pipe_depth = 0                       # inside `pipeline_receives`
        self.shadow_depth = 0                     # inside DTensor's shape propagation (below)
        self.master_grads = False                 # inside MasterWeights.step, before optimizer.step
        self.phase_peak: dict[str, tuple[int, dict]] = {}
        # per phase, the distinct moments within NEAR_PEAK of its peak so far: categories -> bytes
        self.phase_near: dict[str, dict[tuple, tuple[int, dict]]] = {}
        # `top` > 0: where each storage came from (op, shape, dtype, phase, innermost module,
        # forward or backward) and the `top` largest storages alive at the step's peak
        self.top = top
        self._op = "registered"
        self._origin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak_tensors: list[dict] = []
        # `timeline`: the bytes held after every op that changed them, by plan category, with
        # the op, the innermost module and the pass (forward / backward): where a peak comes from
        self.timeline: list[dict] | None = [] if timeline else None
        # a collective counter riding on this mode (`verify.PhasedCounter`): its `observe`
        # sees every op handed here, before the tracker's own work
        self.counter: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE:
            # a tensor's device, asked of a Python tensor subclass (a fake tensor: most of the
            # dispatches of a fake step, `autopar verify`); it makes no tensor
            return func(*args, **(kwargs or {}))
        counter = self.counter
        if counter is not None:
            # what the counter as a mode of its own would do before handing the op on
            if _DTensor in types:
                return NotImplemented
            counter.observe(func, args, kwargs or {})
        if self.shadow_depth:
            # DTensor's sharding propagation running an op at the global shape on fake tensors
            # to learn its output's metadata (`ShardingPropagator._propagate_tensor_meta_non_cached`,
            # in the fake mode of `autopar verify` when there is one): no memory of the step
            return func(*args, **(kwargs or {}))
        if not self.top and self.timeline is None:
            return self._dispatch(func, types, args, kwargs)
        self._op = str(func)      # read only by the origins of `top` and the timeline
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            self._op = "registered"

    def _dispatch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """MemTracker's `__torch_dispatch__` (torch 2.13), the same steps with less per-op work:
        the output's tensors tracked in order without a pytree walk when it is a tensor or a
        flat tuple or list, and the backward flag read once."""
        if _DTensor in types:
            return NotImplemented
        if func is _WAIT_TENSOR and active_fake_mode():
            res = args[0]      # MemTracker's: wait_tensor's meta kernel makes a tensor eager does not
        else:
            res = func(*args, **kwargs or {})
        if active_fake_mode() is self._fake_mode_on_entry:
            is_bw = self._mod_tracker.is_bw
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            elif type(res) in (tuple, list) and all(isinstance(x, torch.Tensor) or x is None or type(x) in _SCALARS
                                                    for x in res):
                for x in res:
                    if isinstance(x, torch.Tensor):
                        self._track(reftype, x)
            else:
                tree_map_only(torch.Tensor, partial(self._track, reftype), res)
            self._update_peak_stats(_ModState.PEAK_BW if is_bw else _ModState.PEAK_FW)
        return res

    # -- labels ------------------------------------------------------------------------------
    def label(self, t: Any, ref: _RefType) -> None:
        """Register (or relabel) the storages of tensor `t` (DTensor: its local shard)."""
        if isinstance(t, torch.Tensor):
            self._update_and_maybe_create_winfos(t, ref)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: _RefType,
                                        update_existing: bool = False) -> set:
        # MemTracker relabels a module's parameters PARAM when the module first runs; keep the
        # labels registered here (an FSDP shard that is a master, an unsharded FSDP parameter)
        if reftype in (_MemRefType.PARAM, _MemRefType.BUFFER):
            for st in get_untyped_storages(t):
                w = self._WINFO.get(st, None)
                if w is not None and w[0].reftype in _STICKY:
                    return {w[0]}
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        if reftype == _MemRefType.ACT and self.phase != "forward_backward" and not self._in_opt:
            reftype = _MemRefType.GRAD if self.master_grads else _Ref.SYNC
        elif reftype == _MemRefType.ACT and self.comm_depth:
            reftype = _Ref.COMM
        elif self.pipe_depth:
            reftype = _Ref.PIPE
        elif reftype == _MemRefType.OPT:
            # the states exist before the tracked step (`register`): what the step makes is its
            # temporaries
            reftype = _Ref.OPT_TMP
        super()._track(reftype, t)
        if self.top:
            self._note_origin(t)

    def _note_origin(self, t: torch.Tensor) -> None:
        mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
        where = {"op": self._op, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                 "phase": self.phase, "module": mods[-1] if mods else "",
                 "pass": "backward" if self._mod_tracker.is_bw else "forward"}
        for st in get_untyped_storages(t):
            if st not in self._origin:
                self._origin[st] = where

    def _peak_tensors(self) -> list[dict]:
        """The `top` largest storages alive now on the device, with their label and origin."""
        rows = []
        for st, (winfo, _) in self._WINFO.items():
            if winfo.device != self.device or winfo.mem_consumed == 0:
                continue
            rows.append({"bytes": int(winfo.mem_consumed), "label": _DETAIL.get(winfo.reftype, str(winfo.reftype)),
                         **self._origin.get(st, {"op": "registered"})})
        rows.sort(key=lambda r: -r["bytes"])
        return rows[:self.top]

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                return   # a root module's next micro-batch (MemTracker would raise)
        super()._pre_fw_hook(module, inputs)

    # -- peaks -------------------------------------------------------------------------------
    def _update_peak_stats(self, peak_state: Any) -> None:
        # the device peaks only: MemTracker's own also updates per-module peaks, a walk over
        # every module it has seen on every op (5x a fake-tensor step's time on a 10-layer
        # Llama stage, `autopar verify`), which nothing here reads. Snapshots hold ints: copied
        # flat, not deep-copied.
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)
        snap = self._curr_mem_snap.get(self.device)
        if snap is None:
            return
        total = snap["Total"]
        if self.top and total > max((v[0] for v in self.phase_peak.values()), default=-1):
            self.peak_tensors = self._peak_tensors()
        top = self.phase_peak.get(self.phase, (-1, None))[0]
        if total > top:
            self.phase_peak[self.phase] = (total, dict(snap))
        if total >= (1.0 - NEAR_PEAK) * top:
            near = self.phase_near.setdefault(self.phase, {})
            if total > top:
                for k in [k for k, v in near.items() if v[0] < (1.0 - NEAR_PEAK) * total]:
                    del near[k]
            # keyed by the raw snapshot (cheap: this runs on every op near the peak); turned
            # into plan categories once, at the end (`_near`)
            near[tuple(snap.values())] = (int(total), dict(snap))
        if self.timeline is not None and (not self.timeline or self.timeline[-1]["bytes"] != total):
            mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
            self.timeline.append({"op": self._op, "module": mods[-1] if mods else "", "phase": self.phase,
                                  "pass": "backward" if self._mod_tracker.is_bw else "forward",
                                  "bytes": int(total), "categories": to_plan_categories(_detail(snap))})

    def current_bytes(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get("Total", 0))

    def enter_phase(self, phase: str) -> None:
        """Switch phase; the current bytes count as the new phase's first sample."""
        self.phase = phase
        self._update_peak_stats(None)


def step_near(phases: dict[str, PhasePeak], peak: int, own: dict[str, int]) -> list[dict]:
    """The step's moments within NEAR_PEAK of its `peak` bytes, from every phase's peak and
    near moments, but the peak's own (`own`: its plan categories). Another moment of the same
    total is kept: a backward reaching the peak twice, the second time with more weight
    gradients and fewer activations (Falcon with full recomputation at tp 2, a layer's mm and
    then its gelu_backward, 4359440 B both), is at the peak too."""
    return [m for ph in phases.values() for m in ph.near + [{**ph.categories, "bytes": ph.peak_bytes}]
            if m["bytes"] >= (1.0 - NEAR_PEAK) * peak
            and not (m["bytes"] == peak and {c: m[c] for c in PLAN_CATEGORIES} == own)]


def _near(moments: dict[tuple, tuple[int, dict]], peak_snap: dict) -> list[dict]:
    """A phase's moments within NEAR_PEAK of its peak (`StepMemTracker.phase_near`), less the
    peak's own, as distinct plan categories with their "bytes"."""
    own = to_plan_categories(_detail(peak_snap))
    out: dict[tuple, dict] = {}
    for total, snap in moments.values():
        cats = to_plan_categories(_detail(snap))
        key = tuple(cats[c] for c in PLAN_CATEGORIES)
        if cats != own and key not in out:
            out[key] = {**cats, "bytes": total}
    return list(out.values())


def _detail(snap: dict | None) -> dict[str, int]:
    out = dict.fromkeys(DETAIL_CATEGORIES, 0)
    for k, v in (snap or {}).items():
        if k in _DETAIL:
            out[_DETAIL[k]] += int(v)
    return out


def _fsdp_params(modules: Sequence[nn.Module]) -> list[Any]:
    """FSDP2's FSDPParam objects of every fully_shard unit under `modules`."""
    out, seen = [], set()
    for root in modules:
        for m in root.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            if get_state is None:
                continue
            group = getattr(get_state(), "_fsdp_param_group", None)
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            out.extend(group.fsdp_params)
    return out


def _stage_modules(pm: Any) -> list[nn.Module]:
    """Every module the rank runs: its stage cores and what wraps them (SPMD, FSDP roots)."""
    mods = list(getattr(pm, "local_modules", []))
    if getattr(pm, "runner", None) is not None:
        mods.append(pm.runner)
    for st in getattr(pm, "pipe_stages", []) or []:
        mods.append(st.submod)
    return mods


def _pipeline_buffers(pm: Any) -> list[torch.Tensor]:
    out = []
    for st in getattr(pm, "pipe_stages", []) or []:
        for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and not buf.is_meta:   # meta: a placeholder
                    out.append(buf)
    return out


def register(mt: StepMemTracker, pm: Any, batch: Sequence[Any]) -> None:
    """Register with `mt` everything `pm` holds before its step (see the module docstring)."""
    mods = _stage_modules(pm)
    for m in mods:
        mt._track_module_params_and_buffers(m, install_grad_hooks=True)
    for p in pm.params:   # parameters reached through no module above (none expected): hooks too
        mt._track_module_params_and_buffers(_Holder(p), install_grad_hooks=True)
    for fp in _fsdp_params(mods):
        for t in fp.all_gather_outputs:
            mt.label(t, _Ref.GATHERED)
        unsharded = getattr(fp, "_unsharded_param", None)     # made at the first all-gather
        if unsharded is not None:
            # its gradient is a gradient: with several micro-batches FSDP accumulates it in
            # `.grad` until the last one's reduce-scatter (as ZeRO 0-2 accumulate theirs), and
            # the plan counts it so (`cost_models.memory.runtime_phases`, ZeRO 3); the hooks
            # MemTracker installs for parameters label it as made and as accumulated
            mt._track_module_params_and_buffers(_Holder(unsharded), install_grad_hooks=True)
        if pm.low is not None:    # ZeRO-3 under bf16/fp16: FSDP's fp32 shards are the masters
            mt.label(fp.sharded_param, _Ref.MASTER)
    masters = getattr(pm, "masters", None)
    if masters is not None:
        for m in masters.masters:
            mt.label(m, _Ref.MASTER)
    if getattr(pm, "zero12", False):
        mt.label(pm.flat_shard, _Ref.MASTER)
        eg = getattr(pm, "expert_groups", None)
        if eg is not None and eg.flat_shard is not None:     # the expert weights' own shard
            mt.label(eg.flat_shard, _Ref.MASTER)
    mt._track_optimizer_states(_MemRefType.OPT, pm.optimizer)
    for p in _optimizer_params(pm.optimizer):
        if p.grad is not None:
            mt.label(p.grad, _MemRefType.GRAD)
    for buf in _pipeline_buffers(pm):
        mt.label(buf, _Ref.PIPE)
    for x in batch:
        mt.label(x, _Ref.INPUT)


class _Holder(nn.Module):
    def __init__(self, p: nn.Parameter) -> None:
        super().__init__()
        self.p = p


def _optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _alive_storages() -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """(storage, a tensor using it) of every tensor the garbage collector can see, each storage once."""
    out: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
    with warnings.catch_warnings():   # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        if obj.device.type == "meta":
            continue
        try:
            sts = get_untyped_storages(obj)
        except (AssertionError, RuntimeError, NotImplementedError):
            continue   # a tensor subclass without storages (fake, functional): nothing to count
        for st in sts:
            out.setdefault(id(st), (st, obj))
    return list(out.values())


def baseline() -> WeakIdKeyDictionary:
    """The storages alive now (weakly held): pass to `track_step` to leave them out of its
    unregistered-tensor sweep (what a process held before it built the ParallelModel: other
    models of the same job, the data)."""
    d = WeakIdKeyDictionary()
    for st, _ in _alive_storages():
        d[st] = True
    return d


def register_unregistered(mt: StepMemTracker, device: torch.device,
                          skip: WeakIdKeyDictionary | None = None) -> tuple[int, list[str]]:
    """Register as "other" the storages on `device` alive now that `mt` does not track yet (and
    `skip` does not hold); returns their bytes and a description of the largest few."""
    found = []
    for st, t in _alive_storages():
        if st.device != device or st.nbytes() == 0 or mt._WINFO.get(st, None) is not None:
            continue
        if skip is not None and skip.get(st, None) is not None:
            continue
        mt.label(t, _MemRefType.OTH)
        found.append((st.nbytes(), f"{type(t).__name__}{tuple(t.shape)} {t.dtype}"))
    found.sort(key=lambda x: -x[0])
    return sum(n for n, _ in found), [f"{d}: {n} B" for n, d in found[:6]]


def track_step(pm: Any, batch: Sequence[Any], counter: Any = None, *, sweep: bool = True,
               skip: WeakIdKeyDictionary | None = None, top: int = 0,
               timeline: bool = False) -> tuple[Any, MemoryReport]:
    """Run `pm.train_step(batch, counter=counter)` under the tracker; returns its result and the
    `MemoryReport`. Measure a step after the first (the first allocates the optimizer state
    during its update). `sweep`: also count, as "other", the storages on the device alive at the
    start that `register` did not cover, except those in `skip` (a `baseline()` taken before
    the ParallelModel was built); they are listed in `MemoryReport.untracked` (a gc walk).
    `top` > 0: `MemoryReport.peak_tensors` lists the `top` largest storages alive at the peak,
    each with its label and the op, module, pass and phase that made it (slows the step).
    `timeline`: `MemoryReport.timeline` records the bytes by category after every op that
    changed them (a list as long as the step's ops: for finding where a peak comes from)."""
    global _ACTIVE
    mt = StepMemTracker(pm.device, top=top, timeline=timeline)
    register(mt, pm, batch)
    untracked, udesc = register_unregistered(mt, pm.device, skip) if sweep else (0, [])
    notes: list[str] = []
    restore: list[Callable[[], None]] = []

    def wrap(obj: Any, name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
        orig = getattr(obj, name)
        had = name in vars(obj)

        def wrapped(*a: Any, **k: Any) -> Any:
            before()
            try:
                return orig(*a, **k)
            finally:
                after()

        setattr(obj, name, wrapped)
        restore.append(lambda: setattr(obj, name, orig) if had else delattr(obj, name))

    def start_sync() -> None:
        # the backward's parameter gradients, however they were made (FSDP's, DTensor's), and
        # anything left in TEMP after the backward is what the sync starts from
        for p in pm.params:
            if p.grad is not None:
                mt.label(p.grad, _MemRefType.GRAD)
        mt.enter_phase("grad_sync")

    wrap(pm, "forward_backward", lambda: mt.enter_phase("forward_backward"), lambda: None)
    # torch's loss-parallel backward (`loss_parallel`'s NLL handler) propagates the global
    # (tokens x vocabulary) gradient's metadata by running the op on fake tensors: in verify's
    # fake mode those were counted as the step's (gpt3-2.7b tp4, mb 64: two fp32 [131072,
    # 51200] tensors, 50 GiB of a 68 GiB tracked peak)
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    def shadow_on() -> None:
        mt.shadow_depth += 1

    def shadow_off() -> None:
        mt.shadow_depth -= 1

    wrap(ShardingPropagator, "_propagate_tensor_meta_non_cached", shadow_on, shadow_off)
    wrap(pm, "sync_and_update", start_sync, lambda: None)
    masters = getattr(pm, "masters", None)
    if masters is not None:
        def stop_master_grads() -> None:
            mt.master_grads = False

        def start_master_grads() -> None:
            # the masters' fp32 gradients are made for the update: the plan's optimizer-step
            # phase (`cost_models.memory.runtime_phases`) holds them
            mt.master_grads = True
            mt.enter_phase("optimizer")

        wrap(masters, "step", start_master_grads, stop_master_grads)

    def opt_pre(opt: Any, args: Any, kwargs: Any) -> None:
        mt.master_grads = False
        for p in _optimizer_params(opt):
            if p.grad is not None:
                mt.label(p.grad, _MemRefType.GRAD)
        mt.enter_phase("optimizer")

    handle = pm.optimizer.register_step_pre_hook(opt_pre)
    restore.append(handle.remove)
    restore.append(_hooks_released())
    try:
        with mt:
            _ACTIVE = mt
            start = mt.current_bytes()
            mt.enter_phase("forward_backward")
            out = pm.train_step(batch, counter=counter)
            end = mt.current_bytes()
    finally:
        _ACTIVE = None
        for r in reversed(restore):
            r()
    peak_snap = mt.get_tracker_snapshot("peak").get(pm.device)
    if peak_snap is None:
        notes.append(f"nothing tracked on {pm.device} (tracked devices: {list(mt._peak_mem)})")
    peak = int((peak_snap or {}).get("Total", 0))
    phases = {ph: PhasePeak(int(v[0]), _detail(v[1]), _near(mt.phase_near.get(ph, {}), v[1]))
              for ph, v in mt.phase_peak.items()}
    peak_phase = max(phases, key=lambda ph: phases[ph].peak_bytes) if phases else ""
    if phases and phases[peak_phase].peak_bytes != peak:
        notes.append(f"phase peaks ({ {k: v.peak_bytes for k, v in phases.items()} }) miss the step's peak {peak}")
    if untracked:
        notes.append(f"{untracked} B alive at the step's start outside the ParallelModel's known "
                     f"tensors, counted as other: {udesc}")
    near = step_near(phases, peak, to_plan_categories(_detail(peak_snap)))
    return out, MemoryReport(peak_bytes=peak, detail=_detail(peak_snap), peak_phase=peak_phase, near=near,
                             phases=phases, start_bytes=start, end_bytes=end,
                             untracked_bytes=untracked, untracked=udesc, notes=notes,
                             peak_tensors=mt.peak_tensors, timeline=mt.timeline or [])


def _hooks_released() -> Callable[[], None]:
    """Make ModTracker's input hooks let go once they fired; returns the undo.

    MemTracker's ModTracker hooks every module's inputs that need a gradient with
    `register_multi_grad_hook` (mode "all"), whose closure holds the inputs' autograd nodes
    (`grad_fns`) and which sits in those tensors' hook dicts, which their nodes hold: a cycle
    through C++ that the garbage collector cannot break, never removed (torch 2.13). It keeps
    the nodes, and through their edges the leaves they end at (AccumulateGrad holds its
    tensor), alive to the step's end: a pipeline stage's received input (a leaf, dropped by the
    runtime after its backward, `pipeline_p2p.JustInTimeStage`) would stay counted. Here the
    hooks are removed once they fired, at the end of that backward (the engine's queued
    callback: a hook dict must not change while the engine walks it)."""
    from torch.distributed._tools import mod_tracker

    orig = mod_tracker.register_multi_grad_hook

    def register(tensors: Any, fn: Callable, *, mode: str = "all") -> Any:
        if mode != "all":
            return orig(tensors, fn, mode=mode)
        handle: list = []

        def once(grads: Any) -> None:
            fn(grads)
            if handle:
                torch.autograd.Variable._execution_engine.queue_callback(handle.pop().remove)

        handle.append(orig(tensors, once, mode=mode))
        return handle[0]

    mod_tracker.register_multi_grad_hook = register

    def undo() -> None:
        mod_tracker.register_multi_grad_hook = orig
    return undo


# -- the runtime's side: what it tells the tracker ----------------------------------------------

_ACTIVE: StepMemTracker | None = None      # the tracker of the step `track_step` runs, if any


@contextlib.contextmanager
def communication_buffers() -> Iterator[None]:
    """Tensors the forward makes inside are a redistribution's buffers ("comm_buffers"), not
    activations: the plan counts a gather's buffer and result among the buffers at the moment
    of the gather (`cost_models.memory._forward_over`). No effect when no step is tracked."""
    mt = _ACTIVE
    if mt is None:
        yield
        return
    mt.comm_depth += 1
    try:
        yield
    finally:
        mt.comm_depth -= 1


@contextlib.contextmanager
def pipeline_receives() -> Iterator[None]:
    """Tensors made inside are pipeline receive buffers ("pipeline_buffers"): the runtime makes
    them when the schedule posts the receive (`pipeline_p2p.JustInTimeStage`), mid-step, in the
    forward or the backward. No effect when no step is tracked."""
    mt = _ACTIVE
    if mt is None:
        yield
        return
    mt.pipe_depth += 1
    try:
        yield
    finally:
        mt.pipe_depth -= 1


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """A checkpointed region's ops run inside: what they make in the backward (the re-run
    forward) is activations, as MemTracker counts a checkpointed module's re-run (`_in_ac`)
    and the plan its recomputation's working set. For regions that are no module (the
    executor's spans of the exported program) and for checkpointed modules
    (`runtime.recompute`, `runtime.selective`): torch's checkpoint re-runs the module's
    `forward`, not its `__call__`, so MemTracker's own hooks see no re-run of it; they take
    the first submodule re-run for the region (`_ac_mod`) and end it at that submodule's end,
    so what the module's own code makes between its submodules (a block's residual sums,
    which the re-run makes and its backward reads) was counted as backward temporaries. The
    region is held here until the re-run ends (`_ac_mod` set to a marker no module's hook
    matches). No effect when no step is tracked."""
    mt = _ACTIVE
    if mt is None or mt._in_ac:
        yield
        return
    mt._in_ac, held = True, mt._ac_mod
    mt._ac_mod = _REGION_MARK
    try:
        yield
    finally:
        mt._in_ac, mt._ac_mod = False, held


class _Region:
    """What `recomputing` holds MemTracker's `_ac_mod` at: a weak reference to no module."""


_REGION_OBJ = _Region()
_REGION_MARK = weakref.ref(_REGION_OBJ)


def now_activation(t: torch.Tensor) -> None:
    """A redistribution's result, once made, is an activation like any other op's output (the
    peak seen while it was made keeps it as a buffer). No effect when no step is tracked."""
    mt = _ACTIVE
    if mt is not None and any(mt._WINFO.get(st, (None,))[0] is not None
                              and mt._WINFO[st][0].reftype == _Ref.COMM for st in get_untyped_storages(t)):
        mt.label(t, _MemRefType.ACT)


# -- the plan's side ---------------------------------------------------------------------------

def predicted_for_rank(plan: Any, rank: int) -> dict | None:
    """The plan's predicted memory for the device `rank`: of the plan entries (chunks) holding
    it, the one with the largest predicted peak (each entry's prediction is the device's peak,
    so chunks are not summed). None when the plan has no per-stage predictions. Keys:
    `stage`, `peak_bytes`, the plan categories, `peak_phase` (when the plan gives one)."""
    best = None
    for s in plan.stages:
        if rank not in s.devices or s.predicted is None:
            continue
        if best is None or s.predicted.peak_memory_bytes > best.predicted.peak_memory_bytes:
            best = s
    return None if best is None else predicted_of_stage(best)


# the plan's phase names (`schema.plan.MemoryPhase`) -> the tracker's (`PHASES`)
TRACKED_PHASE = {"forward_backward": "forward_backward", "grad_sync": "grad_sync", "optimizer_step": "optimizer"}


def predicted_of_stage(s: Any) -> dict:
    """A stage's predicted memory as a flat dict (fields the plan may not carry default to 0 / "");
    `phases`: each phase's peak by the tracker's phase names (plans of format_version 6 on)."""
    p = s.predicted
    phases = {TRACKED_PHASE.get(k, k): {"peak_bytes": float(v.peak_memory_bytes),
                                         **{c: float(getattr(v, f"{c}_bytes")) for c in PLAN_CATEGORIES}}
              for k, v in (getattr(p, "phases", None) or {}).items()}
    return {"stage": s.index, "peak_bytes": float(p.peak_memory_bytes), "phases": phases,
            "weights": float(getattr(p, "weights_bytes", 0.0) or 0.0),
            "gradients": float(getattr(p, "gradients_bytes", 0.0) or 0.0),
            "optimizer": float(getattr(p, "optimizer_bytes", 0.0) or 0.0),
            "activations": float(getattr(p, "activations_bytes", 0.0) or 0.0),
            "buffers": float(getattr(p, "buffers_bytes", 0.0) or 0.0),
            "peak_phase": str(getattr(p, "peak_phase", "") or "")}


def fullest_stage(plan: Any) -> dict | None:
    """`predicted_of_stage` of the plan entry with the largest predicted peak."""
    stages = [s for s in plan.stages if s.predicted is not None]
    if not stages:
        return None
    return predicted_of_stage(max(stages, key=lambda s: s.predicted.peak_memory_bytes))


def relative_error(tracked: float, predicted: float) -> float | None:
    """(predicted - tracked) / tracked: positive when the plan overestimates."""
    return (predicted - tracked) / tracked if tracked else None
