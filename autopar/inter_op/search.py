"""The joint plan search: dp x tp x pp, micro-batching, schedule, recomputation, ZeRO.

For every tensor-parallel degree tp and data-parallel degree dp (dp * tp * pp = devices; a stage
is a sub-mesh of dp * tp devices that is a power-of-two slice of a node or whole nodes), every
micro-batch size, schedule and ZeRO stage, Alpa's DP (`dp.stage_dp`) slices the layers into the
pp stages and picks each stage's recomputation (the fastest policy whose memory fits), and the
candidate with the least predicted iteration time wins. Candidates are visited in the order of
a lower bound (perfect balance, no bubble) and skipped once that bound exceeds the best found.

What is approximated, and why (to keep a 1000-GPU search within seconds on two cores):
- Each layer is costed on the tp part of the stage's mesh only (one 1-D mesh per tp degree,
  cached per layer signature x micro-batch x tp); the dp axis is added analytically: the batch
  split, the gradient all-reduce (ZeRO 0), reduce-scatter + all-gather (ZeRO 1, 2) or per
  micro-batch all-gathers and reduce-scatters (ZeRO 3) of each stage's parameters over dp,
  and ZeRO's memory split.
- Stage cost = the sum of its layers' costs (Alpa's "individual" profiling) plus the
  point-to-point transfer of the activation and its gradient at each boundary, on the link the
  boundary crosses: stages sit in pipeline order (`pack_stages`), so a hop between stages of whole
  nodes crosses the network, one between slices of a node only at the node's edge (`_Tables.
  hop_inter`; the DP knows each stage's position). Paid in full where the software waits the sends,
  only beyond the compute they run beside where it does not (`SoftwareSpec.pipeline_send_overlap`,
  `_Tables.stage_p2p`), split over tp with an all-gather on receipt under Megatron-LM 2021's
  scatter/gather (`pipeline_send_split`). The pipeline's fill and drain carry 2 (p - 1) transfers on
  their critical path even when the steady state hides them: not priced (under 0.1% of the
  published pipelined runs' steps).
- All stages share one (dp, tp) logical mesh, because the runtime feeds every data-parallel
  replica its own micro-batch stream (dp x micro-batch x micro-batches = global batch). Alpa's
  per-stage choice among a sub-mesh's logical meshes is thereby fixed per candidate, and the
  outer loop enumerates it instead.
- The gradient sync and the optimizer step run once per iteration after the pipeline drains:
  they add max over stages to T* (not part of the DP objective). Whether the sync overlaps the
  backward is the software's choice (`SoftwareSpec.grad_sync_overlap`; autopar's runtime and
  Megatron-LM 2021 do not overlap it): with overlap, a stage's gradient reduction (ZeRO 0's
  all-reduce, ZeRO 1/2's reduce-scatter) runs during its last micro-batch's backward and only
  what exceeds that backward is paid (`_exposed_sync`); the all-gather of ZeRO 1/2, the flat
  buffers' copies and ZeRO-3's per-unit collectives are paid as before. The gradient of a
  parameter tied between the first and last stage (GPT's embedding) is all-reduced between
  those stages.
- Interleaved 1F1B: the layers are cut into pp * v chunks minimising the largest chunk
  (`balanced_chunks`, uniform recomputation per candidate), chunk c on stage c mod pp;
  T = m * t_max + (sum_d t_d - t_max) / v (bubble (p - 1) / (v m) of the ideal for balanced
  stages; `interleaved_time`: chunks may be uneven, e.g. the embedding or the loss alone with
  `Constraints.account_in_split`); Megatron requires m % pp == 0. Alpa's DP is not used here: its stage times are
  sums of v non-adjacent chunks, which its additive recurrence cannot express.
- ZeRO 1 and 2 cost the same communication (one reduce-scatter + one all-gather per stage and
  step, as the runtime issues them); ZeRO 2's memory counts sharded gradients (design.md).
  ZeRO 3 (FSDP per layer) all-gathers each unit's weights for every micro-batch's forward and
  backward, in a pipeline m + 1 times a step (`_zero3_gathers`, as `planner._zero3_counts`
  counts them), each collective's latency once per unit (`_Tables.zero_mb`; Alpa's free
  sub-mesh choice prices 2 a micro-batch whatever its stage count).
- Stages of different tp (Alpa's free sub-mesh choice, small clusters): a stage feeding a
  neighbour with more tp ranks sends it one copy per receiving rank (the runtime's fan-out);
  the DP costs one, the extra copies are added to the stages it picks (`_fanout_sends`). A
  parameter tied between stages of different tp is all-reduced whole over all their ranks.
  With per-op solutions (the ILP) such stages run op by op as solved, costed so; tensors cross
  between tp degrees replicated (`stage_layouts.chunk_layouts`: the sender's gathers are counted
  in the plan's collectives, not in the stage times); a split the executor cannot run (a
  receiver's solution wanting a crossing tensor sharded) is rejected and recorded
  (`SearchResult.skipped`, the plan's `search["skipped"]`). `Constraints.stage_tp` pins every
  stage's tp degree in order (`_pinned_hetero`).
- Gradient accumulation: after the first micro-batch, every backward adds the weight gradients
  into the accumulated ones (read both, write the sum), a memory-bound cost per micro-batch
  in the stage time (`_Tables.accum`).
- GPipe has 1F1B's time in this model and more memory, so it is only planned when pinned.
- Expert parallelism (a model with routed experts, `inter_op.experts`): every ep dividing dp
  and the expert count is a candidate of its own (`Candidate.ep`), its layers' costs with the
  experts sharded over ep (weights, the dropless all-to-all exchange, the grouped GEMMs' sizes);
  the expert gradients are synced over the dp / ep ranks holding the same experts (`_Tables.
  sync`), ZeRO-1/2 shard their optimizer state over those ranks, ZeRO-3 their weights,
  gradients and optimizer state (`_Tables.phases`), each experts module an FSDP unit of its
  own whose per-micro-batch all-gathers (and reduce-scatters, `rs_each`) run over those ranks
  (`_Tables.zero_mb`, as `runtime.experts.ExpertGroups.fully_shard` makes them). With tp > 1,
  the experts folded over the stage's dp x tp ranks (Megatron-Core's MoE parallel folding,
  `Candidate.fold`): every ep dividing dp x tp and the expert count, the
  gradients synced over dp x tp / ep copies (ep apart, `_Tables.set_experts`); tried where the
  runtime executes it (`_fold_executable`) or where ep / expert_dp pin it.
- ZeRO-3's gradient sync (`Candidate.rs_each`, `Plan.zero3_grad_sync`): accumulated unsharded
  over the micro-batches and reduce-scattered in the last one's backward, or, where that does
  not fit (or pinned), reduce-scattered in every micro-batch's backward (FSDP2's default; what
  Megatron-FSDP and the distributed optimizer do to hold 4 / dp bytes of gradient a parameter):
  the fp32 shards held, m reduce-scatters per step (`_Tables.zero_mb`) and none at its end. One
  stage only (torch.pipelining syncs a stage's gradients after its last micro-batch).
- Context parallelism (`inter_op.context_parallel`): a candidate's cp ranks split every
  sequence, a stage is dp x cp x tp devices, its layers costed on one cp rank, its gradient
  sync and ZeRO shards over dp x cp (the tables' dp). Tried from `LONG_SEQUENCE` tokens on, or
  where nothing fits without it (`context_degrees`: the search of a shorter model is the one
  before); a cp layout the runtime does not execute (expert and tensor parallelism in pipeline stages) is
  left out unless cp is pinned (`_executable`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from autopar.capture.graph import OpGraph
from autopar.inter_op import context_parallel
from autopar.inter_op.dp import first_feasible, stage_dp
from autopar.inter_op.experts import ExpertCosting
from autopar.inter_op.layers import Layer
from autopar.inter_op.stage_cost import MAIN_UNIT, AnalyticProvider, LayerCost, axis_link, coll_time
from autopar.schema import ClusterSpec, Constraints, PlanError
from autopar.schema.constraints import RECOMPUTES
from autopar.schema.software import resolve_software
from cost_models.communication import axis_collective_time
from cost_models.compute import grad_accumulation_bytes, memory_time, optimizer_step_time, unscale_time
from cost_models.memory import (
    ADAMW_TEMPORARIES,
    PRECISION_POLICIES,
    adamw_temporary_elems,
    fused_optimizer,
    holder_order,
    mixed_precision,
    reduce_scatter_copies_input,
    runtime_phases,
    usable_memory,
)
from cost_models.schedules import (
    ACTS,
    GRADS,
    RECV_GRADS,
    RECV_INPUTS,
    SCHEDULES,
    SENT_GRADS,
    SENT_OUTPUTS,
    backwards_in_a_row,
    executed_schedule,
    held_moments,
    save_moments,
    schedule_kind,
)

INF = float("inf")
MAX_MICROBATCH = 64
HETERO_MAX_UNITS = 32
HETERO_MAX_TABLE = 1_000_000      # L^2 x units x sub-meshes x stages: one DP run stays ~ms
HETERO_MAX_LAYERS = 64


@dataclass
class StageResult:
    """One pipeline stage (device group) of the chosen plan."""

    chunks: list[tuple[int, int]]     # layer ranges [k, j), one per virtual chunk
    recompute: str
    t_mb: float                       # seconds per micro-batch (all its chunks)
    compute_mb: float                 # compute part of t_mb (incl. recomputation)
    comm_mb: float                    # tp collectives + p2p + ZeRO per-micro-batch collectives
    sync_s: float                     # per iteration: dp gradient sync
    opt_s: float                      # per iteration: optimizer step
    param_elems: float                # per device
    weights_bytes: float = 0.0
    gradients_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buffers_bytes: float = 0.0        # the runtime's transient buffers at the peak
    peak_phase: str = "forward_backward"
    peak_bytes: float = 0.0
    tp: int = 1                       # this stage's tensor-parallel degree
    devices: list[int] = field(default_factory=list)
    tables: Optional["_Tables"] = None
    phases: list = field(default_factory=list)   # every phase / moment costed (`PhaseMemory`)
    # per chunk, the pipeline transfers it pays per micro-batch (in t_mb and comm_mb;
    # `_Tables.stage_p2p`: waited in full, or beyond the compute they run beside)
    chunk_p2p: list[float] = field(default_factory=list)

    def phase_peaks(self) -> dict[str, Any]:
        """The largest moment of each phase (`PhaseMemory` by phase name)."""
        out: dict[str, Any] = {}
        for ph in self.phases:
            if ph.phase not in out or float(ph.total) > float(out[ph.phase].total):
                out[ph.phase] = ph
        return out


@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    mb: int
    m: int
    schedule: str
    v: int
    zero: int
    iteration_s: float = INF
    pipeline_s: float = 0.0
    tail_s: float = 0.0
    stages: list[StageResult] = field(default_factory=list)
    costs: Optional["_Tables"] = None
    hetero_tps: tuple[int, ...] = ()  # Alpa's free sub-mesh choice: stages may differ in tp
    sp: bool = False                  # Megatron-SP on the tp axis (`Search.sp_provider`'s costs)
    ep: int = 1                       # expert parallelism: routed experts over ep dp ranks (`inter_op.experts`)
    cp: int = 1                       # context parallelism: each sequence over cp ranks (`inter_op.context_parallel`)
    etp: int = 1                      # expert tensor parallelism: each expert over tp (ep > 1, `inter_op.experts`)
    fold: bool = False                # MoE parallel folding: experts over ep of the dp x tp ranks (`inter_op.experts`)
    rs_each: bool = False             # ZeRO-3 reduce-scatters every micro-batch (`Plan.zero3_grad_sync`)
    # per recomputation policy, a lower bound on the iteration with every layer under it
    # (`Search._group_candidates`; empty: none known): an interleaved evaluation skips a policy
    # whose bound cannot beat the best plan found (`Search._evaluate_interleaved`)
    bounds: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def key(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.mb, self.schedule, self.v, self.zero, self.sp, self.ep, self.cp,
                self.etp, self.fold, self.rs_each)

    @property
    def expert_copies(self) -> int:
        """The ranks of a stage holding the same experts (expert data parallelism): dp x cp / ep,
        folded dp x tp / ep."""
        return self.dp * self.tp // self.ep if self.fold else self.dp * self.cp // self.ep

    @property
    def replicas(self) -> int:
        """The ranks of a stage holding the same parameter shards, which sync their gradients
        (and share ZeRO's shards): dp x cp."""
        return self.dp * self.cp


@dataclass
class SearchResult:
    best: Candidate
    layers: list[Layer]
    provider: object
    evaluated: int
    considered: int
    seconds: float
    min_memory_bytes: float
    # candidates the search left out because the runtime could not run them, and why
    # ("hetero dp=1 mb=2 tp=(2, 1, 1)": reason); recorded in the plan's `search`
    skipped: dict[str, str] = field(default_factory=dict)
    experts: Optional[ExpertCosting] = None     # the model's expert blocks (`inter_op.experts`)


class _Tables:
    """Per-layer cost arrays for one (micro-batch, tp, dp, zero) and stage aggregates over ranges."""

    # what depends on the layers' costs alone (not on dp, ZeRO or the batch), shared by the
    # tables of one cost list (`like`)
    _COST_ONLY = ("base", "compute", "fwd_time", "bwd_time", "iter",
                  "rc", "rc_compute", "layer_comm", "priced", "act", "work", "work_rc", "pel_layer", "pel",
                  "shared",
                  "out", "cross", "cross_grad", "valid", "kk", "jj", "range_pel", "range_in", "range_out",
                  "range_send", "range_send_grad", "range_act", "range_in_saved", "range_out_kept", "range_work",
                  "range_work_rc", "range_work_rc_grads", "work_grads", "range_work_tmp", "range_root", "_layers",
                  "work_tmp_grads", "range_work_tmp_grads", "root_own",
                  "range_maxtensor", "_first", "live")

    def __init__(self, costs: list[LayerCost], cluster: ClusterSpec, dtype: str, dp: int, tp: int,
                 zero: int, layers: list[Layer], batch: tuple[float, float] = (0.0, 0.0),
                 like: Optional["_Tables"] = None, rooted: frozenset = frozenset(),
                 rooted_tied: Optional[frozenset] = None, policy: Optional[str] = None,
                 cast_bytes: float = 0.0, cast_saved: float = 0.0, zero_optimizer: str = "flat",
                 unscale_bytes: float = 0.0, send_split: bool = False) -> None:
        """`like`: a table of the same `costs` list (another dp or ZeRO stage), whose cost-only
        arrays are reused as they are (read-only) instead of being built again. `rooted`: the
        modules ZeRO-3 leaves to the root unit (`rooted_modules`); `rooted_tied`: of those, the
        ones a pipeline chunk leaves to its root too (a parameter under several names), the
        others are units of their own there (default: all of them). `policy`: the precision policy
        of the model states, gradient accumulation and sync (`SoftwareSpec.state_policy`; default
        `dtype`); `cast_bytes`, `cast_saved`: bytes per parameter element a micro-batch moves
        casting fp32 parameters and saves of the casts (`SoftwareSpec.param_cast_bytes`,
        `param_cast_saved_bytes`; 0 with parameters in the training dtype); `zero_optimizer`: how
        ZeRO-1 shards the optimizer (`SoftwareSpec.zero_optimizer`, `runtime_phases`);
        `unscale_bytes`: bytes per gradient element the step moves unscaling the gradients under
        fp16 dynamic loss scaling (`SoftwareSpec.loss_scaling_bytes`; 0 without); `send_split`:
        each of a stage's tp ranks sends 1/tp of a boundary's tensors and the receiving stage
        all-gathers them over its tp ranks (`SoftwareSpec.pipeline_send_split`)."""
        self.policy = policy or dtype
        self.zero_optimizer = zero_optimizer
        self.unscale_bytes = unscale_bytes
        self.cast_bytes, self.cast_saved = cast_bytes, cast_saved
        self.costs = costs
        self.rooted = rooted
        self.rooted_tied = rooted if rooted_tied is None else rooted_tied
        # which `module_units` the unit tables read: 0 the whole model's, 1 a pipeline chunk's
        self._units_variant = 0
        self._ranged: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        L = len(costs)
        self.L = L
        self.dp, self.tp, self.zero = dp, tp, zero
        # the rank's share of the step's batch: the first input (held by the first stage) and
        # the others (the targets, held by the last), as `ParallelModel.local_batch` keeps them
        self.batch_first, self.batch_rest = batch
        self.cluster = cluster
        self.dtype = dtype
        if like is not None and like.costs is costs and like.dtype == dtype and like.cast_saved == cast_saved:
            for a in self._COST_ONLY:
                setattr(self, a, getattr(like, a))
            if "range_unit" in like.__dict__:
                self.__dict__["range_unit"] = like.__dict__["range_unit"]
        else:
            self._cost_ranges(costs, layers, dtype)
        self.wgo = PRECISION_POLICIES[self.policy]
        kk, jj = self.kk, self.jj
        # a pipeline hop joins rank r of one stage to rank r of the next, `stage_size` ranks
        # apart (stages placed in pipeline order, pp outermost: `pack_stages`, Megatron's
        # tp-cp-ep-dp-pp order): each transfer's time per boundary on either link (`hop_inter`
        # says which a hop crosses); a gradient sends the crossing tensors that need one
        self.stage_size = dp * tp
        links = {False: cluster.intra_node, True: _inter_link(cluster)}
        split = tp if send_split and tp > 1 else 1
        self.p2p_on = {x: (np.array([coll_time("send_recv", b / split, 2, ln) for b in self.cross]),
                           np.array([coll_time("send_recv", b / split, 2, ln) for b in self.cross_grad]))
                       for x, ln in links.items()}
        # with the split, what a stage receives is all-gathered over its tp ranks before it is
        # read (Megatron-LM 2021's gather_split_1d_tensor after the transfer's synchronize):
        # waited, on the tp group's link; the activation at its start, the gradient at its end
        tpl = axis_link(cluster, tp)
        gather = [np.array([coll_time("all_gather", b, split, tpl) if split > 1 else 0.0 for b in arr])
                  for arr in (self.cross, self.cross_grad)]
        self.range_gathers = (np.where(self.kk > 0, gather[0][np.clip(self.kk - 1, 0, L - 1)], 0.0)
                              + np.where(self.jj < L, gather[1][np.clip(self.jj - 1, 0, L - 1)], 0.0))
        # on the link every hop crosses when stages are whole nodes (a stage of a node's slice:
        # inside the node), waited: the fan-out's extra copies (`Search._fanout_sends`) and the
        # stages of different sizes (`hetero`), whose placement is not pipeline-ordered
        self.p2p = self.p2p_on[self.whole_node_hops][0]
        self._stage_p2p: dict[tuple, np.ndarray] = {}
        self.dp_link = _dp_link(cluster, dp, tp)
        self.zero3 = zero == 3 and dp > 1
        # ZeRO-3 reduce-scatters every micro-batch's gradients (`Plan.zero3_grad_sync`
        # "microbatch", set by `Search._tables`): each backward holds its units' gradients as one
        # micro-batch's does, their fp32 shards accumulated; one reduce-scatter per micro-batch
        self.rs_each = False
        # ZeRO-3's collectives on their own streams beside the compute (`SoftwareSpec.
        # zero3_overlap`, set by `Search._tables`): a micro-batch pays what exceeds its compute
        self.zero3_overlap = False
        # the layers' collectives (tp, cp, the expert exchange) all inside a node while every
        # ZeRO-3 group that moves bytes spans nodes (`_zero3_links_apart`, set by `Search._tables`):
        # under `zero3_overlap` the micro-batch's waits on the former cover the latter too
        self.zero3_links_apart = False
        # the weight-gradient GEMMs accumulate into the gradients kept across micro-batches
        # (`SoftwareSpec.gradient_accumulation_fusion`, set by `Search._tables`): no separate pass
        self.accum_fused = False
        # FSDP2's reduce_dtype float32 (`SoftwareSpec.grad_dtype` "fp32_reduce", set by `Search.
        # _tables`): ZeRO-3's dense units accumulate their unsharded gradients and reduce-scatter
        # them in fp32 (`dense_grad_bytes`); the experts' and the shards keep the policy's dtype
        self.reduce_fp32 = False
        # what the expert exchange's library holds for the run (DeepEP's buffers, `ExpertCosting.
        # comm_buffer_bytes`, set by `Search._tables`): a buffer in every phase
        self.comm_buffers = 0.0
        self._zero_ranges: dict = {}     # `range_zero_mb`: per gathers, and per (gathers, recomputation)
        self._relief: dict[str, np.ndarray] = {}
        self._tied_work: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}   # `tied_work`, per policy
        self._temporaries: dict[tuple, float] = {}           # `chunk_temporaries`, per chunks
        self._holders: dict[tuple[int, int], list] = {}       # `_holder_sizes`, per layer range
        # `recompute_terms`, per (recomputation, ZeRO-3 with one micro-batch)
        self._rc_terms: dict[tuple[str, bool, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # expert parallelism (`set_experts`): ep, and the expert weights' elements per layer range
        self.ep = 1
        self.ecopies, self.estride = 1, 1
        self.expert_pel = np.zeros(L + 1)
        self.expert_units = np.zeros(L)
        self.range_expert_temps = np.zeros((L, L + 1))
        self.range_epel = np.zeros((L, L + 1))
        self.range_eunits = np.zeros((L, L + 1))      # experts modules (ZeRO-3 units of their own)
        # the batch a range's stage holds: the first input if it starts the model, the other
        # inputs (targets) if it ends it
        self.range_batch = np.where(kk == 0, self.batch_first, 0.0) + np.where(jj == L, self.batch_rest, 0.0)

    @property
    def whole_node_hops(self) -> bool:
        """Whether every pipeline hop crosses nodes whatever the stage's position: stages of whole
        nodes (`stage_size` >= a node) on a cluster of several."""
        c = self.cluster
        return c.num_nodes > 1 and c.inter_node is not None and self.stage_size >= c.devices_per_node

    def hop_inter(self, src: int, p: int) -> bool:
        """Whether the hop from the stage at pipeline position `src` of `p` to the next one
        ((src + 1) mod p: an interleaved pipeline's last group hands its chunk to the first)
        crosses nodes. Stages sit in pipeline order, `stage_size` ranks each (`pack_stages`):
        rank r of stage i is i x stage_size + r, a node's slice never straddles nodes, so the hop
        crosses when the two stages' first ranks are on different nodes: always for whole-node
        stages; for slices of a node, at the node's edge only."""
        c = self.cluster
        if c.num_nodes <= 1 or c.inter_node is None or p <= 1:
            return False
        a, b = src * self.stage_size, ((src + 1) % p) * self.stage_size
        return a // c.devices_per_node != b // c.devices_per_node

    def stage_p2p(self, beside: Optional[str], fwd_inter: bool, bwd_inter: bool) -> np.ndarray:
        """Per layer range [k, j): the pipeline transfers a stage of it pays per micro-batch, its
        activation sent forward at its end (`fwd_inter`: over the network) and its input's
        gradient back at its start (`bwd_inter`). `beside` None: the sends are waited before the
        next op, paid in full (`SoftwareSpec.pipeline_send_overlap` without the schedule); else
        they run beside the compute (`ScheduleKind.sends_beside`) and each direction pays only
        what exceeds its window, max(0, transfer - window), the window the range's own forward
        time (forward and tp collectives, recomputation left out) or backward time: "same", a
        forward send beside the next forward and a gradient send beside the next backward
        (GPipe); "opposite", a forward send beside the backward after it and a gradient send
        beside the next forward (1F1B, Megatron-Core's overlapped interleaving)."""
        key = (beside, fwd_inter, bwd_inter)
        out = self._stage_p2p.get(key)
        if out is None:
            L, kk, jj = self.L, self.kk, self.jj
            send_fwd = np.where(jj < L, self.p2p_on[fwd_inter][0][np.clip(jj - 1, 0, L - 1)], 0.0)
            send_bwd = np.where(kk > 0, self.p2p_on[bwd_inter][1][np.clip(kk - 1, 0, L - 1)], 0.0)
            if beside is not None:
                fwd, bwd = self.ranged(self.fwd_time), self.ranged(self.bwd_time)
                send_fwd = np.maximum(0.0, send_fwd - (fwd if beside == "same" else bwd))
                send_bwd = np.maximum(0.0, send_bwd - (bwd if beside == "same" else fwd))
            out = self._stage_p2p[key] = send_fwd + send_bwd + self.range_gathers
            out.setflags(write=False)
        return out

    def position_p2p(self, beside: Optional[str], pos: int, p: int) -> np.ndarray:
        """`stage_p2p` of the stage (device group) at pipeline position `pos` of `p`: its
        forward sends to position pos + 1, its gradients to pos - 1 (mod p), each on the link
        that hop crosses (`hop_inter`)."""
        return self.stage_p2p(beside, self.hop_inter(pos, p), self.hop_inter((pos - 1) % p, p))

    @property
    def range_p2p(self) -> np.ndarray:
        """`stage_p2p` waited, every hop on the whole-node rule's link (`p2p`): the search's
        position-free price (stages of different sizes)."""
        return self.stage_p2p(None, self.whole_node_hops, self.whole_node_hops)

    def _cost_ranges(self, costs: list[LayerCost], layers: list[Layer], dtype: str) -> None:
        """The arrays that depend on the layers' costs alone (`_COST_ONLY`)."""
        L = self.L
        pre = lambda xs: np.concatenate([[0.0], np.cumsum(xs)])  # noqa: E731
        self.base = pre([c.base_s for c in costs])
        self.compute = pre([c.fwd_s + c.bwd_s for c in costs])
        # a micro-batch's forward and backward time on the stream, with their tp collectives
        # (the windows pipeline sends can run beside: `stage_p2p`)
        self.fwd_time = pre([c.fwd_s + c.fwd_comm_s for c in costs])
        self.bwd_time = pre([c.bwd_s + c.bwd_comm_s for c in costs])
        self.iter = pre([c.iter_s for c in costs])
        self.rc = {r: pre([c.rc_extra_s.get(r, 0.0) for c in costs]) for r in RECOMPUTES}
        # of it, the recomputed forward's compute (its collectives left out): ZeRO-3's cover too
        self.rc_compute = {r: pre([c.rc_extra_s.get(r, 0.0) - c.rc_comm_s.get(r, 0.0) for c in costs])
                           for r in RECOMPUTES}
        # the layers' own collectives a micro-batch waits for (forward, backward, recomputed
        # forward): ZeRO-3's cover where their links are apart (`_Tables.zero3_links_apart`)
        self.layer_comm = {r: pre([c.fwd_comm_s + c.bwd_comm_s + c.rc_comm_s.get(r, 0.0) for c in costs])
                           for r in RECOMPUTES}
        # the policies every layer's cost prices (a cost naming none prices all alike): one a
        # provider leaves out would read as free, saving everything
        self.priced = frozenset(r for r in RECOMPUTES if all(r in c.act_bytes for c in costs if c.act_bytes))
        # with fp32 parameters, each layer's matrix ops save their weights' 2-byte casts
        # (`cast_saved` a parameter element; a tied one with its last user, the head, which casts
        # it: an embedding lookup reads the fp32 table); a layer recomputed in full saves none
        cast = self._cast_elems(costs) * self.cast_saved
        self.act = {r: pre([c.act_bytes.get(r, 0.0) + (0.0 if r == "full" else x) for c, x in zip(costs, cast)])
                    for r in RECOMPUTES}
        # transient in a layer's backward above what it saved, at its worst moment (its
        # activation gradients, the loss's fp32 input gradient, or a recomputed region's
        # re-made tensors: `LayerCost.backward_over`), and whether that moment recomputes
        self.work = {r: np.array([c.bwd_over.get(r, 0.0) for c in costs], dtype=float).reshape(L)
                     for r in RECOMPUTES}
        self.work_rc = {r: np.array([c.bwd_over_rc.get(r, False) for c in costs], dtype=bool).reshape(L)
                        for r in RECOMPUTES}
        # of a recomputation's moment, the gradients (`LayerCost.bwd_over_grads`)
        self.work_grads = {r: np.array([c.bwd_over_grads.get(r, 0.0) for c in costs], dtype=float).reshape(L)
                           for r in RECOMPUTES}
        # of a plain backward moment, its gradients; the rest (at most 0) the activations autograd
        # freed before it (NaN: not known, the whole transient counts as gradients)
        self.work_tmp_grads = {r: np.array([c.bwd_over_grads.get(r, np.nan) for c in costs], dtype=float).reshape(L)
                               for r in RECOMPUTES}
        # parameter elements per device: every layer's own, tied ones once per stage
        users: dict[str, list[int]] = {}
        elems: dict[str, float] = {}
        for i, c in enumerate(costs):
            for f, e in c.param_elems.items():
                users.setdefault(f, []).append(i)
                elems[f] = e
        self.pel_layer = np.array([sum(c.param_elems.values()) for c in costs])
        self.pel = pre(self.pel_layer)
        self.shared = [(f, elems[f], sorted(set(u))) for f, u in users.items() if len(set(u)) > 1]
        self.out = np.array([c.out_bytes for c in costs])
        # what a pipeline boundary after each layer sends forward, and its gradients back
        # (a provider that does not say what crosses: the layer's output alone)
        self.cross = np.array([c.cross_bytes if c.cross_tensors else c.out_bytes for c in costs])
        self.cross_grad = np.array([c.cross_grad_bytes if c.cross_tensors else c.out_bytes for c in costs])
        # ranges
        k = np.arange(L)[:, None]
        j = np.arange(L + 1)[None, :]
        self.valid = j > k
        kk, jj = np.broadcast_arrays(k, j)
        self.kk, self.jj = kk, jj
        pel = self.pel[np.clip(jj, 0, L)] - self.pel[kk]
        # ZeRO-3's root unit holds the parameters several layers read (`range_root`)
        root = np.zeros_like(pel)
        for _f, e, us in self.shared:
            cnt = sum(((kk <= u) & (u < jj)).astype(float) for u in us)
            pel = pel - np.maximum(cnt - 1, 0) * e
            root = root + np.where(cnt > 0, e, 0.0)
        self.range_pel = np.where(self.valid, pel, 0.0)
        # the activation a stage receives (its input) and sends (its output), in bytes
        self.range_in = np.where(kk > 0, self.cross[np.clip(kk - 1, 0, L - 1)], 0.0)
        self.range_out = np.where(jj < L, self.cross_grad[np.clip(jj - 1, 0, L - 1)], 0.0)
        # what a range's stage sends per micro-batch: its output forward, its input's gradient
        # back (a send the schedule still references keeps it: `held_moments`)
        self.range_send = np.where(jj < L, self.cross[np.clip(jj - 1, 0, L - 1)], 0.0)
        self.range_send_grad = np.where(kk > 0, self.cross_grad[np.clip(kk - 1, 0, L - 1)], 0.0)
        # one micro-batch's saved activations of a range: its layers' sum, less a tensor saved on
        # both sides of an inner boundary (an MLP layer ending in relu saves its output, the
        # next layer's matmul the same tensor); of its input, what its first layer saves (the
        # receive buffer, counted by `recv_buffers`), and of its output what the stage's forward
        # cache keeps beyond what its last layer saved
        prev_out = np.concatenate([[0.0], self.out[:-1]]) if L else np.zeros(0)
        in_saved = {r: np.array([c.in_saved.get(r, prev_out[i]) for i, c in enumerate(costs)]) for r in RECOMPUTES}
        out_saved = {r: np.array([c.out_saved.get(r, 0.0) for c in costs]) for r in RECOMPUTES}
        self.range_act, self.range_in_saved, self.range_out_kept = {}, {}, {}
        # `live[r][x]`: the prefix of what layers 0..x-1 keep saved at the backward moments of
        # a range, each tensor saved on both sides of an inner boundary once, less what each
        # keeps to the step's end (`LayerCost.kept_saved`: no op's backward frees it, a CPU
        # mse_loss's unreduced storage): layer i's backward moment holds live[i + 1] - live[j]
        # above (or below) the range [k, j)'s saved activations, whatever k
        self.live = {}
        for r in RECOMPUTES:
            ov = np.minimum(out_saved[r][:-1], in_saved[r][1:]) if L > 1 else np.zeros(0)
            ovp = pre(ov)                       # ovp[i]: the inner boundaries 1..i
            kept = pre([c.kept_saved.get(r, 0.0) for c in costs])
            self.live[r] = self.act[r] - np.concatenate([[0.0], ovp]) - kept
            inner = ovp[np.clip(jj - 1, 0, L - 1)] - ovp[kk]
            self.range_act[r] = np.where(self.valid, self.act[r][np.clip(jj, 0, L)] - self.act[r][kk] - inner, 0.0)
            self.range_in_saved[r] = np.where(kk > 0, in_saved[r][kk], 0.0)
            last = np.clip(jj - 1, 0, L - 1)
            self.range_out_kept[r] = np.where(jj < L, np.maximum(self.out[last] - out_saved[r][last], 0.0), 0.0)
        # the backward's transient over a range, above the range's saved activations: layer i's
        # transient (`work`) while the layers after it in the range have already freed what they
        # saved (autograd releases a node's saved tensors once its backward ran, unless the graph
        # is retained: `release_variables()` in torch/csrc/autograd/engine.cpp `call_function`), so
        # max_i (work_i - acts of layers i+1..j-1): the loss gradient of a last stage is live
        # before any recomputation, a block's recomputation after the head freed its logits.
        # Split by what the transient is: recomputed activations (`range_work_rc`) or activation
        # gradients (`range_work_tmp`), each -inf where none of the range's layers has that kind;
        # of the recomputed kind's moment, its gradients (`range_work_rc_grads`); of the other
        # kind's, its gradients too (`range_work_tmp_grads`, NaN where not known): the rest of
        # that transient, at most 0 but where a kept output is counted again, is activations
        # (what autograd freed of the layer's and the later layers' saved tensors)
        self.range_work, self.range_work_rc, self.range_work_tmp = {}, {}, {}
        self.range_work_rc_grads, self.range_work_tmp_grads = {}, {}
        for r, wk in self.work.items():
            P = self.live[r]
            rc_kind = self.work_rc[r]
            v = wk + P[1:]
            Wrc = _range_max(np.where(rc_kind, v, -INF)) - P[None, :]
            Wtmp = _range_max(np.where(rc_kind, -INF, v)) - P[None, :]
            self.range_work_rc[r], self.range_work_tmp[r] = Wrc, Wtmp
            at = _range_argmax(np.where(rc_kind, v, -INF))
            self.range_work_rc_grads[r] = np.where(at >= 0, self.work_grads[r][np.maximum(at, 0)], 0.0)
            at = _range_argmax(np.where(rc_kind, -INF, v))
            self.range_work_tmp_grads[r] = np.where(at >= 0, self.work_tmp_grads[r][np.maximum(at, 0)], np.nan)
            self.range_work[r] = np.maximum(np.maximum(Wrc, Wtmp), 0.0)
        self._outputs_held()
        self._first: dict[tuple[str, bool], tuple[np.ndarray, ...]] = {}
        self._layers = layers
        # and every parameter no unit holds: those of the modules it keeps (`rooted`: a tied
        # embedding's module holds the position table too) and those outside the layers'
        # modules (a final norm), gathered from the forward to the backward as the tied ones
        # (gpt-tiny ZeRO-3: wpe and ln_f, 1.25 KiB at dp2 x tp2, were left out)
        shared_names = {f for f, _, _ in self.shared}
        own = [sum(e for f, e in c.param_elems.items() if f not in shared_names) - sum(us)
               for c, us in zip(costs, self.module_units)]
        self.root_own = np.array([max(x, 0.0) for x in own], dtype=float).reshape(L)
        own_pre = pre(self.root_own)
        root = root + own_pre[np.clip(jj, 0, L)] - own_pre[kk]
        # a pipeline chunk (every range but the whole model) holding a shared parameter under
        # one name alone shards it with its module, a unit of its own freed after its forward
        # (`planner.zero3_units`, pipelined: nanoGPT's `wte` read by the head on another stage);
        # the chunk's root keeps it where it has several names (a tied `lm_head.weight`)
        for _f, e, o in self._unit_shared:
            root = root - np.where(self.pipelined & (kk <= o) & (o < jj), e, 0.0)
        self.range_root = np.where(self.valid, root, 0.0)
        # AdamW's temporaries at their worst, per device (`adamw_temporary_elems`: the tensors
        # in the order the layers hold them, the first of a layer after the last of the one
        # before, the layer's first where it starts the range: the tensor stepped before it is
        # another stage's then)
        temps, own, prev = [], [], 0.0
        for c in costs:
            sizes = list(c.param_elems.values())
            temps.append(adamw_temporary_elems([prev] + sizes) if sizes else 0.0)
            own.append(adamw_temporary_elems(sizes) if sizes else 0.0)
            prev = sizes[-1] if sizes else prev
        later = np.full((L, L + 1), -INF)
        if L > 1:
            later[:-1] = _range_max(np.array(temps))[1:]          # layers k+1 .. j-1
        first = np.array(own, dtype=float).reshape(L)[:, None]
        self.range_maxtensor = np.where(self.valid, np.maximum(np.maximum(first, later), 0.0), 0.0)

    @staticmethod
    def _cast_elems(costs: list[LayerCost]) -> np.ndarray:
        """Parameter elements each layer casts per micro-batch: its own, a tensor several layers
        read counted once, with the last of them."""
        last: dict[str, tuple[int, float]] = {}
        for i, c in enumerate(costs):
            for f, e in c.param_elems.items():
                last[f] = (i, e)
        out = np.zeros(len(costs))
        for i, e in last.values():
            out[i] += e
        return out

    def _outputs_held(self) -> None:
        """A pipeline chunk's output stays in the stage's forward cache until the chunk's
        backward ends, so what the chunk's own ops save of it (`out_saved`) is not freed by
        their backward as a saved activation would be: it leaves the range's activations for
        the kept output, and every backward moment after its savers' holds it, growing the
        range's transient there. For the last layer the moments after its savers are bounded by
        all of its own, taken with its output's gradient the receive buffer
        (`LayerCost.bwd_over_given`). Ranges [k, j) with j < L (a stage before the last; the
        last chunk computes the loss inside, `runtime.graph_stages`, and sends nothing on)."""
        L = self.L
        for r in RECOMPUTES:
            P = self.live[r]
            for j in range(1, L):
                last, held, k = self.costs[j - 1], float(self.costs[j - 1].out_saved.get(r, 0.0)), np.arange(j)
                # its output's gradient is the receive buffer (`recv_buffers`), not one its
                # backward makes
                own = last.bwd_over_given.get(r, self.work[r][j - 1])
                if (held <= 0 and own == self.work[r][j - 1]
                        and last.bwd_over_given_rc.get(r, self.work_rc[r][j - 1]) == self.work_rc[r][j - 1]):
                    continue
                own += held
                v = self.work[r][:j] + P[1:j + 1] - P[j] + held      # layer i's moment, i < j - 1
                v[-1] = own
                # the last layer's moment is of its own kind there: where the output's gradient
                # is the receive buffer, its forward's moment (activations: the tensors it makes
                # and still reads, as a tracker labels them) can be the worst one, not the
                # backward's (activation gradients, buffers)
                kind, wg = self.work_rc[r][:j].copy(), self.work_grads[r][:j].copy()
                kind[-1] = last.bwd_over_given_rc.get(r, kind[-1])
                wg[-1] = last.bwd_over_given_grads.get(r, wg[-1])
                wt = self.work_tmp_grads[r][:j].copy()
                if r in last.bwd_over_given:
                    wt[-1] = last.bwd_over_given_grads.get(r, np.nan)
                for rc_kind, W in ((True, self.range_work_rc[r]), (False, self.range_work_tmp[r])):
                    mask = np.where(kind == rc_kind, v, -INF)
                    suffix = np.maximum.accumulate(mask[::-1])[::-1]       # max over i >= k
                    W[k, j] = suffix[k]
                    at = _suffix_argmax(mask)
                    if rc_kind:
                        self.range_work_rc_grads[r][k, j] = wg[at]
                    else:
                        self.range_work_tmp_grads[r][k, j] = np.where(at >= 0, wt[np.maximum(at, 0)], np.nan)
                self.range_work[r][k, j] = np.maximum(np.maximum(self.range_work_rc[r][k, j],
                                                                 self.range_work_tmp[r][k, j]), 0.0)
                self.range_act[r][k, j] -= held
                self.range_out_kept[r][k, j] += held

    def first_backward(self, r: str, later: bool, accumulated: Optional[str] = None) -> tuple[np.ndarray, ...]:
        """A range's first backward of the step (no parameter gradient before it), moment by
        moment as `range_work` takes them, with the parameter gradients made so far alive: each
        layer's worst moment of its own (`LayerCost.bwd_first`, one per position among its
        modules) and, with `later`, the whole gradients of the range's layers after it (their
        backward ran; without: a ZeRO-3 unit's are reduce-scattered as it ends). Under ZeRO-3
        a moment holds the root's parameters, its op's module's unit (none for an op outside
        the layer's modules: a loss) and the unit FSDP2 prefetches for the backward next (the
        nearest module before it with parameters; for the layer's first, the range's layer
        before's last unit: `_moment_units`), which decides which moment is the worst. Returns
        (W, at, parts): W[k, j] the worst moment above the range's saved activations and the
        forward/backward phase's model states and buffers without gradients, at[k, j] its
        layer, parts[k, j] = (activations above or below the saved ones, activation gradients
        and prefetched weights, parameter gradients, weights above or below the phase's)
        summing to W, in bytes at the training dtype. Cached per (r, later, ZeRO-3 or not).

        `accumulated` (ZeRO-3 accumulating over several micro-batches): the same moments in a
        later micro-batch's backward, every parameter gradient alive already (the phase's, the
        caller's): the ops' own new weight gradients are temporaries added into them (in each
        moment's activation gradients), none made beside them. "mid": a micro-batch before the
        last; "last": the last one, where FSDP2 reduce-scatters each unit as its backward ends
        (its accumulated gradient replaced by its fp32 shard: the parameter gradients part,
        negative) and keeps the flat reduce-scatter input of the unit before until the next
        one's (`foreach_reduce`'s state, torch 2.13: the unit whose backward ran just before
        the moment's op, counted with its activation gradients). "each" (`rs_each`: every
        micro-batch reduce-scattered): a later micro-batch's moments, the ops' new weight
        gradients made beside the fp32 shards (the caller's), each unit's gone as it is
        reduce-scattered and added into its shard, the unit before's flat reduce-scatter input
        kept as in "last". "kept": "mid" without the moment's units (its own, the prefetched
        one): a pipeline stage's later backward, every unit gathered already (the caller's)."""
        if accumulated is not None:
            later = False
        # `_first` is shared by the tables of every ZeRO stage and dp: where the result depends on
        # dp (ZeRO-3's fp32 gradient shards, 4 / dp bytes an element) the key holds it
        shards = self.zero3 and not later
        key = (r, later, self.zero3, self.dp if shards else None) if accumulated is None \
            else (r, self.zero3, accumulated, self.dp)
        key = key + (float(self.expert_units.sum()), self.ep, self.ecopies)
        hit = self._first.get(key)
        if hit is not None:
            return hit
        out = self._first_backward(r, later, accumulated)
        if self.zero3 and self._unit_shared:
            # a pipeline chunk's ranges with its own units (`module_units`' second variant)
            self._units_variant = 1
            try:
                alt = self._first_backward(r, later, accumulated)
            finally:
                self._units_variant = 0
            pp = self.pipelined
            out = (np.where(pp, alt[0], out[0]), np.where(pp, alt[1], out[1]),
                   np.where(pp[..., None], alt[2], out[2]))
        self._first[key] = out
        return out

    def _first_backward(self, r: str, later: bool, accumulated: Optional[str]) -> tuple[np.ndarray, ...]:
        """`first_backward` with the unit tables `_units_variant` reads, not cached."""
        shards = self.zero3 and not later
        L, costs = self.L, self.costs
        P = self.live[r]
        work = self.work[r]
        # each layer's worst moment by parts [activations, activation gradients, parameter
        # gradients, its unit's weights, the prefetched unit's], where the layer before is in
        # the range (`inside`) and where the layer starts it (`alone`: nothing before to prefetch);
        # `inside_e`, `alone_e` where the layer ends the range: the next layer's units lie on
        # another stage, so no flat reduce-scatter input of theirs is kept (`_reduced_before`)
        inside, alone = np.zeros((L, 6)), np.zeros((L, 6))
        inside_e, alone_e = np.zeros((L, 6)), np.zeros((L, 6))
        w0 = self.wgo[0] if self.zero3 else 0.0
        # a later micro-batch's moments, gradients accumulated: the worst by what they make
        # (`LayerCost.bwd_acc`), not the first backward's
        acc = accumulated in ("mid", "last", "kept")
        for i, c in enumerate(costs):
            ms = (c.bwd_acc.get(r) if acc else None) or c.bwd_first.get(r)
            if ms:
                at = ((c.bwd_acc_at.get(r) if acc and c.bwd_acc.get(r) else None) or c.bwd_first_at.get(r)
                      or [MAIN_UNIT] * len(ms))
                born = ((c.bwd_acc_born.get(r) if acc and c.bwd_acc.get(r) else None) or c.bwd_first_born.get(r)
                        or [{}] * len(ms))
                eg = ((c.bwd_acc_egrads.get(r) if acc and c.bwd_acc.get(r) else c.bwd_first_egrads.get(r))
                      or [0.0] * len(ms))
                if not acc and not later and self.expert_units[i] > 0 and c.bwd_acc.get(r):
                    # the experts' gradients reduce-scattered as their own unit ends: a moment
                    # with fewer made (a later micro-batch's worst, `bwd_acc`) can be the worst
                    ms = list(ms) + list(c.bwd_acc[r])
                    at = list(at) + list(c.bwd_acc_at.get(r) or [MAIN_UNIT] * len(c.bwd_acc[r]))
                    born = list(born) + list(c.bwd_acc_born.get(r) or [{}] * len(c.bwd_acc[r]))
                    eg = list(eg) + list(c.bwd_acc_egrads.get(r) or [0.0] * len(c.bwd_acc[r]))
                # the experts' gradients made, where they are an FSDP unit of their own
                eu = eg if self.expert_units[i] > 0 else [0.0] * len(ms)
                made = [m[2] for m in ms]
                # the forward's moment (`MAIN_UNIT`) where its position is known (`fwd_over_at`):
                # it holds the unit of its op's module and the flat all-gather output of the last
                # unit gathered (`_forward_units`); nothing prefetched for a backward, no
                # reduce-scatter input (no backward has run in the micro-batch)
                fp = c.fwd_over_at.get(r)
                fwd = [fp if x == MAIN_UNIT else None for x in at]
                rb = [0.0 if f is not None else self._reduced_before(i, x) for x, f in zip(at, fwd)]
                # of those, the next layer's (none where the layer ends the range)
                nxt = [0.0 if f is not None else x - self._reduced_before(i, y, within=True)
                       for x, y, f in zip(rb, at, fwd)]
                if accumulated in ("mid", "kept") or not (accumulated in ("last", "each")
                                                          or (self.zero3 and not later)):
                    nxt = [0.0] * len(ms)
                if accumulated in ("mid", "kept"):
                    ms = [[m[0], m[1], 0.0] for m in ms]
                elif accumulated == "last":
                    # the dense units' accumulated gradients and reduce-scatter inputs at `dense_grad_bytes`
                    # (fp32 under FSDP2's reduce_dtype: each unit reduced frees 4 bytes an element)
                    gu = self.dense_grad_bytes
                    shrink = (gu - 4.0 / self.dp) / self.wgo[1]
                    ms = [[m[0], m[1] + gu * x, -shrink * self._units_grads(i, b)]
                          for m, b, x in zip(ms, born, rb)]
                elif accumulated == "each":
                    # each unit's new gradients reduce-scattered as its backward ends and added
                    # into the fp32 shards (the phase's): gone but the flat reduce-scatter input
                    # of the unit before, which FSDP keeps until the next one's
                    ms = [[m[0], m[1] + self.wgo[1] * x, m[2] - self._units_grads(i, b) - e]
                          for m, b, x, e in zip(ms, born, rb, eu)]
                elif self.zero3 and not later:
                    # the gradients of the layer's other modules that are units were
                    # reduce-scattered as their backward ended: fp32 shards (4 / dp bytes per
                    # element) in place of the whole 2- or 4-byte ones; the root's stay whole;
                    # the flat reduce-scatter input of the unit before kept until the next one's,
                    # as in a later micro-batch ("last"; gpt-tiny dp2 x tp2 ZeRO-3 with full
                    # recomputation and one micro-batch: block 1's, 25 KiB at block 0's backward)
                    shrink = 1.0 - 4.0 / (self.wgo[1] * self.dp)
                    eshrink = 1.0 - 4.0 / (self.wgo[1] * max(self.ecopies, 1))
                    ms = [[m[0], m[1] + self.wgo[1] * x,
                           m[2] - shrink * self._units_grads(i, b) - eshrink * e]
                          for m, b, x, e in zip(ms, born, rb, eu)]
            else:
                # a layer costed without the first backward's parts: its worst moment of any
                g = self.work_grads[r][i]
                ms, at = [[work[i] - g, g, 0.0] if self.work_rc[r][i] else [0.0, work[i], 0.0]], [MAIN_UNIT]
                made, fwd, nxt = [0.0], [None], [0.0]
            # the layer before's last unit, prefetched: less the experts modules in it that are
            # FSDP units of their own (`expert_units`), which its pre-backward prefetches later
            before = max(self.last_unit[i - 1] - self.expert_units[i - 1], 0.0) if i > 0 else 0.0
            for out, prev, end in ((inside, before, False), (alone, 0.0, False), (inside_e, before, True),
                                   (alone_e, 0.0, True)):
                best = -INF
                for m, x, mk, f, nx in zip(ms, at, made, fwd, nxt):
                    own, pre = self._moment_units(i, x) if f is None else self._forward_units(i, f)
                    if accumulated == "kept":
                        own, pre = 0.0, 0.0
                    row = [m[0], m[1] - (self.wgo[1] * nx if end else 0.0), m[2], w0 * own,
                           w0 * (prev if pre is None else pre)]
                    if sum(row) > best:
                        best, out[i] = sum(row), row + [mk]
        # the sixth column: the parameter gradients the moment's layer made so far, whatever
        # became of them (the tied parameter's pending gradient below)
        inside, alone, made_in, made_alone = inside[:, :5], alone[:, :5], inside[:, 5], alone[:, 5]
        inside_e, alone_e, made_in_e, made_alone_e = inside_e[:, :5], alone_e[:, :5], inside_e[:, 5], alone_e[:, 5]
        f_in, f_out = inside.sum(axis=1), alone.sum(axis=1)
        f_in_e, f_out_e = inside_e.sum(axis=1), alone_e.sum(axis=1)
        g = self.wgo[1] if later else 0.0
        GP = np.concatenate([[0.0], np.cumsum(self.pel_layer * g)])
        if accumulated == "last":
            # the later layers' units were reduce-scattered (their root parameters' stay whole)
            GP = -(self.dense_grad_bytes - 4.0 / self.dp) * np.concatenate(
                [[0.0], np.cumsum([sum(us) for us in self.module_units])])
        elif shards and accumulated is None:
            # each unit reduce-scattered as its backward ends: the later layers' fp32 gradient
            # shards (4 / dp bytes an element) alive, counted here so that the worst moment is
            # taken with them (gpt-tiny dp2 x tp2 ZeRO-3, full recomputation, one micro-batch:
            # block 0's backward with block 1's shard and reduce-scatter input, not block 1's)
            # (the root's parameters' gradients whole until the root's reduce-scatter at the
            # backward's end; a tied one's waiting in autograd's buffer, below)
            # An experts module's: fp32 shards over the ranks holding the same experts (its own
            # unit), or whole where each has one copy (FSDP leaves them alone)
            epl = np.diff(self.expert_pel)
            eb = 4.0 / self.ecopies if self.ecopies > 1 else self.wgo[1]
            per = [4.0 / self.dp * max(sum(us) - e, 0.0) + eb * e + self.wgo[1] * x
                   for us, x, e in zip(self.module_units, self.root_own, epl)]
            GP = np.concatenate([[0.0], np.cumsum(per)])
        v_in, v_out = f_in + P[1:] - GP[1:], f_out + P[1:] - GP[1:]
        v_in_e, v_out_e = f_in_e + P[1:] - GP[1:], f_out_e + P[1:] - GP[1:]
        kk, jj = np.broadcast_arrays(self.kk, self.jj)
        end = kk == jj - 1
        lj = np.clip(jj - 1, 0, L - 1)

        def ranged(vi, vo, vi_e, vo_e):
            # W[k, j]: layer k's moment alone, a later one's with its layer before in the range,
            # the range's last layer's (k < j - 1) with no later layer in it
            rm, ra = np.full((L, L + 1), -INF), np.full((L, L + 1), -1)
            rm[:-1], ra[:-1] = _range_max(vi)[1:], _range_argmax(vi)[1:]
            cols = np.clip(jj - 1, 0, L)
            mid = np.where(jj - 1 > kk, np.take_along_axis(rm, cols, axis=1), -INF)
            mid_at = np.take_along_axis(ra, cols, axis=1)
            last_v = np.where(jj - 1 > kk, vi_e[lj], -INF)
            first = np.where(jj > kk, np.where(end, vo_e[kk], vo[kk]), -INF)
            best = np.maximum(np.maximum(first, mid), last_v)
            # ties as `_range_argmax` breaks them: the range's first layer, else the last of equal ones
            where = np.where((first >= best) & (jj > kk), kk, np.where(last_v >= best, jj - 1, mid_at))
            return best, np.where(jj > kk, where, -1)

        best, at = ranged(v_in, v_out, v_in_e, v_out_e)
        W = best - P[None, :] + GP[None, :]
        if not later and self.shared:
            # the worst moment taken with the tied parameters' waiting gradients (added below)
            # where a range holds every reader of one: a layer's moment before its last reader's
            # can be the worst with it (gpt-tiny ZeRO-3, one micro-batch: block 0's backward)
            wi, wo, every = np.zeros(L), np.zeros(L), np.zeros((L, L + 1), dtype=bool)
            for _f, e, us in self.shared:
                u0, ul = min(us), max(us)
                wi[u0:ul] += e * self.wgo[1]
                wo[u0:ul] += e * self.wgo[1]
                if accumulated in ("mid", "last", "kept"):
                    wi[ul] += min(e * self.wgo[1], max(float(made_in[ul]), 0.0))
                    wo[ul] += min(e * self.wgo[1], max(float(made_alone[ul]), 0.0))
                every |= (self.kk <= u0) & (ul < self.jj)
            bestw, atw = ranged(v_in + wi, v_out + wo, v_in_e + wi, v_out_e + wo)
            iw = np.maximum(atw, 0)
            less = np.where(iw == self.kk, wo[iw], wi[iw])
            Ww = bestw - less - P[None, :] + GP[None, :]
            W, at = np.where(every, Ww, W), np.where(every, atw, at)
        # a chunk's output held by the stage's forward cache (`_outputs_held`); its output's
        # gradient is the receive buffer (`recv_buffers`), so the last layer's moment leaves it
        # out of the activation gradients its backward holds (`given`, where that moment is
        # the worst: an activation gradient, not a saved activation)
        given = np.zeros((L, L + 1))
        for j in range(1, L):
            last, held = costs[j - 1], float(costs[j - 1].out_saved.get(r, 0.0))
            # the backward's moment without the given gradient (`bwd_given_backward`; the
            # layer's `bwd_over_given` can be its forward's, not a moment of this backward)
            own = last.bwd_given_backward.get(r, last.bwd_over_given.get(r, work[j - 1]))
            if held <= 0 and own == work[j - 1]:
                continue
            rows = []
            for f, fe in ((f_in, f_in_e), (f_out, f_out_e)):
                vv = f[:j] + P[1:j + 1] - P[j] + held + (GP[j] - GP[1:j + 1])
                vv[-1] = own + (fe[j - 1] - work[j - 1]) + held
                rows.append(vv)
            vi, vo = rows
            later_max = np.concatenate([np.maximum.accumulate(vi[::-1])[::-1][1:], [-INF]])
            later_at = np.concatenate([_suffix_argmax(vi)[1:], [-1]])
            W[:j, j] = np.maximum(vo, later_max)
            at[:j, j] = np.where(vo >= later_max, np.arange(j), later_at)
            given[:j, j] = np.where(at[:j, j] == j - 1, max(work[j - 1] - own, 0.0), 0.0)
        ok = at >= 0
        i = np.maximum(at, 0)
        last = (i == jj - 1)[..., None]
        parts = np.where((i == self.kk)[..., None], np.where(last, alone_e[i], alone[i]),
                         np.where(last, inside_e[i], inside[i]))
        made = np.where(ok, np.where(i == self.kk, np.where(last[..., 0], made_alone_e[i], made_alone[i]),
                                     np.where(last[..., 0], made_in_e[i], made_in[i])), 0.0)
        later_g = np.where(ok, GP[np.clip(self.jj, 0, L)] - GP[i + 1], 0.0)
        ag = np.where(ok, parts[..., 1], 0.0)
        ag = ag - np.minimum(given, np.maximum(ag, 0.0))
        pg = np.where(ok, parts[..., 2], 0.0) + later_g
        # the phase charges the largest unit gathered and another prefetched (`phases`): the
        # moment's own unit and the prefetched one replace them (a buffer, with the gradients)
        unit = w0 * self.range_unit if self.zero3 else 0.0
        wd = np.where(ok, parts[..., 3] - unit, 0.0)
        bd = np.where(ok, parts[..., 4] - unit, 0.0)
        W = np.where(ok, W, 0.0) - np.where(ok, parts[..., 3] + parts[..., 4], 0.0) + wd + bd
        ag = ag + bd
        # a parameter several layers of the range read (a tied embedding) has one gradient,
        # summed in autograd's input buffer as each reader's backward runs and made `.grad`
        # after its first reader's: a buffer until then, counted once
        eb_dt = self.wgo[1]
        for _f, e, us in self.shared:
            inr = [(self.kk <= u) & (u < self.jj) for u in us]
            n_in = sum(x.astype(int) for x in inr)
            u0 = np.min(np.stack([np.where(x, u, L) for x, u in zip(inr, us)]), axis=0)
            ul = np.max(np.stack([np.where(x, u, -1) for x, u in zip(inr, us)]), axis=0)
            done = sum((x & (u > i)).astype(int) for x, u in zip(inr, us)) if later else np.zeros_like(n_in)
            mine = (n_in >= 2) & np.isin(i, us) & (i != u0)
            extra = np.where(done > 1, (done - 1) * e * g, 0.0) + np.where(mine & (done > 0), e * eb_dt, 0.0)
            pending = (n_in >= 2) & (u0 <= i) & ((done > 0) | mine)
            move = np.where(pending, np.minimum(e * eb_dt, np.maximum(pg - extra, 0.0)), 0.0)
            W, pg = W - extra, pg - extra - move
            ag = ag + move
            if not later:
                # the later readers' gradient (their backward ran: the head's of a tied
                # embedding) waits in autograd's input buffer until the first reader's backward
                # adds its own: new bytes at every moment of the layers from the first reader's
                # up to the last's (there, once its backward made it: the layer's gradients made
                # so far, at most the parameter's), which the parameter gradients here do not
                # hold (the later layers' are not counted without `later`; a later micro-batch's
                # are its `.grad`, the phase's). gpt-tiny dp2 x tp2 ZeRO-3 with full
                # recomputation: 8 KiB (the head's [128, 16] fp32 gradient) left out
                waits = np.where((n_in >= 2) & (u0 <= i) & (i < ul) & ~mine, e * eb_dt, 0.0)
                if accumulated in ("mid", "last", "kept"):
                    waits = waits + np.where(mine, np.minimum(e * eb_dt, np.maximum(made, 0.0)), 0.0)
                W, ag = W + waits, ag + waits
        return W, at, np.stack([W - ag - pg - wd, ag, pg, wd], axis=-1)

    def recompute_terms(self, r: str, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per layer range under recomputation `r`, what `Search._best_recompute` adds to the stage's
        fixed memory, whatever the schedule: (one micro-batch's activations as the stage holds
        them, the backward's worst transient above them, the first backward's worst moment).
        `_best_recompute` takes the first backward's moment in place of the fixed memory's
        gradients (`fixed_memory`'s second term), so `first` carries every parameter gradient
        alive then, each tensor once, as `Search._stage` counts that moment:

        - without ZeRO-3's shards (ZeRO 0-2, or ZeRO-3 with several micro-batches, whose
          gradients accumulate unsharded): `first_backward(r, later=True)`, the moment's own
          layer's gradients made so far and the whole gradients of the range's later layers
          (their backward ran), nothing of the layers before it (not made yet);
        - ZeRO-3 with one micro-batch: `first_backward(r, later=False)` holds the moment's own
          layer's gradients, those of its finished units already as fp32 shards (4 / dp bytes
          per element), and nothing of the later layers; their units were reduce-scattered as
          each ended, so their fp32 shards are added here: the phase's gradient shards
          (`fixed_memory`) in proportion to the later layers' elements (`pel[j] - pel[i + 1]`
          of the range's, i the moment's layer), as `_stage` adds them. Before 78730f6
          (issue 18) this path added every gradient shard of the range as a bound: the moment's
          layer's finished units' shards twice (once in `first_backward`), and the shards of
          the moment's layer's unfinished units and of the layers before it, which do not
          exist yet, so the budget rejected recomputations the stage's own peak fits.

        Under ZeRO-3 the forward's end comes before it (two units gathered, the range's last
        layer's activations not yet saved). The transient after the first backward: the
        range's bound less its relief, or, ZeRO-3 with several micro-batches, the later
        micro-batches' moments with each op's units (`first_backward`'s `accumulated`), as
        `_stage` takes them. Reducing every micro-batch (`rs_each`): as with one micro-batch, but
        in a later one every gradient shard is alive. Cached per (r, shards, m > 2, m > 1)."""
        shards = self.zero3 and (m == 1 or self.rs_each)
        key = (r, shards, m > 2, m > 1)
        hit = self._rc_terms.get(key)
        if hit is None:
            act = self.boundary_acts(self.range_act[r], self.range_in_saved[r], self.range_out_kept[r])
            if self.zero3 and m > 1 and not self.rs_each:
                kinds = ("mid", "last") if m > 2 else ("last",)
                work = np.max([self.first_backward(r, False, accumulated=a)[0] for a in kinds], axis=0)
            else:
                work = self.range_work[r]
                if self.shared:
                    work = np.maximum(work, self.tied_work(r)[0])     # a tied gradient waiting
                work = work - self.relief(r)
            first, at, _ = self.first_backward(r, not shards)
            # (`first_backward` holds the later layers' gradient shards, made in this backward;
            # reduced every micro-batch, a later one's moments, every shard alive, are the
            # phase's with the backward's transient, `work`)
            if self.zero3:
                first = np.maximum(first, -self.range_last_act(r))
            hit = self._rc_terms[key] = (act, work, first)
        return hit

    def tied_work(self, r: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A later micro-batch's backward (every parameter gradient alive: `.grad` of the
        earlier ones) where a parameter several layers of the range read (a tied embedding)
        has its later readers' gradient waiting in autograd's input buffer for the first
        reader's: beside the accumulated `.grad`, new bytes at every moment from the last
        reader's backward (in its layer, once its ops made the gradient: the layer's gradients
        made so far, at most the parameter's, `LayerCost.bwd_acc`) to the first reader's. Per
        range, the worst such moment above the range's saved activations as `range_work` takes
        them, and its parts (re-made or freed activations, gradients with the waiting one);
        -inf where the range holds no two readers. gpt-tiny dp2 x tp2 ZeRO-0 with full
        recomputation and 2 micro-batches: the head's [128, 16] fp32 gradient, 8 KiB of the
        second backward's peak, was left out. Cached per policy."""
        hit = self._tied_work.get(r)
        if hit is not None:
            return hit
        L = self.L
        tot, acts, grads = (np.full((L, L + 1), -INF) for _ in range(3))
        P = self.live[r]
        for _f, e, us in self.shared:
            wait = e * self.wgo[1]
            # per layer: its worst moment with the gradient waiting through it (`full`) and as
            # the last reader (`last`: once made), each (total above P[i + 1], acts, grads)
            full, last = [], []
            for i, c in enumerate(self.costs):
                ms = c.bwd_acc.get(r) or [[self.work[r][i] - self.work_grads[r][i], self.work_grads[r][i], 0.0]
                                         if self.work_rc[r][i] else [0.0, self.work[r][i], 0.0]]
                full.append(max((m[0] + m[1] + wait, m[0], m[1] + wait) for m in ms))
                last.append(max((m[0] + m[1] + min(wait, max(m[2], 0.0)), m[0], m[1] + min(wait, max(m[2], 0.0)))
                                for m in ms))
            users = sorted(set(us))
            for a, u0 in enumerate(users):
                for ul in users[a + 1:]:
                    best = max([(full[i][0] + P[i + 1],) + full[i][1:] for i in range(u0, ul)]
                               + [(last[ul][0] + P[ul + 1],) + last[ul][1:]])
                    # the ranges whose first reader is u0 and last is ul
                    k0 = users[a - 1] + 1 if a > 0 else 0
                    b = users.index(ul)
                    j1 = users[b + 1] if b + 1 < len(users) else L
                    for k in range(k0, u0 + 1):
                        for j in range(ul + 1, j1 + 1):
                            v = best[0] - P[j]
                            if v > tot[k, j]:
                                tot[k, j], acts[k, j], grads[k, j] = v, best[1], best[2]
        out = (tot, acts, grads)
        self._tied_work[r] = out
        return out

    def ranged(self, arr: np.ndarray) -> np.ndarray:
        """`arr[j] - arr[k]` for every layer range [k, j) of a per-layer prefix sum `arr` (one of
        this table's own arrays, left unchanged): kept per array, since every candidate on
        this table asks for the same ones (read-only)."""
        hit = self._ranged.get(id(arr))
        if hit is None or hit[0] is not arr:
            out = arr[np.clip(self.jj, 0, self.L)] - arr[self.kk]
            out.setflags(write=False)
            hit = self._ranged[id(arr)] = (arr, out)
        return hit[1]

    def zero_mb(self, pel: Any, epel: Any = 0.0, units: Any = 0.0, eunits: Any = 0.0, gathers: float = 2.0) -> Any:
        """ZeRO-3 collectives per micro-batch of `pel` parameter elements per device (of which
        `epel` expert weights), as the runtime issues them (`runtime.zero.ZeroSharding.
        _fully_shard`): each of the `units` dense FSDP units all-gathered over dp for the forward
        and again for the backward (FSDP reshards after the forward), the dense elements'
        bytes; under expert parallelism each of the `eunits` experts modules an FSDP unit of its
        own over the ranks holding the same experts (`runtime.experts.ExpertGroups.fully_shard`:
        `ecopies` ranks, `estride` apart), its elements' bytes, none where each expert has one
        copy (FSDP leaves them alone). With `rs_each` every unit's gradients are also
        reduce-scattered over the same group in every micro-batch's backward (the step's sync
        has none left, `sync`). Each collective is the cluster's affine model (`_dp_coll`): its
        intercept once per unit, its slope times the bytes. `gathers`: all-gathers of a unit per
        micro-batch, 2 in one stage; in a pipeline (torch.pipelining drives the stage's FSDP root,
        resharding after the last backward only) a unit is gathered m + 1 times a step
        (`_zero3_gathers`, `planner._zero3_counts`)."""
        w, g, _ = self.wgo
        if self.dp == 1 or self.zero < 3:
            return np.zeros_like(np.asarray(pel, dtype=float))
        pel, epel = np.asarray(pel, dtype=float), np.asarray(epel, dtype=float)
        out = np.zeros_like(pel)
        groups = [(pel - epel, units, self.dp, self.tp, self.dense_grad_bytes)]
        if self.ep > 1:
            groups.append((epel, eunits, self.ecopies, self.estride, g))
        for elems, n, size, stride, gb in groups:
            kinds = (("all_gather", w, gathers),) + ((("reduce_scatter", gb, 1.0),) if self.rs_each else ())
            for kind, b, times in kinds:
                a, slope = _dp_affine(self.cluster, kind, size, stride)
                # a stage's parameters outside every unit are its root unit's: one at least
                out = out + times * np.where(elems > 0, a * np.maximum(n, 1.0) + slope * elems * b, 0.0)
        return out

    def grads_m(self, m: int, pp: int) -> int:
        """The micro-batch count whose gradient rule a stage's memory takes (`phases`,
        `first_backward`'s shards, `recompute_terms`): m, but 2 for a ZeRO-3 pipeline stage of
        one micro-batch, whose gradients accumulate unsharded as with several, since
        torch.pipelining runs every backward without FSDP's gradient sync
        (`_PipelineStageBase.backward_maybe_with_nosync`: `set_requires_gradient_sync(False)`,
        torch 2.13) and reduce-scatters them all after the last (`perform_reduce_grad`), not
        each unit's as its backward ends (wide nanoGPT pp2 x dp2 ZeRO-3, 1F1B, one micro-batch,
        stage 0: -9.1% with each unit's reduce-scattered at its backward's end)."""
        return max(int(m), 2) if self.zero3 and pp > 1 and not self.rs_each else int(m)

    def phases(self, pel: Any, m: int, root: Any = 0.0, unit: Any = 0.0, largest: Any = 0.0,
               epel: Any = 0.0, spel: float = 0.0) -> list:
        """What the runtime holds per phase of a step for `pel` parameter elements per device
        (`cost_models.memory.runtime_phases`); under ZeRO-3 `root` and `unit` are the root
        unit's elements and the largest layer unit's (`range_root`, `range_unit`): the root's
        and one unit's unsharded parameters and one unit's flat all-gather output at once;
        `largest`: AdamW's temporaries at their worst, elements (`range_maxtensor`); `spel`:
        of `pel`, 0-D parameters, which ZeRO-3 holds whole (`Search._scalar_sync`)."""
        kw = dict(num_microbatches=m, gathered_params=root + unit if self.zero3 else 0.0,
                  prefetch_params=unit if self.zero3 else 0.0, optimizer_temps=largest,
                  reduce_every_microbatch=self.rs_each,
                  rs_copies_input=reduce_scatter_copies_input(self.cluster.device.device_type),
                  fused_optimizer=fused_optimizer(self.cluster.device.device_type),
                  zero_optimizer=self.zero_optimizer)
        out = runtime_phases(pel, self.policy, self.zero, self.dp, **kw)
        if self.ep > 1 and self.zero == 0 and self.dp > 1:
            # the gradient sync's flat buffer: the dense gradients' (all-reduced over dp), then,
            # apart, the experts' over the ranks holding the same ones (none where ep = dp:
            # one copy), each released before the next (`runtime.experts.ExpertGroups.sync`)
            e = np.asarray(epel)
            flat = np.maximum(pel - e, e if self.ecopies > 1 else 0.0) * self.wgo[1]
            out = [dataclasses.replace(ph, buffers=flat + 0.0 * ph.buffers) if ph.phase == "grad_sync" else ph
                   for ph in out]
        if self.ep > 1 and self.zero >= 1 and self.dp > 1:
            # ZeRO shards an expert's optimizer state (ZeRO-3: and its weights and gradients)
            # over the dp / ep ranks holding it, not over dp: as if its elements were ep times
            # as many (the rest of the phase unchanged). Not ZeRO-3's unsharded gradients,
            # accumulated over several micro-batches until the last one reduce-scatters: those
            # are the rank's own experts' (`pel` as it is)
            wide = runtime_phases(pel + (self.dp / self.ecopies - 1) * np.asarray(epel), self.policy, self.zero,
                                  self.dp, **kw)
            unsharded = m > 1 and not self.rs_each
            out = [dataclasses.replace(a, optimizer=b.optimizer) if self.zero < 3 else
                   dataclasses.replace(a, optimizer=b.optimizer, weights=b.weights,
                                       gradients=a.gradients if unsharded and a.phase == "forward_backward"
                                       else b.gradients)
                   for a, b in zip(out, wide)]
        if self.zero3 and self.ep > 1 and self.dp > 1 and self.ecopies == 1 and mixed_precision(self.policy):
            # one copy of each expert: FSDP leaves them alone (`ExpertGroups.fully_shard`), so
            # the rank holds its experts' 2-byte weights whole through the step beside their fp32
            # masters (the optimizer's), where `wide` counted FSDP's gathered units alone (HF
            # Mixtral dp8 x ep8 ZeRO-3 at full scale: 5.5 GiB a rank left out, -8.4% verified)
            e = np.asarray(epel) * self.wgo[0]
            out = [dataclasses.replace(ph, weights=ph.weights + e) for ph in out]
        if self.ep > 1 and self.zero in (1, 2) and self.dp > 1:
            out = self._expert_zero12_sync(out, pel, np.asarray(epel), kw)
        if self.zero3 and spel:
            # ZeRO-3's 0-D parameters, replicated over dp (FSDP cannot shard them): their
            # weights, gradients and optimizer state whole on every rank, as if dp times as many
            # elements were sharded (not the unsharded gradients accumulated over micro-batches,
            # whole already)
            base = runtime_phases(pel, self.policy, self.zero, self.dp, **kw)
            wide = runtime_phases(pel + (self.dp - 1) * spel, self.policy, self.zero, self.dp, **kw)
            unsharded = m > 1 and not self.rs_each
            out = [dataclasses.replace(
                ph, weights=ph.weights + b.weights - a.weights, optimizer=ph.optimizer + b.optimizer - a.optimizer,
                gradients=ph.gradients if unsharded and ph.phase == "forward_backward"
                else ph.gradients + b.gradients - a.gradients)
                for ph, a, b in zip(out, base, wide)]
        if self.reduce_fp32 and m > 1 and not self.rs_each:
            # FSDP2's reduce_dtype float32: the dense units' unsharded gradients, accumulated over
            # the micro-batches, are fp32 (torch's `FSDPParam.to_accumulated_grad_if_needed` upcasts
            # the first one to reduce_dtype, `accumulate_unsharded_grad_if_needed` adds the next
            # into it), the experts' outside the policy as they were
            more = (self.dense_grad_bytes - self.wgo[1]) * (np.asarray(pel, dtype=float) - np.asarray(epel))
            out = [dataclasses.replace(ph, gradients=ph.gradients + more) if ph.phase == "forward_backward" else ph
                   for ph in out]
        if self.comm_buffers:
            out = [dataclasses.replace(ph, buffers=ph.buffers + self.comm_buffers) for ph in out]
        return out

    @property
    def dense_grad_bytes(self) -> float:
        """Bytes a dense gradient element is accumulated and reduced in: the policy's, or 4 where
        FSDP2 reduces in fp32 (`reduce_fp32`)."""
        return 4.0 if self.reduce_fp32 else float(self.wgo[1])

    def _expert_zero12_sync(self, out: list, pel: Any, e: Any, kw: dict) -> list:
        """ZeRO-1/2's gradient sync under expert parallelism, as `runtime.zero._zero12_step`
        runs it: the dense gradients' flat buffer over dp first, while the experts' gradients
        stay alive, then the experts' own flat buffer over the ranks holding the same experts
        (`ExpertGroups.zero_reduce`: none where each expert has one copy, the flat itself
        the shard) while the dense fp32 gradient shard waits for the step, then the updated
        experts' all-gather (`zero_gather`) before the dense one. Each sync moment of
        `runtime_phases` for the dense elements alone, and for the experts' over their copies,
        with what the other part holds then; the other phases as they were."""
        w, g, _ = self.wgo
        d = pel - e
        copies = self.ecopies
        dense = [ph for ph in runtime_phases(d, self.policy, self.zero, self.dp, **kw) if ph.phase == "grad_sync"]
        moments = [dataclasses.replace(ph, weights=ph.weights + w * e,
                                       gradients=ph.gradients + g * e) for ph in dense[:2]]
        shard_d = 4.0 * d / self.dp            # the dense fp32 gradient shard, kept for the step
        if copies > 1:
            ex = [ph for ph in runtime_phases(e, self.policy, self.zero, copies, **kw) if ph.phase == "grad_sync"]
            moments += [dataclasses.replace(ph, weights=ph.weights + w * d, buffers=ph.buffers + shard_d)
                        for ph in ex[:2]]
            # the experts' gather after the step, before the dense one
            gather = [dataclasses.replace(ex[2], weights=ex[2].weights + w * d)]
        else:
            gather = []
            # one copy: the flat buffer (the gradients' dtype) beside the gradients, then its
            # average (`shard * (1 / dp)`, a temporary in the gradients' dtype) cast to fp32 as
            # the shard's gradient (one tensor with the temporary in an fp32 run)
            moments.append(dataclasses.replace(dense[0], weights=w * pel, gradients=g * e,
                                               buffers=g * e + shard_d))
            moments.append(dataclasses.replace(dense[0], weights=w * pel, gradients=0.0 * e,
                                               buffers=2 * g * e + (4.0 * e if g < 4 else 0.0) + shard_d))
        gather.append(dataclasses.replace(dense[2], weights=dense[2].weights + w * e))
        opt = next(ph.optimizer for ph in out if ph.phase == "grad_sync")
        fb = [ph for ph in out if ph.phase == "forward_backward"]
        # the step: both fp32 gradient shards, the dense one over dp and the experts' over their
        # copies, and AdamW's temporaries stepping the dense flat shard, then the experts'
        # (`adamw_temporary_elems`: the first's quotient alive through the second's)
        sd, se = d / self.dp, e / copies
        temps = 0.0 * sd if kw["fused_optimizer"] else \
            4.0 * np.maximum(ADAMW_TEMPORARIES * sd, ADAMW_TEMPORARIES * se + sd)
        step = [dataclasses.replace(ph, gradients=4.0 * (sd + se), buffers=temps)
                for ph in out if ph.phase == "optimizer_step"]
        # the gathers follow the update: the tracker's optimizer phase (`runtime.memory_tracking`)
        return fb + [dataclasses.replace(ph, optimizer=opt) for ph in moments] + step + \
            [dataclasses.replace(ph, optimizer=opt, phase="optimizer_step") for ph in gather]

    @functools.cached_property
    def range_unit(self) -> np.ndarray:
        """ZeRO-3 (FSDP2, `engine._fully_shard`): each layer module whose parameters no other
        module reads is a unit, gathered for its forward and again for its backward; parameters
        several layers read stay with the root unit, which FSDP keeps gathered from the forward
        to the backward (`range_root`). The largest unit of every range, elements. Held at once:
        in a unit's forward its flat all-gather output and its unsharded parameters (FSDP2
        frees the flat one at the next unit's copy-out, `wait_for_unshard`: 2 units); at the
        loss's backward the first unit of the backward, prefetched by the root's pre-backward
        hook (1 unit, its flat output); in a unit's backward its unsharded parameters and the
        next one prefetched (2 units). Built on first use: only ZeRO-3 tables read it."""
        whole, chunk = (np.where(self.valid, np.maximum(_range_max(u), 0.0), 0.0) for u in self._unit_layers)
        return np.where(self.pipelined, chunk, whole)

    @functools.cached_property
    def range_units_sum(self) -> np.ndarray:
        """Every range's ZeRO-3 units together (a pipeline chunk's `module_units`), elements:
        what a pipeline stage's later backward holds gathered (`Search._stage`)."""
        per = [sum(us) for us in self._module_units_variants[1]]
        return np.where(self.valid, self.ranged(np.concatenate([[0.0], np.cumsum(per)])), 0.0)

    def kept_after(self, i: int, j: int) -> float:
        """ZeRO-3 units of a pipeline chunk's layers i + 1 .. j - 1 (`module_units`' chunk
        variant), elements: what its backward still holds gathered at a moment of layer i, since
        torch.pipelining runs every backward with `set_reshard_after_backward(False)`
        (`_PipelineStageBase.backward_maybe_with_nosync`, torch 2.13), the first included."""
        return float(sum(sum(us) for us in self._module_units_variants[1][i + 1:j]))

    @property
    def unit_layer(self) -> np.ndarray:
        """Each layer's largest ZeRO-3 unit, elements (0: its parameters are the root's):
        the largest of its `module_units`."""
        return self._unit_layers[self._units_variant]

    @functools.cached_property
    def _unit_layers(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.array([max(us, default=0.0) for us in mu], dtype=float).reshape(self.L)
                     for mu in self._module_units_variants)

    @functools.cached_property
    def pipelined(self) -> np.ndarray:
        """Every range but the whole model's: a pipeline chunk's (`module_units`' second variant)."""
        return self.valid & ~((self.kk == 0) & (self.jj == self.L))

    @property
    def module_units(self) -> list[list[float]]:
        """Each layer's ZeRO-3 units by module (`Layer.modules`, in order), elements (0: a
        module with no parameters, or holding one several layers read: FSDP shards all of a
        unit's parameters, so that module's are the root's, as `planner.zero3_units` decides).
        In a pipeline chunk (`_units_variant` 1) a module holding a shared parameter under one
        name alone is a unit of its own (`_unit_shared`)."""
        return self._module_units_variants[self._units_variant]

    @functools.cached_property
    def _module_units_variants(self) -> tuple[list[list[float]], list[list[float]]]:
        """`module_units` of the whole model and of a pipeline chunk."""
        shared_names = {f for f, _, _ in self.shared}
        out: tuple[list, list] = ([], [])
        for i, c in enumerate(self.costs):
            mods = self._layers[i].modules if i < len(self._layers) else []
            units = [0.0] * len(mods)
            rooted = {k for k, m in enumerate(mods) if m in self.rooted}
            tied = {k for k, m in enumerate(mods) if m in self.rooted_tied}
            in_pp = set(tied)
            for f, e in c.param_elems.items():
                m = next((k for k, m in enumerate(mods) if f == m or f.startswith(m + ".")), None)
                if m is None:
                    continue
                if f in shared_names:
                    rooted.add(m)
                units[m] += e
            out[0].append([0.0 if k in rooted else u for k, u in enumerate(units)])
            out[1].append([0.0 if k in in_pp else u for k, u in enumerate(units)])
        return out

    @functools.cached_property
    def _unit_shared(self) -> list[tuple[str, float, int]]:
        """The shared parameters a pipeline chunk holding their module shards with it (a
        module rooted for an outside reader, not for a second name): (name, elements, the
        layer holding the module)."""
        out = []
        for f, e, us in self.shared:
            for i in us:
                mods = self._layers[i].modules if i < len(self._layers) else []
                m = next((m for m in mods if f == m or f.startswith(m + ".")), None)
                if m is not None and m in self.rooted and m not in self.rooted_tied:
                    out.append((f, e, i))
        return out

    @property
    def last_unit(self) -> np.ndarray:
        """Each layer's last ZeRO-3 unit in forward order, elements: the first its backward
        runs, which the next layer's first unit prefetches (0: none)."""
        return self._last_units[self._units_variant]

    @functools.cached_property
    def _last_units(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.array([next((u for u in reversed(us) if u > 0), 0.0) for us in mu])
                     for mu in self._module_units_variants)

    def _reduced_before(self, i: int, at: float, within: bool = False) -> float:
        """Elements of the ZeRO-3 unit whose backward ran just before a moment of layer `i` at
        position `at` (`LayerCost.bwd_first_at`): the nearest module after it with parameters,
        in the layer or, past its last, the next layer's first unit (0: none; the layer's
        largest, `MAIN_UNIT`: the one after its largest). `within`: in the layer only (the
        layer ends its stage's chunk: the next layer's units are another stage's)."""
        units = self.module_units[i]
        k = int(np.argmax(units)) if at == MAIN_UNIT and units else int(np.floor(at))
        later = [u for u in units[k + 1:] if u > 0]
        if later:
            return float(later[0])
        if i + 1 < self.L and not within:
            return float(next((u for u in self.module_units[i + 1] if u > 0), 0.0))
        return 0.0

    def _units_grads(self, i: int, born: dict) -> float:
        """Of `born` (`LayerCost.bwd_first_born`: parameter gradients by the position of the
        module that made them, layer `i`), those of modules ZeRO-3 makes units."""
        units = self.module_units[i]
        out = 0.0
        for p, b in born.items():
            x = float(p)
            if x == int(x) and 0 <= int(x) < len(units) and units[int(x)] > 0:
                out += b
        return out

    def _forward_units(self, i: int, at: float) -> tuple[float, Optional[float]]:
        """The ZeRO-3 units a forward moment of layer `i` at position `at` holds, elements: (its
        op's module's unit, gathered; the flat all-gather output of the last unit gathered
        before it: its own inside a unit, else the nearest one before it in the layer, None where
        that is the layer before's last). FSDP2 keeps a forward all-gather's output until the
        next unit's copy-out or the root's post-forward (`FSDPParamGroup.wait_for_unshard`:
        `comm_ctx.all_gather_state` in the forward, torch 2.13), so a unit's forward holds it
        beside the unit's parameters, and an op after the last unit (a loss) holds that unit's
        (gpt-tiny dp2 x tp2 ZeRO-3, pp2 1F1B: block 1's flat output, 25 KiB, through its forward;
        the loss's forward moment without pipelining)."""
        own = self._unit_at(i, at)
        if own > 0:
            return own, own
        units = self.module_units[i]
        before = [u for u in units[:max(0, min(math.ceil(at), len(units)))] if u > 0]
        return 0.0, (before[-1] if before else None)

    def _unit_at(self, i: int, at: float) -> float:
        """Elements of the ZeRO-3 unit of the module at position `at` among layer `i`'s
        (`cost_models.memory.unit_position`): 0 for an op outside them (half positions)."""
        units = self.module_units[i]
        k = int(np.floor(at))
        return float(units[k]) if at == k and 0 <= k < len(units) else 0.0

    def _moment_units(self, i: int, at: float) -> tuple[float, Optional[float]]:
        """The ZeRO-3 units a first-backward moment of layer `i` at position `at`
        (`LayerCost.bwd_first_at`) holds, elements: (its op's module's unit, the unit FSDP2
        prefetches for the backward next: the nearest module before it with parameters; None
        where that is the layer before's last unit). `MAIN_UNIT`: the layer's largest unit,
        the layer before's prefetched."""
        units = self.module_units[i]
        if at == MAIN_UNIT or not units:
            return float(self.unit_layer[i]), None
        k = int(np.floor(at))
        if i == self.L - 1 and k >= len(units) - 1 and at > k and not self.root_holds:
            # an op after the model's last unit (the loss the root module computes): its
            # backward runs before any unit's pre-backward hook, and the root's, which would
            # prefetch the first unit of the backward, has nothing to run where the root holds
            # no parameters (FSDP2 registers it with the root's parameter group; seen on
            # mlp-tiny and moe-tiny: nothing gathered at the loss's backward)
            return 0.0, 0.0
        own = units[k] if at == k and 0 <= k < len(units) else 0.0
        prev = [u for u in units[:max(0, min(math.ceil(at), len(units)))] if u > 0]
        return own, (prev[-1] if prev else None)

    @functools.cached_property
    def root_holds(self) -> bool:
        """Whether ZeRO-3's root unit holds parameters of its own: some module's are the
        root's (`rooted`, tied ones), or some parameters lie in no layer module's unit."""
        distinct = {f: e for c in self.costs for f, e in c.param_elems.items()}
        return bool(self.rooted) or sum(distinct.values()) > sum(sum(us) for us in self.module_units) + 0.5

    def range_last_act(self, r: str) -> np.ndarray:
        """Every range's last layer's saved activations (one micro-batch)."""
        P, L = self.act[r], self.L
        return np.where(self.valid, P[np.clip(self.jj, 0, L)] - P[np.clip(self.jj - 1, 0, L)], 0.0)

    def relief(self, r: str) -> np.ndarray:
        """For every range under recomputation `r`: how far the stage's worst moment around a
        micro-batch's backward lies below the bound the phases give (every unit held, the
        range's worst backward transient `range_work`, all its saved activations). Non-zero
        under ZeRO-3 only: the moments are a unit's forward (two units' worth held, the range's
        last layer not yet saved), the loss's backward (the root's parameters gathered, the
        first unit of the backward prefetched: one unit) and any other op's backward (two
        units). See `range_unit`."""
        if not self.zero3:
            return np.zeros((self.L, self.L + 1))
        if r in self._relief:
            return self._relief[r]
        L, kk, jj, costs = self.L, self.kk, self.jj, self.costs
        P, A = self.live[r], self.act[r]
        last, end = np.clip(jj - 1, 0, L - 1), np.clip(jj, 0, L)
        # the backward's transient at a range's loss (-inf where its last layer has none) apart
        # from every other moment: its other layers' and its last layer's other ops'
        loss = np.array([c.bwd_over_loss.get(r, -INF) for c in costs], dtype=float)
        body = np.array([c.bwd_over_body.get(r, c.bwd_over.get(r, 0.0)) for c in costs], dtype=float)
        inner = _range_max(self.work[r] + P[1:])[kk, np.clip(jj - 1, 0, L)] - P[end]
        work_body = np.maximum(inner, body[last])
        # a range's last layer's activations: not yet made while the last unit's forward holds
        # its parameters twice
        last_act = A[end] - A[np.clip(jj - 1, 0, L)]
        refined = np.maximum(np.maximum(work_body, loss[last] - self.wgo[0] * self.range_unit), -last_act)
        self._relief[r] = np.where(self.valid, np.maximum(self.range_work[r] - refined, 0.0), 0.0)
        return self._relief[r]

    def fixed_memory(self, pel: Any, m: int) -> tuple[Any, Any, Any]:
        """For every layer range: (model states and buffers held in the forward/backward phase,
        to which activations and the pipeline's receive buffers add (`recv_buffers`); the
        gradients among them, which exist only after the first backward; the largest total of
        the other phases, gradient sync and optimizer step, when no receive buffer is alive).
        All include the step's batch the stage holds."""
        ph = self.phases(pel, m, self.range_root, self.range_unit if self.zero3 else 0.0,
                         np.maximum(self.range_maxtensor, self.range_expert_temps), self.range_epel)
        rest = ph[1].total
        for x in ph[2:]:
            rest = np.maximum(rest, x.total)
        return ph[0].total + self.range_batch, ph[0].gradients, rest + self.range_batch

    @staticmethod
    def recv_buffers(moment: np.ndarray, in_bytes: Any, out_bytes: Any) -> Any:
        """The pipeline receive buffers alive at `moment` (one row of `held_moments`, shape
        (6, chunks); or a stack of rows, (n, 6, chunks): one value per row) for chunks
        receiving `in_bytes` and the gradient of `out_bytes` (arrays, one per chunk, or
        per-range arrays for one chunk). The runtime makes a buffer when the
        schedule posts the receive and drops it after the micro-batch's backward
        (`runtime.pipeline_p2p.JustInTimeStage`), so the count follows the schedule's order
        (`RECV_INPUTS`, `RECV_GRADS`), not torch's m per chunk kept for good."""
        if moment.ndim == 3:
            # a stack of moments (held_moments' rows), chunk arrays: one value per moment
            return moment[:, RECV_INPUTS, :] @ in_bytes + moment[:, RECV_GRADS, :] @ out_bytes
        if np.ndim(in_bytes) == 1 and moment.shape[1] == len(in_bytes):
            return float(moment[RECV_INPUTS] @ in_bytes + moment[RECV_GRADS] @ out_bytes)
        return moment[RECV_INPUTS, 0] * in_bytes + moment[RECV_GRADS, 0] * out_bytes

    @staticmethod
    def boundary_acts(act: Any, in_saved: Any, out_kept: Any) -> Any:
        """One micro-batch's activations of a pipeline chunk as the stage holds them: `act`
        (`range_act`) less what it saves of its input (`in_saved`: the receive buffer, counted
        by `recv_buffers`), plus `out_kept`: its output, which stays in the stage's
        forward cache until the backward (the next chunk's saved copy is on another stage),
        beyond what it saved of it, and a last stage's loss input."""
        return np.maximum(act - in_saved, 0.0) + out_kept

    def set_experts(self, ep: int, expert_layer: np.ndarray, copies: Optional[int] = None,
                    stride: Optional[int] = None, blocks: Optional[np.ndarray] = None,
                    largest: Optional[np.ndarray] = None) -> None:
        """Routed experts sharded over `ep` of the dp ranks; `expert_layer`: each layer's expert
        weight elements per device (already divided by ep); `copies`: the ranks holding the same
        experts (default dp / ep), `stride` apart in the stage's rank order (default tp x ep;
        folded: dp x tp / ep ranks, ep apart), as `runtime.experts.expert_meshes` lays out its
        "edp" groups; `blocks`: each layer's experts modules (default one where it has expert
        weights), ZeRO-3 units of their own over those ranks (`zero_mb`)."""
        self.ep = ep
        self.ecopies = copies if copies is not None else self.dp // ep
        self.estride = stride if stride is not None else self.tp * ep
        self.expert_pel = np.concatenate([[0.0], np.cumsum(expert_layer)])
        # ZeRO-3 with several copies of each expert: each experts module is an FSDP unit of its
        # own over those copies, nested in its layer's (`runtime.experts.ExpertGroups.fully_shard`).
        # FSDP2 prefetches for the backward in the reverse of the units' post-forward order, the
        # nested one's before its layer's: a layer's pre-backward prefetches its own experts, the
        # experts' the layer before's dense unit, so while the experts' backward runs (their
        # weights and their layer's gathered) the layer before's experts are not (seen on
        # moe-tiny dp4 x ep2: its dense unit's flat all-gather output alone, 10 KiB)
        self.expert_units = (np.asarray(expert_layer, dtype=float).reshape(self.L) if self.zero3 and self.ecopies > 1
                             else np.zeros(self.L))
        if self.zero3 and largest is not None:
            # ZeRO-3 shards an expert tensor over its copies, not over dp: AdamW steps a shard
            # dp / copies times the dense model's (`runtime_phases` divides the temporaries by
            # dp), seen on moe-tiny dp4 x ep2: a gate/up shard's two fp32 temporaries, 16 KiB
            big = np.asarray(largest, dtype=float).reshape(self.L) * ADAMW_TEMPORARIES * self.dp / self.ecopies
            self.range_expert_temps = np.where(self.valid, np.maximum(_range_max(big), 0.0), 0.0)
        self.range_epel = np.where(self.valid, self.ranged(self.expert_pel), 0.0)
        n = (np.asarray(expert_layer) > 0).astype(float) if blocks is None else np.asarray(blocks, dtype=float)
        self.expert_blocks = np.concatenate([[0.0], np.cumsum(n)])
        self.range_eunits = np.where(self.valid, self.ranged(self.expert_blocks), 0.0)

    def sync(self, pel: float, epel: float = 0.0) -> float:
        """The stage's gradient sync: `pel - epel` dense elements over dp; under expert
        parallelism the `epel` expert elements over the dp / ep ranks holding the same experts
        (`tp * ep` apart), a second flat collective. None left under ZeRO-3 reducing every
        micro-batch (`rs_each`: `zero_mb` has them)."""
        if self.rs_each:
            return 0.0
        g = self.dense_grad_bytes
        if self.ep <= 1:
            return _sync_time(self.cluster, self.policy, self.dp, self.tp, self.zero, pel, g)
        return (_sync_time(self.cluster, self.policy, self.dp, self.tp, self.zero, pel - epel, g)
                + _sync_time(self.cluster, self.policy, self.ecopies, self.estride, self.zero, epel))

    def param_gather(self, pel: float, epel: float = 0.0) -> float:
        """Of `sync`, ZeRO-1/2's all-gather of the updated weights (`_param_gather_time`), the
        dense ones over dp and the experts' over their copies; 0 under ZeRO 0 and 3."""
        if self.rs_each:
            return 0.0
        if self.ep <= 1:
            return _param_gather_time(self.cluster, self.policy, self.dp, self.tp, self.zero, pel)
        return (_param_gather_time(self.cluster, self.policy, self.dp, self.tp, self.zero, pel - epel)
                + _param_gather_time(self.cluster, self.policy, self.ecopies, self.estride, self.zero, epel))

    def opt(self, pel: float, tensors: int = 1, epel: float = 0.0) -> float:
        """Optimizer step of `pel` parameter elements in `tensors` parameter tensors (the runtime
        updates one tensor at a time; ZeRO-1/2 update one flat shard). ZeRO shards the optimizer
        state over the ranks holding the same weights: the dense ones over dp, the `epel` expert
        weights of them over the `ecopies` ranks holding the same experts, as the memory model
        holds them (`phases`; `_accumulated_elems`): with ep = dp (no expert data parallelism)
        each rank steps all its experts."""
        flat = self.zero in (1, 2) and self.dp > 1
        elems = float(_accumulated_elems(pel, self.dp, True, epel, self.ecopies)) if self.zero >= 1 else pel
        return (optimizer_step_time(elems, self.cluster.device, self.policy, param_tensors=1 if flat else tensors)
                + unscale_time(pel, self.cluster.device, self.unscale_bytes, self.dp, self.zero, self.zero_optimizer))

    def chunk_temporaries(self, chunks: list[tuple[int, int]]) -> float:
        """AdamW's temporaries at their worst, elements, for a stage whose `chunks` each run as a
        pipeline chunk of the executor (`intra_op.pipeline_chunks.ProgramChunk`): the rank
        steps each chunk's parameters in the order its holder keeps them (`holder_order`: by
        name, not the model's order), the chunks one after the other, a tied one once. For
        ZeRO 0 (ZeRO-1/2 step one flat shard; ZeRO-3's FSDP units hold their own)."""
        key = tuple(chunks)
        if key not in self._temporaries:
            sizes, seen = [], set()
            for k, j in chunks:
                for f, e in self._holder_sizes(k, j):
                    if f not in seen:
                        seen.add(f)
                        sizes.append(e)
            self._temporaries[key] = adamw_temporary_elems(sizes)
        return self._temporaries[key]

    def _holder_sizes(self, k: int, j: int) -> list[tuple[str, float]]:
        """(name, elements) of layers [k, j)'s parameters in their holder's order
        (`holder_order`), kept per range: the search asks for the same chunks many times. The
        holder's order of any subset of the model's parameters is the whole model's holder
        order restricted to it (siblings' names are contiguous in sorted order: a module name
        holds no character below "."), so it is read off one ranking."""
        if (k, j) not in self._holders:
            elems = {f: e for c in self.costs[k:j] for f, e in c.param_elems.items()}
            rank = self._holder_rank
            self._holders[(k, j)] = [(f, elems[f]) for f in sorted(elems, key=rank.__getitem__)]
        return self._holders[(k, j)]

    @functools.cached_property
    def _holder_rank(self) -> dict[str, int]:
        """Each parameter's position in the whole model's holder order (`holder_order`)."""
        return _holder_rank(tuple(f for c in self.costs for f in c.param_elems))

    def param_tensors(self, chunks: list[tuple[int, int]]) -> int:
        """Distinct parameter tensors of the layers in `chunks` (a tied one counts once)."""
        return len({f for k, j in chunks for c in self.costs[k:j] for f in c.param_elems})

    def accum(self, pel: Any, m: int, epel: Any = 0.0) -> Any:
        """Per micro-batch share of adding each micro-batch's weight gradients into the
        accumulated ones (`_accum_time`; the fp32 shards under `rs_each`: `_accumulated_elems`,
        `epel` of `pel` expert weights). With fp32 parameters also every micro-batch's casts of
        the weights and of their gradients (`cast_bytes` a parameter element)."""
        if self.accum_fused and not self.rs_each:
            # the weight-gradient GEMM adds into the accumulated gradient itself (`SoftwareSpec.
            # gradient_accumulation_fusion`): no pass of its own; ZeRO-3's per-micro-batch shards
            # are still added to after each reduce-scatter
            t = np.asarray(pel, dtype=float) * 0.0
        else:
            elems = _accumulated_elems(pel, self.dp, self.rs_each, epel, self.ecopies)
            t = _accum_time(elems, m, self.policy, self.cluster.device)
            if self.reduce_fp32 and not self.rs_each:
                # the dense units' unsharded gradients added into fp32 ones (`reduce_fp32`)
                more = grad_accumulation_bytes(f"{self.dtype}_fp32grad") - grad_accumulation_bytes(self.policy)
                t = t + _accum_time(np.asarray(pel, dtype=float) - np.asarray(epel, dtype=float), m, None,
                                    self.cluster.device, more)
        if self.cast_bytes:
            t = t + memory_time(np.asarray(pel) * self.cast_bytes, self.cluster.device)
        return t

    def grad_reduce(self, pel: float, epel: float = 0.0) -> float:
        """`_grad_reduce_time` of the stage's sync (what an overlapped sync runs beside the last
        backward): the dense gradients over dp, the experts' over the ranks holding the same
        experts (`sync`)."""
        t = _grad_reduce_time(self.cluster, self.policy, self.dp, self.tp, self.zero, pel - epel)
        if self.ep > 1:
            t += _grad_reduce_time(self.cluster, self.policy, self.ecopies, self.estride, self.zero, epel)
        return t

    @functools.cached_property
    def layer_units(self) -> np.ndarray:
        """Prefix sum of each layer's dense ZeRO-3 units (`module_units` holding parameters:
        each one collective of each kind per pass, `zero_mb`)."""
        return np.concatenate([[0.0], np.cumsum([sum(u > 0 for u in us) for us in self.module_units])])

    def range_zero_mb(self, gathers: float = 2.0, r: str = "none") -> np.ndarray:
        """`zero_mb` of every layer range (each as one stage's chunk; `gathers` a unit's
        all-gathers per micro-batch), as much of it as the micro-batch waits for under
        recomputation `r` (`exposed_zero`: its forward, backward and recomputed forward cover
        it). Kept per (`gathers`, `r`) once made: the candidates on this table ask for the same,
        after `Search._tables` set what it reads (read-only)."""
        hit = self._zero_ranges.get((gathers, r))
        if hit is None:
            z = self._zero_ranges.get(gathers)
            if z is None:
                z = self._zero_ranges[gathers] = self.zero_mb(
                    self.range_pel, self.range_epel, np.where(self.valid, self.ranged(self.layer_units), 0.0),
                    self.range_eunits, gathers)
            window = self.ranged(self.compute) + self.ranged(self.rc_compute[r])
            if self.zero3_links_apart:
                window = window + self.ranged(self.layer_comm[r])
            hit = self._zero_ranges[(gathers, r)] = np.asarray(self.exposed_zero(z, window))
            hit.setflags(write=False)
        return hit

    def exposed_zero(self, zero: Any, window: Any) -> Any:
        """Of a micro-batch's ZeRO-3 collectives (`zero_mb`), the seconds it waits for: all of
        them, or with `zero3_overlap` (`SoftwareSpec.zero3_overlap`: the next unit's all-gather
        prefetched on its own stream while a unit computes, reduce-scatters beside the next
        unit's backward) what exceeds `window`, the micro-batch's compute: its forward, its
        backward and its recomputed forward (a checkpointed unit's recomputation runs inside its
        backward, after the pre-backward hook that gathers it and prefetches the next unit's
        gather (FSDP2's backward prefetch, Megatron-FSDP's --overlap-param-gather), and before
        the reduce-scatter of its gradients: the collectives in flight run beside it as beside
        the rest of the backward); its layers' own collectives count as cover only where their
        links are apart from ZeRO-3's (`zero3_links_apart`: tp and the expert exchange inside a
        node over NVLink, every ZeRO-3 group across nodes, bound by the NICs; Megatron-FSDP's
        collectives run on their own NCCL communicators and side stream while the compute
        stream waits on DeepEP's NVLink exchange), else they share the links and do not. An
        assumption, labelled: the gather of the step's first unit, which nothing precedes, and
        the compute the collectives' kernels slow are not charged."""
        if not self.zero3_overlap:
            return zero
        return np.maximum(np.asarray(zero) - np.asarray(window), 0.0)


def _accumulated_elems(pel: Any, dp: int, sharded: bool, epel: Any = 0.0, ecopies: int = 1) -> Any:
    """The gradient elements every backward after a step's first adds its weight gradients
    into: all `pel` of them (accumulated unsharded, reduced once a step), or where ZeRO-3
    reduce-scatters every micro-batch (`sharded`, `Plan.zero3_grad_sync` "microbatch") the
    rank's fp32 shards: 1 / dp of the dense ones, 1 / `ecopies` of the `epel` expert weights'
    (their FSDP units over the ranks holding the same experts; whole where each has one copy)."""
    if not sharded:
        return pel
    pel, epel = np.asarray(pel, dtype=float), np.asarray(epel, dtype=float)
    return (pel - epel) / dp + epel / max(ecopies, 1)


def _accum_time(elems: Any, m: int, policy: Optional[str], device: Any, nbytes: Optional[float] = None) -> Any:
    """Per micro-batch share of adding each micro-batch's weight gradients into the accumulated
    `elems` (autograd does it in every backward after the first, m - 1 of m):
    `grad_accumulation_bytes` per element (`nbytes` where given)."""
    share = (m - 1) / m if m > 1 else 0.0
    per = grad_accumulation_bytes(policy) if nbytes is None else nbytes
    return share * memory_time(np.asarray(elems) * per, device)


def _transient(tb: "_Tables", chunks: list[tuple[int, int]], r: str) -> tuple[float, float]:
    """A stage's backward transient above its saved activations, as (recomputed activations,
    activation gradients): the worst of its chunks' (one runs its backward at a time), the
    larger kind only; a recomputation's moment holds the gradients of the op whose backward
    runs beside what it re-made, counted as gradients (buffers) as a tracker counts them; a
    plain backward moment holds its op's gradients (buffers) where the saved activations
    autograd freed before it are gone (the first item, then at most 0)."""
    if tb.shared:
        # a later micro-batch's moment with a tied parameter's gradient waiting (`tied_work`)
        tot, acts, grads = tb.tied_work(r)
        v, c = max((float(tot[c]), c) for c in chunks)
        if v > max(max(float(tb.range_work_rc[r][c]), float(tb.range_work_tmp[r][c])) for c in chunks) and v > 0:
            return v - float(grads[c]), float(grads[c])
    rc, at = max((float(tb.range_work_rc[r][k, j]), (k, j)) for k, j in chunks)
    tmp, at_tmp = max((float(tb.range_work_tmp[r][k, j]), (k, j)) for k, j in chunks)
    if rc > tmp and rc > 0:
        g = min(float(tb.range_work_rc_grads[r][at]), rc)
        return rc - g, g
    g = float(tb.range_work_tmp_grads[r][at_tmp])
    if tmp > 0 and not np.isnan(g):
        # the op's gradients; what autograd freed of the saved activations before it, less
        return tmp - g, g
    return 0.0, max(tmp, 0.0)


@functools.lru_cache(maxsize=8)
def _holder_rank(names: tuple[str, ...]) -> dict[str, int]:
    """Each of `names`' position in their holder order (`holder_order`), kept per model: every
    table of a search asks for its parameters' (the same names)."""
    return {f: i for i, f in enumerate(holder_order(names))}


def _range_max(x: np.ndarray) -> np.ndarray:
    """out[k, j] = max(x[k:j]) for every layer range [k, j) (-inf where j <= k), shape (L, L + 1)."""
    x = np.asarray(x, dtype=float)
    L = len(x)
    k = np.arange(L)[:, None]
    i = np.arange(L)[None, :]
    run = np.maximum.accumulate(np.where(i >= k, x[None, :], -INF), axis=1)   # run[k, i] = max x[k..i]
    return np.concatenate([np.full((L, 1), -INF), run], axis=1)


def _range_argmax(x: np.ndarray) -> np.ndarray:
    """out[k, j] = the index of max(x[k:j]) (the last of equal ones; -1 where j <= k), the
    companion of `_range_max`."""
    x = np.asarray(x, dtype=float)
    L = len(x)
    k = np.arange(L)[:, None]
    i = np.arange(L)[None, :]
    vals = np.where(i >= k, x[None, :], -INF)
    run = np.maximum.accumulate(vals, axis=1)
    at = np.maximum.accumulate(np.where((i >= k) & (vals >= run), i, -1), axis=1)
    return np.concatenate([np.full((L, 1), -1), at], axis=1)


def _suffix_argmax(x: np.ndarray) -> np.ndarray:
    """out[k] = the index of max(x[k:]) (the first of equal ones)."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    rev = x[::-1]
    run = np.maximum.accumulate(rev)
    last = np.maximum.accumulate(np.where(rev >= run, np.arange(n), -1))
    return (n - 1 - last)[::-1]


_LINEAR: dict[tuple, tuple[float, float]] = {}


def _bottleneck(t: np.ndarray, p: int) -> float:
    """A lower bound on the largest part's sum when the non-negative times `t` are cut into at
    most `p` contiguous parts (the linear partition problem): bisection on the answer, each
    guess checked greedily; returns a value no part split can go below."""
    if len(t) == 0:
        return 0.0
    P = np.concatenate([[0.0], np.cumsum(t)])
    lo, hi = max(float(t.max()), float(P[-1]) / p), float(P[-1])

    def fits(x: float) -> bool:
        k, parts = 0, 0
        while k < len(t):
            k = max(int(np.searchsorted(P, P[k] + x, side="right")) - 1, k + 1)
            parts += 1
            if parts > p:
                return False
        return True

    if fits(lo):
        return lo * (1 - 1e-9)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-9)      # below rounding in the prefix sums


def _dp_coll(cluster: ClusterSpec, kind: str, nbytes: float, dp: int, tp: int) -> float:
    """`kind` over one data-parallel group of the first stage (ranks 0, tp, 2 tp, ...): intra-node,
    rail or hierarchical across nodes (`cost_models.communication.axis_collective_time`). The
    model is affine in the bytes for a given group, so two evaluations per group are cached."""
    if dp <= 1 or nbytes <= 0:
        return 0.0
    if nbytes < 1e6:
        return axis_collective_time(kind, nbytes, cluster, [i * tp for i in range(dp)])
    key = (id(cluster), cluster.num_nodes, kind, dp, tp)
    if key not in _LINEAR:
        group = [i * tp for i in range(dp)]
        t1 = axis_collective_time(kind, 1e6, cluster, group)
        t2 = axis_collective_time(kind, 1e9, cluster, group)
        slope = (t2 - t1) / (1e9 - 1e6)
        _LINEAR[key] = (t1 - slope * 1e6, slope)
    a, b = _LINEAR[key]
    return max(0.0, a + b * nbytes)


def _zero3_links_apart(per_node: int, tp: int, dp: int, cp: int, ep: int, fold: bool, ecopies: int,
                       estride: int) -> bool:
    """Whether a stage's layer collectives and its ZeRO-3 collectives cross different links
    (`_Tables.zero3_links_apart`), in autopar's rank order (tp innermost, then the dp x cp
    ranks tp apart): every layer group inside one node of `per_node` devices (tp's `tp`
    adjacent ranks; cp's, tp apart; the expert exchange's `ep` ranks, adjacent where folded
    over tp x dp, else tp apart) and every ZeRO-3 group that moves bytes spanning nodes (the
    dense one, dp x cp ranks tp apart; the experts', `ecopies` ranks `estride` apart, where
    there are copies), its collectives bound by the NICs the layers' do not use."""
    inside = tp <= per_node and cp * tp <= per_node and (ep <= 1 or (ep if fold else ep * tp) <= per_node)
    dense_across = dp * cp > 1 and (dp * cp - 1) * tp + 1 > per_node
    experts_across = ecopies <= 1 or (ecopies - 1) * estride + 1 > per_node
    return inside and dense_across and experts_across


def _zero3_gathers(pp: int, m: int) -> float:
    """All-gathers of a ZeRO-3 unit per micro-batch as the runtime issues them
    (`planner._zero3_counts`): 2 in one stage (gathered for the forward, again for the
    backward); in a pipeline m + 1 a step of m micro-batches (one per forward, one for all the
    backwards: torch.pipelining reshards after the last)."""
    return 2.0 if pp <= 1 else (m + 1) / m


def _dp_affine(cluster: ClusterSpec, kind: str, dp: int, tp: int) -> tuple[float, float]:
    """`_dp_coll` of `kind` over one group of `dp` ranks `tp` apart as (intercept, seconds per
    byte): a 1-byte collective's time, and the slope between it and a 1 GB one's."""
    big = 1e9
    t0 = _dp_coll(cluster, kind, 1.0, dp, tp)
    return t0, (_dp_coll(cluster, kind, big, dp, tp) - t0) / big


# `_no_fit`'s hint where the pins keep ZeRO-3's gradients unsharded until the step's end
_EACH_HINT = ", or ZeRO-3 reducing every micro-batch (zero3_grad_sync unset)"


def _sync_time(cluster: ClusterSpec, dtype: str, dp: int, tp: int, zero: int, pel: float,
               grad_bytes: Optional[float] = None) -> float:
    """Per-iteration gradient sync of one stage over dp, as the runtime does it: one flat
    all-reduce (ZeRO 0), one reduce-scatter + one all-gather of the updated weights (ZeRO 1
    and 2), one reduce-scatter after the last micro-batch (ZeRO 3), with the copies into and
    out of the flat buffers (`_pack_time`). `grad_bytes`: a gradient element's bytes where not
    the policy's (`_Tables.dense_grad_bytes`)."""
    w, g, _ = PRECISION_POLICIES[dtype]
    g = g if grad_bytes is None else grad_bytes
    if dp == 1:
        return 0.0
    if zero == 0:
        return _dp_coll(cluster, "all_reduce", pel * g, dp, tp) + _pack_time(cluster, pel * g * 6)
    if zero in (1, 2):
        return (_dp_coll(cluster, "reduce_scatter", pel * g, dp, tp) + _dp_coll(cluster, "all_gather", pel * w, dp, tp)
                + _pack_time(cluster, pel * (2 * g + 2 * w)))
    return _dp_coll(cluster, "reduce_scatter", pel * g, dp, tp)


def is_scalar(graph: OpGraph, fqn: str) -> bool:
    """Whether parameter `fqn` is 0-D (a logit scale): ZeRO-3 keeps it replicated over dp and
    all-reduces its gradient once per step (`runtime.zero`; `planner._placements` places it)."""
    info = graph.params.get(fqn)
    return info is not None and len(info.shape) == 0


def _layer_scalars(graph: OpGraph, layers: list[Layer]) -> list[list[str]]:
    """Per layer, the 0-D parameters it reads (`is_scalar`)."""
    return [[f for f in lay.params if is_scalar(graph, f)] for lay in layers]


def _grad_reduce_time(cluster: ClusterSpec, dtype: str, dp: int, tp: int, zero: int, pel: float) -> float:
    """The part of `_sync_time` that reduces gradients and so may run during the backward
    (`SoftwareSpec.grad_sync_overlap`): ZeRO 0's all-reduce, ZeRO 1/2's reduce-scatter; none for
    ZeRO 3 (its per-unit collectives are left as costed)."""
    _, g, _ = PRECISION_POLICIES[dtype]
    if dp == 1 or zero == 3:
        return 0.0
    return _dp_coll(cluster, "all_reduce" if zero == 0 else "reduce_scatter", pel * g, dp, tp)


def _param_gather_time(cluster: ClusterSpec, dtype: str, dp: int, tp: int, zero: int, pel: float) -> float:
    """The part of `_sync_time` that gathers the updated weights (ZeRO 1/2's all-gather), which a
    distributed optimizer may run beside the next step's forward (`SoftwareSpec.param_sync_overlap`);
    0 otherwise."""
    w = PRECISION_POLICIES[dtype][0]
    if dp == 1 or zero not in (1, 2):
        return 0.0
    return _dp_coll(cluster, "all_gather", pel * w, dp, tp)


def _exposed_param_gather(gather: float, shares: list[float], forwards: list[float], ahead: int) -> float:
    """Seconds of a stage's weight all-gather (`gather`, ZeRO-1/2) the next step waits for when it
    runs beside that step's forward (`SoftwareSpec.param_sync_overlap`). One chunk: apex's
    DistributedFusedAdam gathers a bucket when a forward pre-hook of its parameters fires and then
    launches the next, one bucket in flight (distributed_fused_adam.py at 810ffae, pre_forward_hook
    lines 851-860, _try_start_bucket_param_sync 1897-1913): what exceeds the chunk's first forward
    is waited. Several chunks (the interleaved schedule): Megatron-Core launches the first two
    chunks' gathers as the step starts and chunk c + 1's as chunk c's first micro-batch starts its
    forward (core_v0.10.0 pipeline_parallel/schedules.py:713-716, 862-880, NeMo's param_sync_func):
    chunk 0's gather (its `shares` of `gather`) is waited, chunk c's beyond the `ahead` forwards of
    chunk c - 1 that run before its own first (`forwards`: one micro-batch's forward of each chunk;
    `ahead`: min(pp, m), the micro-batches a chunk's warm-up runs before the next chunk's). An
    estimate of those chains: the gathers' slowing of the forwards they run beside is not counted."""
    if gather <= 0:
        return 0.0
    if len(shares) <= 1:
        return max(0.0, gather - sum(forwards))
    out = gather * shares[0]
    for c in range(1, len(shares)):
        out += max(0.0, gather * shares[c] - ahead * forwards[c - 1])
    return out


def _exposed_sync(sync: float, reduce: float, window: float) -> float:
    """Seconds of a stage's per-iteration sync (`sync`, of which `reduce` reduces gradients) on
    the critical path when the reduction overlaps the backward (`SoftwareSpec.grad_sync_overlap`):
    the reduction beyond `window` (the backward of the stage's last micro-batch, during which
    buckets of finished gradients are reduced) and the rest of the sync."""
    return sync - reduce + max(0.0, reduce - window)


def _pack_time(cluster: ClusterSpec, nbytes: float) -> float:
    """Memory traffic of the runtime's flat buffers around the sync: ZeRO 0 copies the gradients
    into one buffer, averages it in place and copies it back (6 gradient-sized accesses); ZeRO 1
    and 2 copy the gradients in (2) and the gathered weights back out (2)."""
    return memory_time(nbytes, cluster.device)


def _inter_link(cluster: ClusterSpec):
    """The link a transfer between nodes takes (the node's own on a one-node cluster)."""
    return cluster.inter_node if cluster.num_nodes > 1 and cluster.inter_node is not None else cluster.intra_node


def _dp_link(cluster: ClusterSpec, dp: int, tp: int):
    """Data-parallel groups are `tp` ranks apart: inside a node while dp * tp fits in one."""
    return axis_link(cluster, dp, stride=tp)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rooted_modules(graph: OpGraph, layers: list[Layer], tied_only: bool = False) -> frozenset:
    """The layers' modules that ZeRO-3 leaves to the root unit, whose parameters stay gathered
    from the forward to the backward (as `planner.zero3_units` decides without pipelining): a
    module holding a parameter under one of its tied names, or one an op outside the modules
    holding it reads (a head computed as `x @ emb.weight.t()`). `tied_only`: the first kind
    alone, what a pipeline chunk leaves to its root too (`planner.zero3_units`, pipelined)."""
    under = lambda n, mod: n == mod or n.startswith(mod + ".")  # noqa: E731
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        for f in n.params or ():
            readers.setdefault(f, set()).add(n.module_path or "")
    modules = [m for layer in layers for m in layer.modules]
    out: set[str] = set()
    for f, info in graph.params.items():
        names = [f, *info.tied]
        owners = [a.rsplit(".", 1)[0] if "." in a else "" for a in names]
        outside = any(not any(o == "" or under(p, o) for o in owners) for p in readers.get(f, ()))
        if len(names) > 1 or (outside and not tied_only):
            out.update(m for m in modules if any(under(n, m) for n in names))
    return frozenset(out)


class Search:
    def __init__(self, graph: OpGraph, layers: list[Layer], cluster: ClusterSpec, gbs: int, dtype: str,
                 cons: Constraints, provider=None, progress: bool = False, sp_provider=None) -> None:
        """`sp_provider`: the layers' costs with Megatron-SP on the tp axis (an `IlpProvider`
        with `sequence_parallel`); given, every candidate with tp > 1 run op by op is also
        tried with it (`Candidate.sp`) and the faster kept. `provider` itself may be such a
        provider (SP pinned on)."""
        self.graph, self.layers, self.cluster = graph, layers, cluster
        self.gbs, self.dtype, self.cons = gbs, dtype, cons
        # the 0-D parameters each layer reads (ZeRO-3 keeps them replicated: `_scalar_sync`)
        self._scalars = _layer_scalars(graph, layers)
        self._any_scalar = any(self._scalars)
        self._rooted: Optional[frozenset] = None
        self._rooted_tied: Optional[frozenset] = None
        self.provider = provider or AnalyticProvider(graph, layers, cluster, dtype)
        self.sp_provider = sp_provider
        self.sp_skipped: dict[tuple[int, int], str] = {}   # (mb, tp) -> why SP cannot run there
        self.skipped: dict[str, str] = {}      # candidates left out as the runtime cannot run them: why
        # the software the provider costs with (`SoftwareSpec`): also whether the gradient
        # sync overlaps the backward
        self.software = getattr(self.provider, "software", None) or resolve_software(None)
        # the precision of the model states, gradient accumulation and sync: fp32 where the
        # software keeps fp32 parameters under autocast (`SoftwareSpec.param_dtype`)
        self.policy = self.software.state_policy(dtype)
        self.progress = progress
        self.N = cluster.num_devices
        self.L = len(layers)
        self.budget = usable_memory(cluster.device, self.software)
        # the batch a rank holds through its step (its data-parallel replica's rows of every
        # batched input, copied to the device: `ParallelModel.local_batch`), per sample and
        # input, in the model's argument order (the first goes to the first pipeline stage)
        inputs = [n for n in graph.nodes if n.kind == "input"]
        batched = {n.name for n in inputs if graph.batch_size is not None or any(o.is_batched for o in n.outputs)}
        g1 = graph.at_batch(1) if graph.batch_size is None and batched else graph
        per = {n.name: sum(o.nbytes for o in n.outputs) / (graph.batch_size or 1)
               for n in g1.nodes if n.name in batched}
        self.input_bytes = [per.get(n.name, 0.0) for n in inputs] or [0.0]
        # the least memory any plan needs: only the error when no plan fits reports it, so it is
        # followed until the first plan that fits is found (`_found`), not after
        self.min_memory = INF
        self._found = False
        self.evaluated = 0
        self.considered = 0
        self.considered_infeasible = 0    # candidates whose model states alone overflow
        self._chunk_cache: dict = {}
        self._held_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._tables_cache: dict = {}
        self._costs_cache: dict = {}
        self._agree_cache: dict[tuple[int, int, bool], bool] = {}    # `_layouts_agree`
        self._floor_cache: dict[tuple[int, int], np.ndarray] = {}
        self._bottlenecks: dict[tuple[bytes, int], float] = {}   # `_bottleneck` per (least times, pp)
        self._dp_cache: dict[tuple, Any] = {}       # `_evaluate_hetero`: table -> `stage_dp`'s result
        self.experts = ExpertCosting(graph, layers, software=self.software)
        # the layers' graphs the folded expert blocks' other ops are priced on (`_fold_ops_delta`)
        self.experts.provider = self.provider
        if (cons.ep or 1) > 1 and not self.experts:
            raise PlanError(f"ep={cons.ep}: the model has no routed experts (no grouped GEMM over stacked expert "
                            f"weights was captured); leave ep unset", constraint="ep")
        if cons.ep and self.experts:
            bad = [b for b in self.experts.blocks if b.num_experts % cons.ep]
            if bad:
                raise PlanError(f"ep={cons.ep} does not divide the {bad[0].num_experts} experts of {bad[0].module}; "
                                f"pick a divisor of the expert count", constraint="ep")
            if cons.dp and cons.dp % cons.ep and (cons.tp == 1 or (cons.tp and (cons.dp * cons.tp) % cons.ep)):
                raise PlanError(f"ep={cons.ep} must divide dp={cons.dp} (the experts sharded over groups of data-"
                                f"parallel ranks) or, folded over the stage's dp x tp ranks (Megatron-Core's MoE "
                                f"parallel folding, tp > 1), dp x tp={cons.dp * (cons.tp or 1)}", constraint="ep")
        if cons.expert_dp is not None:
            if not self.experts:
                raise PlanError(f"expert_dp={cons.expert_dp}: the model has no routed experts; leave expert_dp "
                                f"unset", constraint="expert_dp")
            if cons.dp and cons.ep and cons.expert_dp * cons.ep not in (cons.dp, cons.dp * (cons.tp or 0)):
                raise PlanError(f"expert_dp={cons.expert_dp} x ep={cons.ep} must equal dp={cons.dp} (the experts "
                                f"replicated over tp or split over it) or dp x tp (folded over the stage's ranks)",
                                constraint="expert_dp")
        if (cons.expert_tp or 1) > 1:
            if not self.experts:
                raise PlanError(f"expert_tp={cons.expert_tp}: the model has no routed experts; leave expert_tp "
                                f"unset", constraint="expert_tp")
            if cons.ep == 1:
                raise PlanError(f"expert_tp={cons.expert_tp} needs expert parallelism (ep > 1; ep=1 runs the "
                                f"experts replicated over tp); leave ep unset or pin expert_tp=1",
                                constraint="expert_tp")
            if cons.tp is not None and cons.expert_tp != cons.tp:
                raise PlanError(f"expert_tp={cons.expert_tp} must be 1 or tp={cons.tp}: the experts are split over "
                                f"the stage's tensor-parallel ranks", constraint="expert_tp")
            if cons.stage_tp is not None:
                raise PlanError(f"expert_tp={cons.expert_tp} with stage_tp: stages of several tp degrees are not "
                                f"planned with expert tensor parallelism; leave one unset", constraint="expert_tp")
            bad = [b for b in self.experts.blocks if cons.expert_tp not in self.experts.tp_degrees(cons.expert_tp)]
            if bad:
                raise PlanError(f"expert_tp={cons.expert_tp}: the expert weights of {bad[0].module} cannot be split "
                                f"over {cons.expert_tp} ranks (each expert's hidden dim must divide by it, and the "
                                f"weights be (E, hidden, width) or (E, width, hidden)); pin expert_tp=1",
                                constraint="expert_tp")

    # -- the space -----------------------------------------------------------------------------
    def meshes(self, cp: int = 1) -> list[tuple[int, int, int]]:
        """(dp, tp, pp) triples allowed by the constraints and the cluster's shape, each stage
        of dp x cp x tp devices (`cp`: the context-parallel degree)."""
        c, dpn = self.cons, self.cluster.devices_per_node
        N = self.N // cp
        if c.dp and c.tp and c.pp and c.dp * c.tp * c.pp != N:
            what = f"dp x cp x tp x pp = {c.dp} x {cp} x {c.tp} x {c.pp}" if cp > 1 else \
                f"dp x tp x pp = {c.dp} x {c.tp} x {c.pp}"
            raise PlanError(f"{what} = {c.dp * cp * c.tp * c.pp} does not equal the cluster's {self.N} devices",
                            constraint="dp")
        for name in ("dp", "tp", "pp"):
            v = getattr(c, name)
            if v is not None and N % v:
                raise PlanError(f"{name}={v} does not divide {N}, the cluster's {self.N} devices over cp={cp}"
                                if cp > 1 else f"{name}={v} does not divide the cluster's {N} devices",
                                constraint=name)
        if c.zero3_grad_sync == "microbatch" and (c.zero_stage != 3 or c.pp != 1):
            raise PlanError(f"zero3_grad_sync=\"microbatch\" (ZeRO-3's gradients reduce-scattered every micro-batch) "
                            f"needs zero_stage=3 and pp=1 pinned (got zero_stage={c.zero_stage}, pp={c.pp}): "
                            f"torch.pipelining syncs a stage's gradients after its last micro-batch",
                            constraint="zero3_grad_sync")
        if c.pp is not None and c.pp > self.L:
            raise PlanError(f"pp={c.pp} stages need at least {c.pp} layers; the model has {self.slots_text()} "
                            f"({', '.join(l.name for l in self.layers[:4])}{' ...' if self.L > 4 else ''})",
                            constraint="pp")
        if c.dp is not None and self.gbs % c.dp:
            raise PlanError(f"global batch {self.gbs} does not divide over dp={c.dp} replicas",
                            constraint="global_batch_size")
        tps = [c.tp] if c.tp else [t for t in divisors(N) if t <= dpn and (t & (t - 1)) == 0 or t == dpn and N % t == 0]
        tps = sorted({t for t in tps if N % t == 0})
        out = []
        for tp in tps:
            for dp in ([c.dp] if c.dp else divisors(N // tp)):
                if (N // tp) % dp:
                    continue
                pp = N // (tp * dp)
                if c.pp and pp != c.pp:
                    continue
                if pp > self.L or self.gbs % dp or (c.ep and dp % c.ep and (tp == 1 or (dp * tp) % c.ep)):
                    continue
                u = dp * cp * tp
                if not (dpn % u == 0 or u % dpn == 0):
                    if c.dp and c.tp and c.pp:
                        raise PlanError(f"a stage of dp x cp x tp = {u} devices is neither a power-of-two slice of a "
                                        f"{dpn}-device node nor whole nodes", constraint="tp")
                    continue
                out.append((dp, tp, pp))
        if not out:
            raise PlanError(f"no dp x tp x pp layout of {N} devices satisfies the constraints "
                            f"(dp={c.dp}, tp={c.tp}, pp={c.pp}) with global batch {self.gbs} and "
                            f"{self.L} layers: dp must divide the global batch and pp cannot exceed the layers",
                            constraint="dp" if c.dp else ("pp" if c.pp else "tp"))
        return out

    def microbatches(self, dp: int) -> list[int]:
        c = self.cons
        local = self.gbs // dp
        mbs = [b for b in divisors(local) if b <= MAX_MICROBATCH or b == c.microbatch_size]
        if c.microbatch_size is not None:
            mbs = [b for b in mbs if b == c.microbatch_size]
        if c.num_microbatches is not None:
            mbs = [b for b in mbs if local // b == c.num_microbatches]
        return mbs

    def schedules(self, pp: int, m: int) -> list[tuple[str, int]]:
        c = self.cons
        out = []
        # searched by default: every registered schedule but GPipe, which has 1F1B's bubble and
        # holds every micro-batch at once
        default = [k.name for k in SCHEDULES.values() if k.name != "gpipe"]
        scheds = [c.schedule] if c.schedule else (default if pp > 1 else ["1f1b"])
        if c.virtual_stages is not None and c.virtual_stages > 1 and c.schedule is None:
            scheds = [k.name for k in SCHEDULES.values() if k.interleaved]
        for s in scheds:
            if schedule_kind(s).interleaved:
                vs = [c.virtual_stages] if c.virtual_stages else [v for v in (2, 3, 4, 6, 8) if pp * v <= self.L]
                for v in vs:
                    if pp > 1 and pp * v <= self.L and m % pp == 0:
                        out.append((s, v))
                    elif c.schedule and c.virtual_stages:
                        pass
                if c.schedule and pp == 1:
                    out.append((s, 1))
            else:
                if c.virtual_stages in (None, 1):
                    out.append((s, 1))
        return out

    def zeros(self, dp: int, tp: int) -> list[int]:
        """ZeRO stages to try; ZeRO-3 with tp > 1 only when pinned (the runtime's FSDP path
        takes tp = 1)."""
        if self.cons.zero_stage is not None:
            return [self.cons.zero_stage]
        return [0] if dp == 1 else ([0, 1, 2, 3] if tp == 1 else [0, 1, 2])

    def recomputes(self) -> list[str]:
        return [self.cons.recompute] if self.cons.recompute else list(RECOMPUTES)

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        """The best candidate (`SearchResult`); the schedule walks it made are kept on disk for
        the next search (`cost_models.schedules.save_moments`), found or not."""
        try:
            return self._run()
        finally:
            save_moments()

    def _run(self) -> SearchResult:
        t0 = time.perf_counter()
        first, then = self.context_degrees()
        try:
            best = self._walk(self._ordered(first))
        except PlanError as e:
            if not then or e.min_memory_bytes is None:
                raise
            best = None
        if best is None and then:
            # no plan fits without context parallelism: the degrees that split the sequence
            before = self.considered
            try:
                best = self._walk(self._ordered(then))
            except PlanError as e:
                if e.min_memory_bytes is None:
                    raise self._no_fit() from None
                raise
            self.considered += before
        if best is None and self.cons.stage_tp is not None and self.skipped:
            where, why = next(iter(self.skipped.items()))
            raise PlanError(f"stage_tp={tuple(self.cons.stage_tp)}: the runtime cannot run its best split "
                            f"({where}): {why}", constraint="stage_tp")
        disagree = [f"{where}: {why}" for where, why in self.skipped.items() if why == LAYOUTS_DISAGREE]
        if best is None and self.min_memory == INF and disagree:
            # every candidate left out as `evaluate` found no per-op layouts for it
            raise PlanError(f"no plan the runtime executes: {disagree[0]}", constraint="tp")
        if best is None and self.cons.stage_tp is not None and self.min_memory == INF:
            raise PlanError(f"stage_tp={tuple(self.cons.stage_tp)}: no split of the {self.L} layers over these "
                            f"stages fits in memory", constraint="stage_tp")
        if best is None:
            raise self._no_fit()
        return SearchResult(best, self.layers, self.sp_provider if best.sp else self.provider, self.evaluated,
                            self.considered, time.perf_counter() - t0, self.min_memory, dict(self.skipped),
                            self.experts)

    def _walk(self, ordered: Iterator[tuple[float, Optional[Candidate]]]) -> Optional[Candidate]:
        """The best candidate of `ordered` (`_ordered`) that fits (None where none does),
        visited in the order of their bounds until a bound exceeds the best found."""
        best: Optional[Candidate] = None
        bar = _Progress(self.progress, self.considered)
        for lb, cand in ordered:
            bar.update(self.evaluated, best)
            if best is not None and lb >= best.iteration_s:
                break
            if cand is None:            # a group's bound: its candidates follow, costed
                continue
            self.evaluated += 1
            grad_sync = self.cons.zero3_grad_sync
            each = cand.zero == 3 and cand.pp == 1 and cand.m > 1 and cand.replicas > 1 and not cand.hetero_tps
            cand.rs_each = each and grad_sync == "microbatch"
            ok = self.evaluate(cand, self.tables_for(cand), INF if best is None else best.iteration_s)
            if not ok and each and grad_sync is None:
                # unsharded gradients accumulated over the micro-batches do not fit: reduce-scatter
                # them every micro-batch (more collectives, 4 / dp bytes a parameter held)
                cand.rs_each = True
                ok = self.evaluate(cand, self.tables_for(cand), INF if best is None else best.iteration_s)
            if ok and (best is None or cand.iteration_s < best.iteration_s * (1 - 1e-9)):
                best = cand
                self._found = True
        bar.done()
        return best

    def _ordered(self, cps: tuple[int, ...] = (1,)) -> Iterator[tuple[float, Optional[Candidate]]]:
        """The candidates at the context-parallel degrees `cps` in `candidates(cps)`'s order
        (bound, then ZeRO stage, chunks, enumeration), each with its bound, but a (mesh,
        micro-batch, SP, cp) group's layers costed only when it is reached: first
        `(floor, None)`, its bound from `AnalyticProvider.time_floor` (each op's compute at its
        cheapest, no collective, no per-micro-batch or step terms: at most every bound of the
        group), then its candidates merged in as `candidates()` bounds them. The
        caller stops at the first bound no better than its best plan, so a group whose floor
        is past it is never costed (GPT-3 175B on 1536 GPUs: its groups span micro-batches 1 to
        64, the evaluated candidates 1 to 8; 60 ILP solves instead of 216), and what it
        evaluates, in what order, is what `candidates()` would give.
        `considered` counts a group never costed as its candidates (its layers could have
        shown that tp cannot hold them, or that SP cannot run there: then it has none).
        With stage_tp pinned or routed experts (their layer costs are reshaped per ep degree)
        every group is costed up front (`candidates()`). A cp > 1 group's floor is 0 (costed
        first: its layers' floors on a cp rank are not scaled from cp = 1's)."""
        if self.cons.stage_tp is not None or self.experts:
            cands = self.candidates(cps)
            return iter(cands)
        by_cp = {cp: self._cp_meshes(cp) for cp in cps}
        meshes = by_cp.get(1, [])
        groups: list[tuple] = []        # ("mesh", dp, tp, pp, mb, sp, cp) or ("hetero", dp, mb, tps)
        heap: list[tuple[tuple, Any]] = []
        nominal: list[int] = []

        def add(group: tuple, count: int, floor: float) -> None:
            heapq.heappush(heap, ((floor, -1, -1, len(groups), -1), len(groups)))
            groups.append(group)
            nominal.append(count)

        for cp, (dp, tp, pp) in ((cp, x) for cp, ms in by_cp.items() for x in ms):
            for mb in self.microbatches(dp):
                m = self.gbs // dp // mb
                for sp in ((False, True) if self.sp_provider is not None and tp > 1 else (False,)):
                    slots = self._group_slots(dp, tp, pp, mb, sp, cp)
                    scheds = self.schedules(pp, m)
                    if slots and scheds:    # else no candidate: `candidates()` adds none either
                        add(("mesh", dp, tp, pp, mb, sp, cp), len(slots) * len(scheds),
                            self._floor_bound(tp, pp, mb, m, scheds, cp))
        # stages of different tp: without context parallelism only (`candidates`)
        for D, mb, tps in (self._hetero_groups(meshes) if 1 in cps and self._hetero_allowed() else []):
            # `_hetero_group_candidates`' bound with each layer at its floor, over every tp
            m = self.gbs // D // mb
            work = min(float(self._floors(mb, T).sum()) * T for T in tps)
            add(("hetero", D, mb, tps), len(self._hetero_schedules()) * len(self.zeros(D, max(tps))),
                m * work / (self.N // D) * (1 - 1e-9))
        self.considered = sum(nominal)

        def walk() -> Iterator[tuple[float, Optional[Candidate]]]:
            found = False
            while heap:
                key, item = heapq.heappop(heap)
                if isinstance(item, Candidate):
                    found = True
                    yield key[0], item
                    continue
                yield key[0], None
                group = groups[item]
                if group[0] == "hetero":
                    got = self._hetero_group_candidates(*group[1:])
                    none = not got          # fewer than two tp degrees hold its layers
                elif group[5] and True not in self._sp_options(group[4], group[2]):
                    got, none = [], True    # SP cannot run there
                else:
                    got, issues = self._group_candidates(*group[1:])
                    none = bool(issues)     # tp cannot hold its layers
                if none:
                    self.considered -= nominal[item]    # `candidates()` counts none of them
                for i, (lb, cand) in enumerate(got):
                    heapq.heappush(heap, ((lb, cand.zero, cand.v, item, i), cand))
            if not found:
                self.candidates(cps)    # nothing to evaluate: the errors the whole enumeration gives
        return walk()

    def _floors(self, mb: int, tp: int) -> np.ndarray:
        """`AnalyticProvider.time_floor` of every layer at (mb, tp), read-only (kept per search);
        zeros for a provider without one (its groups are all costed first)."""
        if (mb, tp) not in self._floor_cache:
            floor = getattr(self.provider, "time_floor", None)
            a = np.array([floor(l, mb, tp) if floor else 0.0 for l in self.layers], dtype=float)
            a.setflags(write=False)
            self._floor_cache[(mb, tp)] = a
        return self._floor_cache[(mb, tp)]

    def _floor_bound(self, tp: int, pp: int, mb: int, m: int, scheds: list[tuple[str, int]], cp: int = 1) -> float:
        """At most the bound `candidates()` gives any candidate of a (tp, pp, mb) group: its
        terms with each layer at `AnalyticProvider.time_floor` and no per-micro-batch or step
        term (ZeRO-3's gathers, accumulation, sync, optimizer: none negative). 0 for cp > 1
        (the group costed when its turn comes first)."""
        if cp > 1:
            return 0.0
        floors = self._floors(mb, tp)
        ideal = m * float(floors.sum()) / pp
        # the slowest stage of a split into pp: at least the slowest layer and the average
        # stage (`_bottleneck`'s first guess; its bisection costs more than the floor saves)
        slowest = max(float(floors.max()), float(floors.sum()) / pp) if len(floors) else 0.0
        out = INF
        for sched, v in scheds:
            lb = ideal * (1 + schedule_kind(sched).bubble_fraction(pp, m, v))
            if v == 1 and not schedule_kind(sched).interleaved:
                mu = ideal / m
                lb = max(lb, pp * mu + (m - 1) * max(mu, slowest))
            out = min(out, lb)
        return out * (1 - 1e-9)     # below the rounding of sums taken in another order

    def _executable(self, cp: int, dp: int, tp: int, pp: int, ep: int) -> bool:
        """False for a context-parallel layout the runtime does not execute
        (`inter_op.context_parallel.unexecuted_parts`) when cp is not pinned, recorded in
        `skipped`; a pinned cp is planned all the same (the plan says it is not executed)."""
        if cp == 1 or self.cons.cp is not None:
            return True
        from autopar.inter_op.context_parallel import unexecuted_parts

        why = unexecuted_parts(ep, tp, pp, self.graph.reads_positions is False)
        if why:
            self.skipped[f"cp={cp} dp={dp} tp={tp} pp={pp}"] = (
                f"context parallelism with {', '.join(why)} is not executed by the runtime (pin cp to plan it)")
        return not why

    def context_degrees(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The context-parallel degrees the search tries first, and those it tries only where no
        first one has a plan that fits. Pinned (`Constraints.cp`): that degree alone (PlanError
        where the model or cluster cannot take it). Else cp = 1, and the degrees > 1 the model
        admits (`context_parallel.degrees`) first too where its sequence is long
        (`context_parallel.LONG_SEQUENCE`), otherwise only when nothing fits without them: a
        search where context parallelism cannot help costs what it did without it. Not with
        `stage_tp` (stages of different tp)."""
        pinned = self.cons.cp
        if pinned == 1 or (pinned is None and self.cons.stage_tp is not None):
            return (1,), ()
        if pinned is not None and self.cons.stage_tp is not None:
            raise PlanError("cp cannot be combined with stage_tp (stages of different tp degrees); drop one",
                            constraint="cp")
        cps, why = context_parallel.degrees(self.graph, self.layers, self.N, pinned)
        if pinned is not None:
            if why:
                raise PlanError(f"cp={pinned}: {why}", constraint="cp")
            return tuple(cps), ()
        if not cps:
            if why and self.cons.dp is None:
                self.skipped["cp"] = f"context parallelism not searched: {why}"
            return (1,), ()
        if (context_parallel.sequence_length(self.graph) or 0) >= context_parallel.LONG_SEQUENCE:
            return (1, *cps), ()
        return (1,), tuple(cps)

    def _cp_meshes(self, cp: int) -> list[tuple[int, int, int]]:
        """`meshes(cp)`; for an unpinned cp > 1, none where the constraints leave it no layout."""
        if cp == 1 or self.cons.cp is not None:
            return self.meshes(cp)
        try:
            return self.meshes(cp)
        except PlanError:
            return []

    def tables_for(self, cand: Candidate) -> Optional["_Tables"]:
        """The cost tables `evaluate` reads for `cand` (None for a hetero candidate: its stages'
        tables are built per tp degree)."""
        if cand.hetero_tps:
            return None
        return self._tables(cand.mb, cand.tp, cand.dp, cand.zero, sp=cand.sp, ep=cand.ep, cp=cand.cp,
                            etp=cand.etp, fold=cand.fold, rs_each=cand.rs_each)

    def _layouts_agree(self, mb: int, tp: int, sp: bool = False) -> bool:
        """Whether the layers' solutions at (mb, tp) agree at every boundary: each tensor
        entering a layer arrives as that layer's solution assumed (`stage_layouts.chunk_layouts`
        of the whole model as one chunk; a pipeline's chunks of one tp degree hand their tensors
        on as they leave them, so its cut changes nothing). Where not, the plan gets no per-op
        layouts and `autopar run` refuses it (`planner._op_layouts`): a free search leaves the
        candidate out (`evaluate`). True without per-op solutions."""
        prov = self.sp_provider if sp else self.provider
        solutions = getattr(prov, "solutions", None)
        if solutions is None or tp == 1:
            return True
        key = (mb, tp, sp)
        if key not in self._agree_cache:
            from autopar.inter_op.stage_layouts import chunk_layouts

            self._layer_costs(mb, tp, sp=sp)          # the layers solved at (mb, tp)
            lays, _ = chunk_layouts(self.graph, self.layers, solutions, [(0, self.L, tp, "none")], mb)
            self._agree_cache[key] = lays is not None
        return self._agree_cache[key]

    def candidates(self, cps: tuple[int, ...] = (1,)) -> list[tuple[float, Candidate]]:
        """Every candidate the constraints allow at the context-parallel degrees `cps`, with a
        lower bound on its iteration time, in the order the search evaluates them (bound first):
        the search stops at the first whose bound is no better than the best plan found.
        PlanError when none is left. Costs every
        group's layers (`_ordered` costs them as the search reaches them)."""
        # stage_tp pinned: only its stages of (maybe) different tp degrees (`_pinned_hetero`)
        by_cp = {cp: self._cp_meshes(cp) for cp in cps} if self.cons.stage_tp is None else {}
        meshes = by_cp.get(1, [])
        issues: list[str] = []
        cands: list[tuple[float, Candidate]] = []
        self.considered_infeasible = 0
        for cp, (dp, tp, pp) in ((cp, x) for cp, ms in by_cp.items() for x in ms):
            for mb, sp in ((b, s) for b in self.microbatches(dp) for s in self._sp_options(b, tp)):
                got, iss = self._group_candidates(dp, tp, pp, mb, sp, cp)
                issues.extend(iss)
                cands.extend(got)
        if self.cons.stage_tp is not None or 1 in cps:
            # stages of different tp: without context parallelism only
            cands.extend(self._extra_candidates(meshes))
        if not cands and self.considered_infeasible:
            raise self._no_fit()
        if not cands:
            if issues:
                raise PlanError(f"tensor parallelism cannot hold: {issues[0]}", constraint="tp")
            raise PlanError(self._why_no_candidates(meshes or next(iter(by_cp.values()), [])),
                            constraint=self._failing_constraint())
        cands.sort(key=lambda x: (x[0], x[1].zero, x[1].v))
        self.considered = len(cands) + self.considered_infeasible
        return cands

    def _extra_candidates(self, meshes) -> list[tuple[float, Candidate]]:
        """The candidates beside the uniform meshes': stage_tp's pinned stages, else stages of
        different tp degrees (`_hetero_candidates`) where the provider allows them."""
        if self.cons.stage_tp is not None:
            return self._pinned_hetero()
        return self._hetero_candidates(meshes) if self._hetero_allowed() else []

    def _hetero_allowed(self) -> bool:
        """Whether stages of different tp degrees are searched: not with Megatron-SP pinned on
        (recorded in `skipped` where tp and pp are free)."""
        if not getattr(self.provider, "sequence_parallel", False):
            # stages of different tp hand the residual stream over replicated
            # (`stage_layouts.chunk_layouts`); Megatron-SP's would arrive split along its tokens
            return True
        if self.cons.tp is None and self.cons.pp is None:
            self.skipped["hetero"] = ("stages of different tp degrees are not searched with sequence_parallel: "
                                      "the residual stream would cross their boundaries split along its tokens "
                                      "over meshes of different sizes, a re-layout the runtime does not run")
        return False

    def _group_slots(self, dp: int, tp: int, pp: int, mb: int, sp: bool, cp: int = 1
                     ) -> list[tuple[int, int, int, bool, bool]]:
        """(ZeRO stage, ep, expert tp, runs op by op as solved, folded) of one (mesh, micro-batch,
        SP, cp) group's candidates, in enumeration order; each is tried with every schedule
        (`schedules`). ZeRO over the dp x cp ranks; cp layouts the runtime does not execute left
        out (`_executable`), and expert tensor parallelism and folding where it does not execute
        them unless pinned (`_etp_executable`, `_fold_executable`)."""
        out = []
        m = self.gbs // dp // mb
        edp = self.cons.expert_dp
        for z, ep in ((z, e) for e in self.experts.degrees(dp, self.cons.ep) for z in self.zeros(dp * cp, tp)):
            if edp is not None and ep > 1 and edp != dp * cp // ep:
                continue
            if not self._executable(cp, dp, tp, pp, ep):
                continue
            # the costs the candidate is evaluated with: the executor's where it runs op
            # by op as solved (a bound from the others could prune a faster plan)
            solved = op_by_op(Candidate(dp, tp, pp, mb, m, "1f1b", 1, z, cp=cp))
            if sp and not solved:
                continue                # only the executor runs sequence parallelism
            etps = self.experts.tp_degrees(tp, self.cons.expert_tp) if ep > 1 else [1]
            if ep == 1 and (self.cons.expert_tp or 1) > 1:
                continue
            for etp in etps:
                if etp > 1 and not self._etp_executable(dp, tp, pp, cp, z, solved):
                    continue
                out.append((z, ep, etp, solved, False))
        if cp > 1 or (self.cons.expert_tp or 1) > 1:
            return out
        for z, ep in ((z, e) for e in self.experts.fold_degrees(dp, tp, self.cons.ep) for z in self.zeros(dp, tp)):
            if edp is not None and edp != dp * tp // ep:
                continue
            solved = op_by_op(Candidate(dp, tp, pp, mb, m, "1f1b", 1, z))
            if sp and not solved:
                continue
            if not self._fold_executable(dp, tp, pp, z, ep, solved):
                continue
            out.append((z, ep, 1, solved, True))
        return out

    def _fold_executable(self, dp: int, tp: int, pp: int, zero: int, ep: int, solved: bool) -> bool:
        """False for a folded expert layout the runtime does not execute (`planner.fold_unexecuted`)
        unless folding is pinned (an ep not dividing dp, or expert_dp = dp x tp / ep), recorded in
        `skipped`; pinned, it is planned all the same (the plan says it is not executed)."""
        from autopar.planner import fold_unexecuted

        c = self.cons
        if c.expert_dp is not None or (c.ep is not None and dp % c.ep):
            return True
        why = fold_unexecuted(pp, 1, zero, solved and self._executor)
        if why:
            self.skipped[f"folded ep={ep} dp={dp} tp={tp} pp={pp} zero={zero}"] = (
                f"experts folded over dp x tp with {', '.join(why)} are not executed by the runtime (pin ep "
                f"and expert_dp to plan it)")
        return not why

    def _etp_executable(self, dp: int, tp: int, pp: int, cp: int, zero: int, solved: bool) -> bool:
        """False for expert tensor parallelism the runtime does not execute
        (`planner.etp_unexecuted`) when expert_tp is not pinned, recorded in `skipped`; pinned,
        it is planned all the same (the plan says it is not executed)."""
        from autopar.planner import etp_unexecuted

        if self.cons.expert_tp is not None:
            return True
        why = etp_unexecuted(pp, cp, zero, solved and self._executor)
        if why:
            self.skipped[f"expert_tp={tp} dp={dp} tp={tp} pp={pp} zero={zero}"] = (
                f"expert tensor parallelism with {', '.join(why)} is not executed by the runtime (pin expert_tp "
                f"to plan it)")
        return not why

    def _group_candidates(self, dp: int, tp: int, pp: int, mb: int, sp: bool, cp: int = 1
                          ) -> tuple[list[tuple[float, Candidate]], list[str]]:
        """One group's candidates with their lower bounds, its layers costed; or none and why
        tp cannot hold them. Those whose model states alone overflow are counted in
        `considered_infeasible` instead."""
        costs = self._layer_costs(mb, tp, sp=sp)
        iss = sorted({i for c in costs for i in c.issues})
        if iss:
            return [], iss
        cands: list[tuple[float, Candidate]] = []
        m = self.gbs // dp // mb
        reps = dp * cp          # the ranks syncing a stage's gradients (`Candidate.replicas`)
        # per (solved, ep, etp): [the ideal pipeline, the average stage's parameters, the bottleneck
        # split's slowest stage (a callable until a schedule needs it), expert elements, per
        # recomputation policy its extra time over the cheapest's]
        bounds: dict[tuple, list] = {}
        for z, ep, etp, solved, fold in self._group_slots(dp, tp, pp, mb, sp, cp):
            bk = (solved, ep, etp, fold)
            if bk not in bounds:
                cs = self._layer_costs(mb, tp, sp, ep, cp, etp=etp, fold=fold)
                per_layer = sum(c.base_s for c in cs)
                rc_sums = {r: sum(c.rc_extra_s.get(r, 0.0) for c in cs) for r in self.recomputes()}
                rc_min = min(rc_sums.values())
                # the average stage's parameters: each tensor once (a tied one is
                # in two layers' lists; a stage holding both counts it once)
                distinct = {f: e for c in cs for f, e in c.param_elems.items()}
                # the slowest stage of any split into pp stages, each layer at its
                # least time (its cheapest recomputation): at least this
                least = np.array([c.base_s + min(c.rc_extra_s.get(r, 0.0) for r in self.recomputes()) for c in cs])
                bounds[bk] = [m * (per_layer + rc_min) / pp, sum(distinct.values()) / pp,
                                        functools.partial(self._bottleneck, least, pp),
                                        float(self.experts.expert_elems(cs).sum()) / pp if ep > 1 else 0.0,
                                        {r: m * (rc - rc_min) / pp for r, rc in rc_sums.items()}]
            ideal, pel, slowest, epel, rc_more = bounds[bk]
            # memory lower bound: the model states of an average stage, no activations; under
            # ZeRO-3 with the gradients reduce-scattered every micro-batch where `_walk` may try
            # that (their fp32 shards, not the unsharded gradients: fp32 gradients, `SoftwareSpec.
            # grad_dtype`, made the unsharded ones overflow a bound the zoo's FSDP row fits)
            each = z == 3 and pp == 1 and m > 1 and self.cons.zero3_grad_sync != "step"
            states = max(ph.total for ph in runtime_phases(
                pel, self.policy, z, reps, num_microbatches=m, reduce_every_microbatch=each,
                fused_optimizer=fused_optimizer(self.cluster.device.device_type),
                zero_optimizer=self.software.zero_optimizer))
            if states > self.budget:
                self.min_memory = min(self.min_memory, states)
                self.considered_infeasible += len(self.schedules(pp, m))
                continue
            copies, stride = (dp * tp // ep, ep) if fold else (reps // ep, tp * ep)
            per_mb, tail = self._bound_terms(reps, tp, z, m, pel, epel, copies if ep > 1 else 1, stride, pp)
            for sched, v in self.schedules(pp, m):
                # lower bound: balanced stages, the schedule's bubble, the step's tail
                lb = (ideal + m * per_mb) * (1 + schedule_kind(sched).bubble_fraction(pp, m, v)) + tail
                if v == 1 and not schedule_kind(sched).interleaved:
                    # the stages' times (one micro-batch each) + (m - 1) x the slowest
                    # (`stage_dp`): the slowest is at least the average stage's (`mu`)
                    # and the bottleneck split's
                    mu = ideal / m + per_mb
                    if not isinstance(slowest, float):      # worked out when a schedule needs it
                        slowest = bounds[bk][2] = slowest()
                    lb = max(lb, pp * mu + (m - 1) * max(mu, slowest) + tail)
                cand = Candidate(dp, tp, pp, mb, m, sched, v, z, sp=sp, ep=ep, cp=cp, etp=etp, fold=fold)
                if schedule_kind(sched).interleaved and v > 1:
                    # one policy for every layer: the same bound with that policy's extra time
                    grow = 1 + schedule_kind(sched).bubble_fraction(pp, m, v)
                    cand.bounds = {r: lb + more * grow for r, more in rc_more.items()}
                cands.append((lb, cand))
        return cands, []

    def _bottleneck(self, least: np.ndarray, pp: int) -> float:
        """`_bottleneck` of the layers' least times, kept per search: groups of other dp degrees
        at one (micro-batch, tp) split the same layers."""
        key = (least.tobytes(), pp)
        hit = self._bottlenecks.get(key)
        if hit is None:
            hit = self._bottlenecks[key] = _bottleneck(least, pp)
        return hit

    def _bound_terms(self, dp: int, tp: int, zero: int, m: int, pel: float, epel: float = 0.0,
                     copies: int = 1, stride: int = 1, pp: int = 1) -> tuple[float, float]:
        """What every stage of `pel` parameter elements (the average stage's) adds to the layers'
        time at least, for a candidate's lower bound: (per micro-batch: ZeRO-3's two weight
        all-gathers without their latency (a stage may hold no parameter; `_Tables.zero_mb`;
        none where they run beside the compute, `SoftwareSpec.zero3_overlap`)
        and the gradient accumulation (`_Tables.accum`); the step's tail: the gradient sync no
        backward can hide and the optimizer step of one flat tensor). Each grows with a stage's
        parameters, so the average stage's is at most the slowest's (`_stage`, `_finish`).
        `epel`: of them, expert weights under expert parallelism, gathered and synced over the
        `copies` ranks holding the same experts, `stride` apart (`_Tables.set_experts`): their
        all-gathers priced there, their sync left out of the bound."""
        per_mb = 0.0
        w = PRECISION_POLICIES[self.policy][0]
        if zero == 3 and dp > 1 and not self.software.zero3_overlap:     # else it may hide entirely
            per_mb += _zero3_gathers(pp, m) * _dp_affine(self.cluster, "all_gather", dp, tp)[1] * (pel - epel) * w
            if copies > 1:
                per_mb += _zero3_gathers(pp, m) * _dp_affine(self.cluster, "all_gather", copies, stride)[1] * epel * w
        if m > 1 and not self.software.gradient_accumulation_fusion:
            # reduced every micro-batch, into the shards (`_Tables.accum`): at least that (fused
            # into the weight-gradient GEMMs, `SoftwareSpec.gradient_accumulation_fusion`, an
            # unsharded accumulation costs nothing: 0 bounds it)
            each = zero == 3 and dp > 1 and self.cons.zero3_grad_sync != "step"
            per_mb += _accum_time(_accumulated_elems(pel, dp, each, epel, copies), m, self.policy, self.cluster.device)
        cast = self.software.param_cast_bytes(self.dtype)   # fp32 parameters' casts, every micro-batch
        if cast:
            per_mb += memory_time(pel * cast, self.cluster.device)
        sync = _sync_time(self.cluster, self.policy, dp, tp, zero, pel - epel)
        if self.software.grad_sync_overlap:      # the part no backward can hide
            sync -= _grad_reduce_time(self.cluster, self.policy, dp, tp, zero, pel - epel)
        if self.software.param_sync_overlap:     # the weights' gather may hide behind the next forward
            sync -= _param_gather_time(self.cluster, self.policy, dp, tp, zero, pel - epel)
        opt = optimizer_step_time(float(_accumulated_elems(pel, dp, True, epel, copies)) if zero >= 1 else pel,
                                  self.cluster.device, self.policy, param_tensors=1)
        opt += unscale_time(pel, self.cluster.device, self.software.loss_scaling_bytes(self.dtype), dp, zero,
                            self.software.zero_optimizer)
        return per_mb, sync + opt

    def _sp_options(self, mb: int, tp: int) -> tuple[bool, ...]:
        """Whether to try (mb, tp) without and with Megatron-SP (`sp_provider`): with, where
        tp > 1 and its layers solved apart meet at their boundaries (`stage_layouts` over the
        whole model; else recorded in `sp_skipped` and not tried)."""
        if self.sp_provider is None or tp == 1:
            return (False,)
        key = (mb, tp)
        if key not in self.sp_skipped:
            from autopar.inter_op.stage_layouts import stage_layouts

            costs = self._layer_costs(mb, tp, sp=True)
            why = next(iter(sorted({i for c in costs for i in c.issues})), "")
            if not why:
                _, why = stage_layouts(self.graph, self.layers, self.sp_provider.solutions, 0, self.L, mb, tp)
            self.sp_skipped[key] = why
        return (False,) if self.sp_skipped[key] else (False, True)

    def _no_fit(self) -> PlanError:
        return PlanError(f"no plan fits in memory: the least memory any plan needs is "
                         f"{self.min_memory / 2**30:.2f} GiB per device, the device has "
                         f"{self.cluster.device.memory_bytes / 2**30:.2f} GiB "
                         f"({self.budget / 2**30:.2f} GiB usable); add devices, or allow "
                         f"recomputation, ZeRO or more pipeline stages"
                         f"{', or context parallelism (cp unset)' if self.cons.cp == 1 else ''}"
                         f"{_EACH_HINT if self.cons.zero3_grad_sync == 'step' else ''}",
                         min_memory_bytes=self.min_memory)

    def _hetero_candidates(self, meshes) -> list[tuple[float, Candidate]]:
        """Candidates for Alpa's DP with a free sub-mesh per stage (stages may differ in tp),
        on clusters small enough for its (stages x layers x devices) table: at most
        `HETERO_MAX_UNITS` dp-replica-sized device units. Not when tp or pp is pinned, nor for
        the interleaved schedule (whose chunks go round equal device sets)."""
        return [x for D, mb, tps in self._hetero_groups(meshes) for x in self._hetero_group_candidates(D, mb, tps)]

    def _hetero_groups(self, meshes) -> list[tuple[int, int, list[int]]]:
        """(dp, micro-batch, tp degrees a stage may take) of `_hetero_candidates`' groups."""
        c = self.cons
        if c.tp is not None or c.pp is not None or (c.schedule and schedule_kind(c.schedule).interleaved) \
                or (c.virtual_stages or 1) > 1:
            return []
        if self.L > HETERO_MAX_LAYERS:
            return []
        dpn, N = self.cluster.devices_per_node, self.N
        out = []
        for D in sorted({dp for dp, _, _ in meshes}):
            units = N // D
            if units > HETERO_MAX_UNITS or units < 2:
                continue
            tps = [T for T in (1, 2, 4, 8, 16, 32, 64) if T <= dpn and T <= units and
                   (dpn % (D * T) == 0 or (D * T) % dpn == 0)]
            if len(tps) < 2 or self.L ** 2 * units * len(tps) * min(self.L, units) > HETERO_MAX_TABLE:
                continue
            out.extend((D, mb, tps) for mb in self.microbatches(D))
        return out

    def _hetero_schedules(self) -> list[str]:
        return [self.cons.schedule] if self.cons.schedule else ["1f1b"]

    def _hetero_group_candidates(self, D: int, mb: int, tps: list[int]) -> list[tuple[float, Candidate]]:
        """One (dp, micro-batch) group of `_hetero_candidates`, its layers costed at every tp."""
        ok = [T for T in tps if not any(x.issues for x in self._layer_costs(mb, T))]
        if len(ok) < 2:
            return []
        m = self.gbs // D // mb
        # heuristic bound: the least device-seconds per micro-batch spread over all units
        work = min(sum(x.base_s for x in self._layer_costs(mb, T)) * T for T in ok)
        lb = m * work / (self.N // D)
        return [(lb, Candidate(D, 0, 0, mb, m, sched, 1, z, hetero_tps=tuple(ok)))
                for sched in self._hetero_schedules() for z in self.zeros(D, max(ok))]

    def _pinned_hetero(self) -> list[tuple[float, Candidate]]:
        """The candidates of `Constraints.stage_tp` (every micro-batch size, ZeRO stage), each
        evaluated by `_evaluate_hetero` with its stages' tp degrees in that order; PlanError
        when the pin cannot hold."""
        c, N, dpn = self.cons, self.N, self.cluster.devices_per_node
        pin = tuple(c.stage_tp or ())

        def fail(why: str) -> PlanError:
            return PlanError(f"stage_tp={pin}: {why}", constraint="stage_tp")

        if getattr(self.provider, "sequence_parallel", False):
            raise fail("stages of different tp degrees do not run with sequence_parallel (the residual stream "
                       "would cross their boundaries split along its tokens over meshes of different sizes)")
        if N % sum(pin):
            raise fail(f"{sum(pin)} devices per data-parallel replica do not divide the cluster's {N}")
        D = N // sum(pin)
        for name, want in (("dp", D), ("pp", len(pin))):
            if getattr(c, name) not in (None, want):
                raise fail(f"{name}={getattr(c, name)} contradicts it ({name} {want})")
        if c.tp is not None and set(pin) != {c.tp}:
            raise fail(f"tp={c.tp} contradicts it")
        if len(pin) > self.L:
            raise fail(f"{len(pin)} stages need at least as many layers; the model has {self.slots_text()}")
        if (c.schedule and schedule_kind(c.schedule).interleaved) or (c.virtual_stages or 1) > 1:
            raise fail("the interleaved schedule's chunks go round equal device sets")
        if self.gbs % D:
            raise fail(f"global batch {self.gbs} does not divide over dp={D} replicas")
        bad = [T for T in pin if not (dpn % (D * T) == 0 or (D * T) % dpn == 0)]
        if bad:
            raise fail(f"a stage of dp x tp = {D * bad[0]} devices is neither a power-of-two slice of a "
                       f"{dpn}-device node nor whole nodes")
        tps = sorted(set(pin))
        out, issues = [], []
        for mb in self.microbatches(D):
            iss = sorted({i for T in tps for x in self._layer_costs(mb, T) for i in x.issues})
            if iss:
                issues.extend(iss)
                continue
            for sched in ([c.schedule] if c.schedule else ["1f1b"]):
                for z in self.zeros(D, max(tps)):
                    out.append((0.0, Candidate(D, 0, 0, mb, self.gbs // D // mb, sched, 1, z, hetero_tps=tuple(tps))))
        if not out:
            raise fail(issues[0] if issues else self._why_no_candidates([(D, max(tps), len(pin))]))
        return out

    def _failing_constraint(self) -> str:
        c = self.cons
        if c.microbatch_size is not None or c.num_microbatches is not None:
            return "microbatch_size" if c.microbatch_size is not None else "num_microbatches"
        if c.schedule is not None or c.virtual_stages is not None:
            return "schedule" if c.schedule else "virtual_stages"
        return "global_batch_size"

    def slots_text(self) -> str:
        """The model's layers as pipeline chunks can hold them (error messages): how many,
        and whether the embedding and the loss take a slot of their own (`account_in_split`)."""
        own = [lay.name for lay in self.layers if not lay.block_nodes]
        if not self.graph.layers:
            return f"{self.L} layers"
        if own:
            return (f"{self.L} layer slots ({self.L - len(own)} repeated blocks, {' and '.join(own)} each in a "
                    f"slot of its own)")
        return (f"{self.L} layers (the embedding joined to the first block, the loss to the last; "
                f"Constraints(account_in_split=(\"embedding\", \"loss\")) gives each a slot of its own: up to "
                f"{self.L + 2})")

    def _why_no_candidates(self, meshes) -> str:
        c = self.cons
        parts = []
        for dp, tp, pp in meshes[:1]:
            local = self.gbs // dp
            if c.microbatch_size is not None and local % c.microbatch_size:
                return (f"micro-batch size {c.microbatch_size} does not divide the {local} samples per "
                        f"data-parallel replica (global batch {self.gbs} / dp {dp})")
            if c.num_microbatches is not None and local % c.num_microbatches:
                return (f"{c.num_microbatches} micro-batches do not divide the {local} samples per "
                        f"data-parallel replica (global batch {self.gbs} / dp {dp})")
            if (c.schedule and schedule_kind(c.schedule).interleaved) or (c.virtual_stages or 1) > 1:
                if c.virtual_stages and pp * c.virtual_stages > self.L:
                    return (f"pp x virtual_stages = {pp} x {c.virtual_stages} = {pp * c.virtual_stages} chunks need "
                            f"as many layers; the model has {self.slots_text()}")
                return (f"the interleaved schedule needs pp > 1, pp x virtual_stages <= {self.L} layers and "
                        f"the number of micro-batches divisible by pp (dp={dp}, tp={tp}, pp={pp})")
            parts.append(f"dp={dp} tp={tp} pp={pp}")
        return "no micro-batching or schedule satisfies the constraints for " + ", ".join(parts)

    # -- one candidate ---------------------------------------------------------------------------
    def evaluate(self, cand: Candidate, tb: _Tables, bar: float = INF) -> bool:
        """Cost `cand` with `tb` (its group's tables): whether a plan of it fits, its time and
        stages set on it. `bar`: the best plan's iteration so far; a recomputation policy whose
        bound (`Candidate.bounds`) is not below it is not tried (it could not replace that plan)."""
        if cand.hetero_tps:
            return self._evaluate_hetero(cand)
        if cand.tp > 1 and self.cons.tp is None and not self._layouts_agree(cand.mb, cand.tp, cand.sp):
            # no per-op layouts: `autopar run` would refuse the plan (a pinned tp still plans it,
            # priced by its layers' solutions, and the plan says why: `plan.search["tp_executor"]`)
            self.skipped[f"tp={cand.tp} mb={cand.mb}{' sp' if cand.sp else ''}"] = LAYOUTS_DISAGREE
            return False
        if schedule_kind(cand.schedule).interleaved and cand.v > 1:
            return self._evaluate_interleaved(cand, tb, bar)
        L, p, m = self.L, cand.pp, cand.m
        pel = tb.range_pel
        fixed = tb.fixed_memory(pel, tb.grads_m(m, p))
        t_base = tb.ranged(tb.base) + tb.accum(pel, m, tb.range_epel)
        beside = self._send_beside(cand.schedule, p, m)
        by_hops: dict[tuple[bool, bool], np.ndarray] = {}   # the stage's time by the links of its hops
        cost = np.full((L, L + 1, 1, p + 1), INF)
        choice = np.full((L, L + 1, p + 1), -1, dtype=int)
        rcs = self.recomputes()
        w = L - p + 1
        for s in range(1, p + 1):
            # the ranges the s-th stage from the end can take when every stage has a layer:
            # [k, j) with k >= p - s and j <= L - s + 1 (others stay INF: a w x w block, not
            # L x (L + 1); 64 stages of GPT 1T's 128 layers: a quarter)
            blk = (slice(p - s, p - s + w), slice(p - s + 1, p - s + 1 + w))
            hops = (tb.hop_inter(p - s, p), tb.hop_inter(p - s - 1, p))
            if hops not in by_hops:
                by_hops[hops] = t_base + tb.stage_p2p(beside, *hops)
            t_common = by_hops[hops]
            cost[blk + (0, s)], choice[blk + (s,)] = self._best_recompute(
                tb, rcs, t_common, fixed, self._held(cand.schedule, p, p - s, m), tb.grads_m(m, p), blk,
                _zero3_gathers(p, m))
        res = stage_dp(cost, [1], p, m, num_stages=p)
        if res is None:
            if not self._found:
                self._note_min_memory(cand, tb)
            return False
        stages = []
        for idx, (k, j, _) in enumerate(res.stages):
            s = p - idx
            r = rcs[choice[k, j, s]]
            stages.append(self._stage(tb, cand, [(k, j)], r, self._held(cand.schedule, p, idx, m),
                                      tb.position_p2p(beside, idx, p), rank=idx))
        self._finish(cand, tb, stages, res.total)
        cand.costs = tb
        return True

    def _best_recompute(self, tb: "_Tables", rcs: list[str], t_common: np.ndarray, fixed_mem: tuple,
                        held: tuple[np.ndarray, np.ndarray], m: int,
                        block: tuple[slice, slice] = (slice(None), slice(None)),
                        gathers: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
        """For every layer range [k, j) in `block` (rows k, columns j of the range tables): the
        fastest recomputation policy whose memory fits the budget, as (time, index into `rcs`);
        INF and -1 where none fits. `fixed_mem` is `_Tables.fixed_memory`'s triple, `held` what
        the stage holds before and after its first backward (`cost_models.schedules.
        held_moments`, one chunk): micro-batches in flight, and outputs and input gradients its
        sends still reference. The exposed ZeRO-3 collectives of each policy (`range_zero_mb`,
        `gathers` a unit's all-gathers per micro-batch) are added to `t_common` here: its
        recomputed forward covers them too."""
        valid, t_common = tb.valid[block], t_common[block]
        best_t = np.full(valid.shape, INF)
        best_c = np.full(valid.shape, -1, dtype=int)
        for ri, r in enumerate(rcs):
            if r not in tb.priced:
                continue
            mem = self._recompute_memory(tb, r, fixed_mem, held, m, block)
            t = t_common + tb.ranged(tb.rc[r])[block] + tb.range_zero_mb(gathers, r)[block]
            ok = valid & (mem <= self.budget) & (t < best_t)
            best_t = np.where(ok, t, best_t)
            best_c = np.where(ok, ri, best_c)
        return best_t, best_c

    @staticmethod
    def _recompute_memory(tb: "_Tables", r: str, fixed_mem: tuple, held: tuple[np.ndarray, np.ndarray], m: int,
                          block: tuple[slice, slice] = (slice(None), slice(None))) -> np.ndarray:
        """The peak memory of every one-chunk stage [k, j) in `block` under recomputation `r`
        (`_best_recompute`'s arguments): the phases' largest, with the forward/backward
        phase at its worst moment as `_stage` takes it for the same choice (the most
        activations before the first backward, the first backward's worst moment with the
        gradients alive then, each moment after it)."""
        def cut(x: Any) -> Any:
            return x[block] if np.ndim(x) == 2 else x

        fb, grads, rest = (cut(x) for x in fixed_mem)
        pre, post = held
        r_in, r_out = tb.range_in[block], tb.range_out[block]
        send, send_grad = tb.range_send[block], tb.range_send_grad[block]
        act, work, first = (x[block] for x in tb.recompute_terms(r, m))
        # before the first backward: the most activations and receive buffers of any
        # moment (all grow until the first backward; its start is the last such moment)
        a_pre = -INF
        for mo in pre:
            a_pre = np.maximum(a_pre, act * mo[ACTS, 0] + tb.recv_buffers(mo, r_in, r_out))
        # the first backward's moment in place of the phase's gradients (`recompute_terms`)
        mem = np.maximum(fb - grads + a_pre + first, np.maximum(fb, rest))
        for mo in post:
            mem = np.maximum(mem, fb + act * mo[ACTS, 0] + send * mo[SENT_OUTPUTS, 0]
                             + send_grad * mo[SENT_GRADS, 0] + tb.recv_buffers(mo, r_in, r_out) + work)
        return mem

    def _evaluate_hetero(self, cand: Candidate) -> bool:
        """Alpa's DP with its sub-mesh choice: every stage picks its own sub-mesh of dp x T
        devices (T a power of two; a slice of a node or whole nodes), the sub-meshes covering
        the cluster exactly, and its recomputation; one common dp (see the module docstring)."""
        L, m, D = self.L, cand.m, cand.dp
        units = self.N // D
        S = min(L, units)
        pin = self.cons.stage_tp      # the s-th stage from the end on a mesh of tp pin[-s]
        tps = list(cand.hetero_tps)
        tbs = [self._tables(cand.mb, T, D, cand.zero) for T in tps]
        rcs = self.recomputes()
        cost = np.full((L, L + 1, len(tps), S + 1), INF)
        choice = np.full((L, L + 1, len(tps), S + 1), -1, dtype=int)
        for mi, tb in enumerate(tbs):
            pel = tb.range_pel
            fixed = tb.fixed_memory(pel, m)
            t_base = tb.ranged(tb.base) + tb.accum(pel, m, tb.range_epel)
            for s_ in range(1, S + 1):
                if pin is not None and (s_ > len(pin) or pin[len(pin) - s_] != tps[mi]):
                    continue
                # 1F1B on the stage with s_ - 1 stages after it; the depth is not known yet:
                # where the runtime runs GPipe instead (fewer micro-batches than stages) the
                # stages are checked below
                kind = "gpipe" if cand.schedule == "gpipe" or m < s_ else "1f1b"
                # the stages' sizes differ and are not placed in pipeline order: every hop on the
                # whole-node rule's link (`_Tables.p2p`)
                hop = tb.whole_node_hops
                t_common = t_base + tb.stage_p2p(self._send_beside(kind, s_, m), hop, hop)
                cost[:, :, mi, s_], choice[:, :, mi, s_] = self._best_recompute(
                    tb, rcs, t_common, fixed, self._held(kind, s_, 0, m), m)
        # candidates of other ZeRO stages often give the same table: the DP once per table
        key = (hashlib.blake2b(cost.tobytes(), digest_size=16).digest(), cost.shape, tuple(tps), units, m,
               len(pin) if pin is not None else None)
        if key not in self._dp_cache:
            self._dp_cache[key] = stage_dp(cost, tps, units, m, num_stages=key[-1])
        res = self._dp_cache[key]
        if res is None:
            return False
        stages = []
        p = len(res.stages)
        for idx, (k, j, mi) in enumerate(res.stages):
            s_ = p - idx
            tb = tbs[mi]
            r = rcs[choice[k, j, mi, s_]]
            hop = tb.whole_node_hops
            stages.append(self._stage(tb, cand, [(k, j)], r, self._held(cand.schedule, p, idx, m),
                                      tb.stage_p2p(self._send_beside(cand.schedule, p, m), hop, hop), rank=idx))
        if any(st.peak_bytes > self.budget for st in stages):
            self.min_memory = min(self.min_memory, max(st.peak_bytes for st in stages))
            return False
        why = self._hetero_layouts(cand, stages)
        if why:
            self.skipped[f"hetero dp={D} mb={cand.mb} tp={tuple(st.tp for st in stages)}"] = why
            return False
        self._fanout_sends(stages)
        self._entry_prices(cand, stages)
        ts = [st.t_mb for st in stages]
        cand.pp, cand.tp = p, stages[0].tp
        self._finish(cand, tbs[0], stages, sum(ts) + (m - 1) * max(ts))
        cand.costs = tbs[0]
        return True

    @property
    def _executor(self) -> bool:
        """Whether the provider solves the per-op layouts the plan's tp stages run (the intra-op
        ILP); the analytic rules' plans are solved at assembly, their placements pinned
        (`inter_op.pinned_layouts`)."""
        return getattr(self.provider, "solutions", None) is not None

    def _hetero_layouts(self, cand: Candidate, stages: list[StageResult]) -> str:
        """Why the executor cannot run stages of different tp `stages` (a tensor crossing
        between two of them that a reader's solution wants sharded: `chunk_layouts`), or ""."""
        if not self._executor or all(st.tp == 1 for st in stages):
            return ""
        from autopar.inter_op.stage_layouts import chunk_layouts

        spans = [(k, j, st.tp, st.recompute) for st in stages for k, j in st.chunks]
        self.provider.solve_replicated(cand.mb, [self.layers[i] for k, j, tp, _ in spans if tp == 1
                                                 for i in range(k, j)])
        _, why = chunk_layouts(self.graph, self.layers, self.provider.solutions, spans, cand.mb,
                               self.provider.entry_solutions(spans, cand.mb))
        return why

    def _entry_prices(self, cand: Candidate, stages: list[StageResult]) -> None:
        """Price the first layer of a chunk after one of another tp degree as it runs: tensors
        cross between tp degrees replicated, so that layer runs its entry solution
        (`IlpProvider.entry_solutions`, which `_hetero_layouts` solved and the plan carries),
        not the solution the DP's tables priced it by (its inputs arriving as the layer before
        on its own tp degree leaves them). Its forward and backward times replace the others'
        (the forward twice under full recomputation); like `_fanout_sends`, applied to the
        stages the DP picked."""
        if not self._executor or all(st.tp == 1 for st in stages):
            return
        spans = [(k, j, st.tp, st.recompute) for st in stages for k, j in st.chunks]
        entries = self.provider.entry_solutions(spans, cand.mb)
        if not entries:
            return

        def comm(sol: Any) -> float:
            return sum(x.time_s for x in sol.collectives if x.phase in ("forward", "backward"))

        for st in stages:
            for k, _ in st.chunks:
                if k not in entries:
                    continue
                entry, layer = entries[k]
                ordinary = self.provider.solutions[(layer.signature, cand.mb, st.tp)][0]
                again = 1.0 if st.recompute == "full" else 0.0
                d_fwd = entry.forward_s - ordinary.forward_s
                d_bwd = entry.backward_s - ordinary.backward_s
                d_comm = comm(entry) - comm(ordinary)
                st.t_mb += d_fwd * (1.0 + again) + d_bwd
                st.comm_mb += d_comm
                st.compute_mb += d_fwd * (1.0 + again) + d_bwd - d_comm

    def _fanout_sends(self, stages: list[StageResult]) -> None:
        """Add the copies a stage sends beyond the one the DP charges when its neighbour has more
        tp ranks (the runtime's fan-out, `runtime.pipeline_p2p`: rank k of a stage receives
        from rank k mod T of a T-rank neighbour, so each of those T ranks sends T'/T copies):
        forward activations to the next stage, input gradients to the previous one. Alpa's DP
        sees one stage at a time, so this is applied to the stages it picked."""
        for i, st in enumerate(stages):
            tb = st.tables
            k, j = st.chunks[0][0], st.chunks[-1][1]
            extra = 0.0
            if i + 1 < len(stages) and stages[i + 1].tp > st.tp:
                extra += (stages[i + 1].tp // st.tp - 1) * float(tb.p2p[j - 1])
            if i > 0 and stages[i - 1].tp > st.tp:
                extra += (stages[i - 1].tp // st.tp - 1) * float(tb.p2p_on[tb.whole_node_hops][1][k - 1])
            st.t_mb += extra
            st.comm_mb += extra

    def _send_beside(self, schedule: str, p: int, m: int, v: int = 1) -> Optional[str]:
        """Which compute the pipeline sends of a `schedule` plan with `p` stages, `m` micro-batches
        and `v` chunks per group run beside (`ScheduleKind.sends_beside`), or None where the
        software waits them before the next op (`SoftwareSpec.pipeline_send_overlap`, of the
        schedule the runtime executes: `executed_schedule`)."""
        if p <= 1:
            return None
        kind = executed_schedule(schedule, p, m, v)
        return kind.sends_beside if self.software.sends_overlap(kind.name) else None

    def _held(self, kind: str, p: int, rank: int, m: int, v: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """`cost_models.schedules.held_moments`, kept per search: candidates of one schedule, depth
        and micro-batch count ask for the same ranks' moments again (read-only arrays)."""
        key = (kind, p, rank, m, v)
        if key not in self._held_cache:
            self._held_cache[key] = held_moments(kind, p, rank, m, v)
        return self._held_cache[key]

    @property
    def rooted_modules(self) -> frozenset:
        """`rooted_modules` of the searched model, computed once (ZeRO-3 tables only)."""
        if self._rooted is None:
            self._rooted = rooted_modules(self.graph, self.layers)
        return self._rooted

    @property
    def rooted_tied_modules(self) -> frozenset:
        """`rooted_modules(tied_only=True)`, computed once: a pipeline chunk's root's."""
        if self._rooted_tied is None:
            self._rooted_tied = rooted_modules(self.graph, self.layers, tied_only=True)
        return self._rooted_tied

    def _tables(self, mb: int, tp: int, dp: int, zero: int, sp: bool = False,
                ep: int = 1, cp: int = 1, etp: int = 1, fold: bool = False, rs_each: bool = False) -> "_Tables":
        """`sp`: with Megatron-SP; `ep`: the routed experts over ep dp ranks
        (`inter_op.experts`); `cp`: each sequence over cp ranks (the tables' gradient-sync
        group, and ZeRO's, is dp x cp); `rs_each`: ZeRO-3 reduce-scatters the gradients in every
        micro-batch's backward (`_Tables.rs_each`)."""
        key = (mb, tp, dp, zero, sp, ep, cp, etp, fold, rs_each)
        if key not in self._tables_cache:
            costs = self._layer_costs(mb, tp, sp, ep, cp, etp, fold)
            share = self.gbs / dp / cp
            batch = (self.input_bytes[0] * share, sum(self.input_bytes[1:]) * share)
            # the last pipeline chunk computes the loss inside (`runtime.graph_stages`, the
            # executor): its output is the loss, no loss input is kept for the schedule
            like = next((t for t in self._tables_cache.values() if t.costs is costs), None)
            tb = _Tables(costs, self.cluster, self.dtype, dp * cp, tp, zero, self.layers, batch, like=like,
                         rooted=self.rooted_modules, rooted_tied=self.rooted_tied_modules, policy=self.policy,
                         cast_bytes=self.software.param_cast_bytes(self.dtype),
                         cast_saved=self.software.param_cast_saved_bytes(self.dtype),
                         zero_optimizer=self.software.zero_optimizer,
                         unscale_bytes=self.software.loss_scaling_bytes(self.dtype),
                         # with Megatron-SP the residual stream already crosses split over tp
                         send_split=self.software.pipeline_send_split and not sp)
            tb.rs_each = rs_each and tb.zero3
            tb.zero3_overlap = self.software.zero3_overlap
            tb.accum_fused = self.software.gradient_accumulation_fusion
            tb.reduce_fp32 = self.software.grad_dtype == "fp32_reduce" and tb.zero3
            if ep > 1:
                blocks = np.array([len(self.experts.by_layer.get(i, ())) for i in range(self.L)], dtype=float)
                if fold:
                    tb.set_experts(ep, self.experts.expert_elems(costs), copies=dp * tp // ep, stride=ep, blocks=blocks,
                                   largest=self.experts.expert_largest(costs))
                else:
                    tb.set_experts(ep, self.experts.expert_elems(costs), blocks=blocks,
                                   largest=self.experts.expert_largest(costs))
                tb.comm_buffers = self.experts.comm_buffer_bytes(ep, etp, self.dtype)
            tb.zero3_links_apart = tb.zero3 and tb.zero3_overlap and _zero3_links_apart(
                self.cluster.devices_per_node, tp, dp, cp, ep, fold, tb.ecopies if ep > 1 else 1,
                tb.estride if ep > 1 else 1)
            self._tables_cache[key] = tb
        return self._tables_cache[key]

    def _cp_cost(self, c: LayerCost, lay: Layer, mb: int, tp: int, cp: int) -> LayerCost:
        """`c` on one of cp ranks (`context_parallel.layer_cost`, with the layer's K/V bytes, its
        causal calls' copies, its token-mean losses and the K/V its query's storage keeps)."""
        g, dt = self.graph, self.dtype
        return context_parallel.layer_cost(c, cp, context_parallel.kv_bytes(g, lay, mb, dt), tp, self.cluster,
                                           context_parallel.causal_bytes(g, lay, mb, dt),
                                           context_parallel.token_mean_losses(g, lay),
                                           kept=context_parallel.kept_kv_bytes(g, lay, mb, dt))

    def _layer_costs(self, mb: int, tp: int, sp: bool = False, ep: int = 1, cp: int = 1, etp: int = 1,
                     fold: bool = False) -> list[LayerCost]:
        """The layers' costs at (mb, tp), as the runtime runs them (a tp layer op by op as its
        solution says, the provider's `cost`); `sp`: with Megatron-SP (`sp_provider`); `ep`:
        the routed experts sharded over ep dp ranks (`ExpertCosting.layer_costs`); `cp`: on one
        of cp ranks splitting each sequence (`context_parallel.layer_cost`)."""
        if cp > 1:
            key = (mb, tp, sp, ep, cp, etp, fold)
            if key not in self._costs_cache:
                self._costs_cache[key] = [self._cp_cost(c, lay, mb, tp, cp) for c, lay in
                                          zip(self._layer_costs(mb, tp, sp, ep, etp=etp, fold=fold), self.layers)]
            return self._costs_cache[key]
        if ep > 1:
            key = ((mb, tp, sp, ep) if etp == 1 and not fold else (mb, tp, sp, ep, etp, fold))
            if key not in self._costs_cache:
                self._costs_cache[key] = self.experts.layer_costs(self._layer_costs(mb, tp, sp), ep, mb, tp,
                                                                  self.cluster, self.dtype, etp, fold)
            return self._costs_cache[key]
        key = (mb, tp, sp)
        if key not in self._costs_cache:
            prov = self.sp_provider if sp else self.provider
            self._costs_cache[key] = [prov.cost(l, mb, tp) for l in self.layers]
        return self._costs_cache[key]

    def _evaluate_interleaved(self, cand: Candidate, tb: _Tables, bar: float = INF) -> bool:
        p, v, m = cand.pp, cand.v, cand.m
        beside = self._send_beside(cand.schedule, p, m, v)
        nch = p * v
        best_ok = False
        # the policies by the forward they re-run over the whole model, the cheapest first
        # (stable: the registry's order where equal)
        for r in sorted(self.recomputes(), key=lambda r: float(tb.rc[r][-1])):
            if r not in tb.priced:
                continue
            if cand.bounds.get(r, 0.0) >= bar:
                # under this policy it cannot beat the best plan: a fit would not be taken (`_walk`)
                continue
            # the chunks are cut before they are placed: every boundary on the slowest link a
            # hop of this pipeline crosses
            hop = any(tb.hop_inter(d, p) for d in range(p))
            ck = (cand.mb, cand.tp, cand.dp, nch, r, cand.zero == 3, cand.ep, cand.cp, cand.etp, cand.fold, hop, beside)
            res = self._chunk_cache.get(ck)
            if ck not in self._chunk_cache:
                t = (tb.ranged(tb.base) + tb.stage_p2p(beside, hop, hop) + tb.ranged(tb.rc[r])
                     + tb.range_zero_mb(_zero3_gathers(p, m), r)
                     + tb.accum(tb.range_pel, m, tb.range_epel))
                res = self._chunk_cache[ck] = balanced_chunks(np.where(tb.valid, t, INF), nch)
            if res is None:
                continue
            groups = [[res[c] for c in range(d, nch, p)] for d in range(p)]
            stages = []
            fits = True
            for d, g in enumerate(groups):
                st = self._stage(tb, cand, list(g), r, self._held(cand.schedule, p, d, m, v),
                                 tb.position_p2p(beside, d, p))
                stages.append(st)
                if st.peak_bytes > self.budget:
                    # infeasible: the rest of the groups matter only for the least memory a plan
                    # needs (the largest group's peak), and only if this one is under it so far
                    fits = False
                    if st.peak_bytes < self.min_memory and not self._found:
                        peak = max([st.peak_bytes] + [
                            self._stage(tb, cand, list(g2), r, self._held(cand.schedule, p, d2, m, v)).peak_bytes
                            for d2, g2 in enumerate(groups) if d2 > d])
                        self.min_memory = min(self.min_memory, peak)
                    break
            if not fits:
                continue
            pipeline = interleaved_time([s.t_mb for s in stages], m, v)
            # cp too: its stages are dp x cp x tp devices (`Candidate.replicas`), placed by `_finish`
            trial = Candidate(**{k: getattr(cand, k) for k in ("dp", "tp", "pp", "mb", "m", "schedule", "v", "zero",
                                                               "sp", "ep", "cp", "etp", "fold")})
            self._finish(trial, tb, stages, pipeline)
            if not best_ok or trial.iteration_s < cand.iteration_s:
                cand.iteration_s, cand.pipeline_s, cand.tail_s, cand.stages = (
                    trial.iteration_s, trial.pipeline_s, trial.tail_s, trial.stages)
                best_ok = True
            # recomputation only adds time, so once a policy fits, the ones after it (re-running
            # more forward) are slower
            break
        cand.costs = tb
        return best_ok

    def _stage(self, tb: _Tables, cand: Candidate, chunks: list[tuple[int, int]], r: str,
               held: tuple[np.ndarray, np.ndarray], p2p: Optional[np.ndarray] = None,
               rank: Optional[int] = None) -> StageResult:
        """One device group's stage: its `chunks` (layer ranges, in local chunk order), its
        recomputation `r`, `held` the schedule's chunk micro-batches in flight before and after
        the group's first backward (`cost_models.schedules.held_moments`: chunk micro-batches in
        flight, and outputs and input gradients its sends still reference). Its memory is the
        largest of the runtime's phases (`cost_models.memory.runtime_phases`), the forward/
        backward phase at its worst moment: the most activations before any gradient exists,
        the most after, or every gradient once the activations are gone."""
        pel = 0.0
        p2p = tb.range_p2p if p2p is None else p2p
        chunk_p2p: list[float] = []     # each chunk's exposed pipeline transfers (`StageResult.chunk_p2p`)
        batch = sum(float(tb.range_batch[k, j]) for k, j in chunks)
        root = max(float(tb.range_root[k, j]) for k, j in chunks)
        unit = max(float(tb.range_unit[k, j]) for k, j in chunks) if tb.zero3 else 0.0
        largest = max(max(float(tb.range_maxtensor[k, j]), float(tb.range_expert_temps[k, j])) for k, j in chunks)
        if cand.pp > 1 and op_by_op(cand) and not tb.zero3:
            # pipeline chunks run op by op step their parameters in their holder's order (the
            # search's bound, `range_maxtensor`, takes the model's: a few tensors' difference)
            largest = tb.chunk_temporaries(chunks)
        t = comp = 0.0
        chunk_act, chunk_pel = [], []
        # per chunk, the receive buffer of its input and of its output's gradient (one
        # micro-batch; how many are alive: `held`, `recv_buffers`)
        ins = np.array([float(tb.range_in[c]) for c in chunks])
        outs = np.array([float(tb.range_out[c]) for c in chunks])
        for k, j in chunks:
            pel += float(tb.range_pel[k, j])
            chunk_pel.append(float(tb.range_pel[k, j]))
            t += float(tb.base[j] - tb.base[k] + tb.rc[r][j] - tb.rc[r][k] + p2p[k, j])
            chunk_p2p.append(float(p2p[k, j]))
            comp += float(tb.compute[j] - tb.compute[k])
            comp += sum(c.rc_extra_s.get(r, 0.0) - c.rc_comm_s.get(r, 0.0) for c in tb.costs[k:j])
            kept_out = float(tb.range_out_kept[r][k, j])
            chunk_act.append(float(tb.boundary_acts(float(tb.range_act[r][k, j]), float(tb.range_in_saved[r][k, j]),
                                                    kept_out)))
        # a parameter tied across chunks of one stage is held once
        epel = sum(float(tb.range_epel[k, j]) for k, j in chunks)
        units = sum(float(tb.layer_units[j] - tb.layer_units[k]) for k, j in chunks)
        eunits = sum(float(tb.range_eunits[k, j]) for k, j in chunks)
        window = sum(float(tb.compute[j] - tb.compute[k]) for k, j in chunks)
        # the recomputed forward covers them too (`exposed_zero`), and the layers' own
        # collectives where their links are apart (`_Tables.zero3_links_apart`)
        window += sum(float(tb.rc_compute[r][j] - tb.rc_compute[r][k]) for k, j in chunks)
        if tb.zero3_links_apart:
            window += sum(float(tb.layer_comm[r][j] - tb.layer_comm[r][k]) for k, j in chunks)
        t += float(tb.exposed_zero(tb.zero_mb(pel, epel, units, eunits, _zero3_gathers(cand.pp, cand.m)), window))
        acc = float(tb.accum(pel, cand.m, epel))
        t += acc
        comp += acc
        spel = float(self._scalar_count(chunks)) if tb.zero3 else 0.0
        m_acc = tb.grads_m(cand.m, cand.pp)
        phases = [dataclasses.replace(ph, buffers=ph.buffers + batch)
                  for ph in tb.phases(pel, m_acc, root, unit, largest, epel, spel)]
        fb = phases[0]
        # ZeRO-3 holds fewer units at a micro-batch's worst moment than the bound (`relief`; one
        # chunk: with several, each chunk's FSDP root keeps its own parameters)
        relief = float(tb.relief(r)[chunks[0]]) if len(chunks) == 1 else 0.0
        acts = np.array(chunk_act)
        # before the first backward: the most activations the schedule holds at once, chunk by
        # chunk, and the backward's transient (no gradient exists yet but those it makes)
        rc_work, grad_tmp = _transient(tb, chunks, r)
        pre_recv = tb.recv_buffers(held[0], ins, outs)
        pre_acts = held[0][:, ACTS, :] @ acts
        i_pre = int(np.argmax(pre_acts + pre_recv))
        pre, recv = float(pre_acts[i_pre]), float(pre_recv[i_pre])
        # the first backward's worst moment (one chunk's at a time), by parts: the parameter
        # gradients its ops made so far alive (ZeRO-3 with one micro-batch: each unit's are
        # reduce-scattered into the gradient shards as it ends, `fb.gradients`, in proportion)
        # reduced every micro-batch (`rs_each`), a later one's moment: every shard alive
        shards = tb.zero3 and (m_acc == 1 or tb.rs_each)
        f_w, f_at, f_parts = tb.first_backward(r, not shards)
        k, j = max(chunks, key=lambda c: float(f_w[c]))
        a_rc, a_g, a_p, a_w = (float(x) for x in f_parts[k, j])
        if tb.zero3 and cand.pp > 1 and len(chunks) == 1 and int(f_at[k, j]) >= 0:
            # a pipeline stage's first backward keeps each unit gathered after its backward
            # (`kept_after`): the later layers' at the moment (wide nanoGPT pp2 x dp2 ZeRO-3, one
            # micro-batch, stage 0: the three blocks' at wte's backward, 149 KiB)
            a_w += tb.wgo[0] * tb.kept_after(int(f_at[k, j]), j)
        # (reduced every micro-batch, `rs_each`: a later micro-batch's moments, every shard
        # alive, are the "each" variant's below; the first's holds the later layers' shards
        # alone, `first_backward`: counted with all of them, moe-tiny dp4 x ep2 was +2.8%)
        phases.append(dataclasses.replace(fb, gradients=a_p, weights=fb.weights + a_w,
                                          activations=pre + a_rc, buffers=fb.buffers + a_g + recv))
        if tb.zero3:
            # the forward's end: two units gathered, the last layer's activations still to save
            # (the received inputs alive, not yet the first backward's output gradient)
            last = max(float(tb.range_last_act(r)[c]) for c in chunks)
            phases.append(dataclasses.replace(fb, gradients=0.0, activations=max(pre - last, 0.0),
                                              buffers=fb.buffers + float(held[0][i_pre, RECV_INPUTS] @ ins)))
        if held[1].size:
            # each moment after it: activations and the outputs sends keep (made in the forward),
            # the input gradients they keep (made in the backward: buffers), the gradients of
            # the chunks that ran a backward
            sends = np.array([float(tb.range_send[c]) for c in chunks])
            grads_sent = np.array([float(tb.range_send_grad[c]) for c in chunks])
            share = np.array(chunk_pel) / pel if pel > 0 else np.zeros(len(chunks))
            post = held[1]
            grads = fb.gradients * (post[:, GRADS, :] @ share)
            # the backward's transient, its gradients' change and the weights: the range's
            # bound less the relief (`_transient`, `relief`), or, ZeRO-3 accumulating over
            # micro-batches, moment by moment with the units each op holds, prefetches and has
            # reduce-scattered (`first_backward`'s `accumulated`: a micro-batch's before the
            # last, and the last's): the bound took no op's units, and chose the loss's moment
            # (one unit held) over an MLP's matmul (its unit, the next prefetched, the one before's
            # reduce-scatter input), which the run holds at its peak
            variants = [(rc_work, grad_tmp, 0.0, -relief)]
            if tb.zero3 and m_acc > 1 and not tb.rs_each and cand.pp > 1:
                # a pipeline stage: torch.pipelining runs every micro-batch's backward without
                # FSDP's gradient sync (`backward_maybe_with_nosync`: `set_requires_gradient_sync
                # (False)`) and reduce-scatters them all after the last (`perform_reduce_grad`):
                # each backward's moments are a "mid" micro-batch's, every gradient accumulated
                # whole, no reduce-scatter input; one chunk's backward at a time, each with its
                # own units (the phase's are the stage's largest: `unit`)
                w0 = tb.wgo[0]
                variants = []
                for c in chunks:
                    v_rc, v_tmp, v_grads, v_w = (float(x) for x in tb.first_backward(r, False, accumulated="mid")[2][c])
                    d = w0 * (float(tb.range_unit[c]) - unit)
                    variants.append((v_rc, v_tmp + d, v_grads, v_w + d))
                if len(chunks) == 1 and rank is not None and backwards_in_a_row(cand.schedule, cand.pp, rank, cand.m):
                    # a backward right after another (`set_reshard_after_backward(False)`): every
                    # unit of the chunk gathered already, nothing prefetched, no all-gather
                    # output (nanoGPT pp2 x dp2 x tp2 GPipe stage 0: the second backward holds
                    # both blocks', wte's and wpe's parameters)
                    v_rc, v_tmp, v_grads, v_w = (float(x) for x in
                                                 tb.first_backward(r, False, accumulated="kept")[2][chunks[0]])
                    variants.append((v_rc, v_tmp, v_grads, v_w + w0 * float(tb.range_units_sum[chunks[0]])))
            elif tb.zero3 and cand.m > 1 and not tb.rs_each and len(chunks) == 1:
                kinds = ("mid", "last") if cand.m > 2 else ("last",)
                variants = [tuple(float(x) for x in tb.first_backward(r, False, accumulated=a)[2][chunks[0]])
                            for a in kinds]
            elif tb.rs_each and cand.m > 1 and len(chunks) == 1:
                # reduce-scattering every micro-batch's gradients (`rs_each`): a later
                # micro-batch's backward is the first's, moment by moment with each op's units
                # (each unit's gradients reduce-scattered as its backward ends, added into the
                # fp32 shards `grads` holds): the bound (every unit gathered and one prefetched
                # beside the loss's gradients) is a moment no op holds (moe-tiny dp4 x ep2: +9.5%)
                variants = [tuple(float(x) for x in tb.first_backward(r, False, accumulated="each")[2][chunks[0]])]
            best = None
            for v_rc, v_tmp, v_grads, v_w in variants:
                act = post[:, ACTS, :] @ acts + post[:, SENT_OUTPUTS, :] @ sends + v_rc
                buf = (fb.buffers + v_tmp + post[:, SENT_GRADS, :] @ grads_sent
                       + tb.recv_buffers(post, ins, outs))
                gr = grads + v_grads * (post[:, GRADS, :] @ share)
                w = fb.weights + v_w
                tot = w + gr + fb.optimizer + buf + act
                # the worst moment only (the first of equal ones), as a phase
                i = int(np.argmax(tot))
                if best is None or float(tot[i]) > best[0]:
                    best = (float(tot[i]), w, float(gr[i]), float(act[i]), float(buf[i]))
            _, w, gr_i, act_i, buf_i = best
            phases.append(dataclasses.replace(fb, weights=w, gradients=gr_i, activations=act_i, buffers=buf_i))
        top = max(phases, key=lambda ph: ph.total)
        sync = tb.sync(pel, epel)
        if self.software.grad_sync_overlap:
            # the last micro-batch's backward (with its recomputation), which an overlapped
            # gradient reduction runs beside
            window = sum(c.bwd_s + c.bwd_comm_s + c.rc_extra_s.get(r, 0.0) for k, j in chunks for c in tb.costs[k:j])
            sync = _exposed_sync(sync, tb.grad_reduce(pel, epel), window)
        if self.software.param_sync_overlap:
            gather = tb.param_gather(pel, epel)
            sync = sync - gather + _exposed_param_gather(
                gather, [float(x) / pel if pel > 0 else 0.0 for x in chunk_pel],
                [sum(c.fwd_s + c.fwd_comm_s for c in tb.costs[k:j]) for k, j in chunks], min(cand.pp, cand.m))
        sync += sum(float(tb.iter[j] - tb.iter[k]) for k, j in chunks)
        sync += self._scalar_sync(tb, chunks)
        opt = tb.opt(pel, tb.param_tensors(chunks), epel)
        return StageResult(chunks, r, t, comp, max(0.0, t - comp), sync, opt, pel,
                           float(top.weights), float(top.gradients), float(top.optimizer), float(top.activations),
                           float(top.buffers), top.phase, float(top.total), tp=tb.tp, tables=tb,
                           phases=phases, chunk_p2p=chunk_p2p)

    def _finish(self, cand: Candidate, tb: _Tables, stages: list[StageResult], pipeline_s: float) -> None:
        if not all(st.devices for st in stages):
            placed = pack_stages([cand.replicas * st.tp for st in stages], self.N, self.cluster.devices_per_node)
            for st, devs in zip(stages, placed):
                st.devices = devs
        tail = max(s.sync_s + s.opt_s for s in stages)
        tail += self._tied_sync(cand, tb, stages)
        cand.stages = stages
        cand.pipeline_s = pipeline_s
        cand.tail_s = tail
        cand.iteration_s = pipeline_s + tail

    def _scalar_count(self, chunks: list[tuple[int, int]]) -> int:
        """How many 0-D parameters the layers of `chunks` read (`_layer_scalars`)."""
        if not self._any_scalar:
            return 0                # most models: no walk over the layers per candidate
        return len({f for k, j in chunks for i in range(k, j) for f in self._scalars[i]})

    def _scalar_sync(self, tb: _Tables, chunks: list[tuple[int, int]]) -> float:
        """ZeRO-3's sync of the stage's 0-D parameters, which FSDP cannot shard: replicated over
        dp, their gradients averaged in one flat all-reduce per step (`runtime.zero`; counted by
        `planner.assemble`), with its copies in and out (`_pack_time`)."""
        if not tb.zero3:
            return 0.0
        n = self._scalar_count(chunks)
        if not n:
            return 0.0
        g = tb.wgo[1]
        return _dp_coll(self.cluster, "all_reduce", n * g, tb.dp, tb.tp) + _pack_time(self.cluster, n * g * 6)

    def _tied_sync(self, cand: Candidate, tb: _Tables, stages: list[StageResult]) -> float:
        if cand.pp == 1:
            return 0.0
        t = 0.0
        owner = {}
        for si, st in enumerate(stages):
            for k, j in st.chunks:
                for l in range(k, j):
                    owner[l] = si
        spans = self.cluster.num_nodes > 1 and cand.replicas * cand.tp >= self.cluster.devices_per_node
        link = self.cluster.inter_node if spans else self.cluster.intra_node
        for f, e, us in tb.shared:
            holders = sorted({owner[u] for u in us})
            if len(holders) < 2:
                continue
            tps = {stages[h].tp for h in holders}
            if len(tps) == 1:
                # equal layouts: each rank all-reduces its shard with its peer copy
                t += coll_time("all_reduce", e * tb.wgo[1], len(holders), link)
            else:
                # different tp (runtime.tied_grads.FullTiedSync): the whole parameter, zero
                # outside each rank's shard, all-reduced over every rank holding a copy
                info = self.graph.params.get(f)
                full = info.numel if info is not None else e * max(tps)
                t += coll_time("all_reduce", full * tb.wgo[1], sum(stages[h].tp for h in holders), link)
        return t

    def _note_min_memory(self, cand: Candidate, tb: _Tables) -> None:
        """The least peak memory of this candidate's layout: balanced stages, the most
        memory-saving recomputation allowed."""
        p, L = cand.pp, self.L
        r = "full" if "full" in self.recomputes() else self.recomputes()[0]
        bounds = [round(i * L / p) for i in range(p + 1)]
        worst = 0.0
        for i in range(p):
            k, j = bounds[i], bounds[i + 1]
            st = self._stage(tb, cand, [(k, j)], r, self._held(cand.schedule, p, i, cand.m), rank=i)
            worst = max(worst, st.peak_bytes)
        self.min_memory = min(self.min_memory, worst)


def interleaved_time(group_times: list[float], m: int, v: int) -> float:
    """The pipeline time of interleaved 1F1B over device groups whose chunks may differ (a chunk
    of one layer, of the embedding alone, of the head and loss): `group_times[d]` is group d's
    time for one micro-batch through all its v chunks. m x max_d t_d (the slowest group sets
    the steady state's pace) + (sum_d t_d - max_d t_d) / v, the fill and drain: Narayanan et
    al. 2021 (arXiv 2104.04473) §2.2's bubble (p - 1) x t / v with each group's own t (equal
    chunks: their formula). Checked against the event simulation of Megatron's order
    (`autopar.timeline.simulate`, tests/test_plot_timeline.py
    `test_interleaved_time_with_uneven_chunks`): within 2% for a loss chunk up to 3x a layer's
    and an embedding chunk a tenth of it, where pricing the bubble as (p - 1) x the slowest
    chunk overcharges by up to 13%."""
    tmax = max(group_times)
    return m * tmax + (sum(group_times) - tmax) / v


def balanced_chunks(cost: np.ndarray, n: int) -> Optional[list[tuple[int, int]]]:
    """Cut L layers into exactly `n` contiguous chunks minimising the largest chunk cost
    (`cost[k, j]` for layers k..j-1): binary search on the bound over the distinct costs, greedy
    cuts for each bound, then the costliest chunks split until there are `n`. Used for the
    interleaved schedule, whose stage times are sums of v chunks and whose bubble shrinks with
    the largest chunk."""
    L = cost.shape[0]
    if n > L:
        return None
    vals = np.unique(cost[np.isfinite(cost)])

    def greedy(tb: float) -> Optional[list[tuple[int, int]]]:
        out, k = [], 0
        while k < L:
            j = k + 1
            if cost[k, j] > tb:
                return None
            while j < L and cost[k, j + 1] <= tb:
                j += 1
            out.append((k, j))
            k = j
            if len(out) > n:
                return None
        return out

    if greedy(vals[-1]) is None:
        return None
    chunks = greedy(vals[first_feasible(vals, lambda t: greedy(t) is not None)])
    while len(chunks) < n:
        i = max((i for i, (k, j) in enumerate(chunks) if j - k > 1), key=lambda i: cost[chunks[i]])
        k, j = chunks[i]
        best = min(range(k + 1, j), key=lambda c: max(cost[k, c], cost[c, j]))
        chunks[i:i + 1] = [(k, best), (best, j)]
    return chunks


def pack_stages(sizes: list[int], N: int, dpn: int) -> list[list[int]]:
    """Global ranks for stages of `sizes` devices (pipeline order kept): whole-node stages take
    whole nodes, smaller ones aligned slices inside a node (largest first, first fit); with
    power-of-two slice sizes dividing the node this always packs when the sizes sum to N."""
    return [list(r) for r in _packed(tuple(sizes), N, dpn)]


@functools.lru_cache(maxsize=256)
def _packed(sizes: tuple[int, ...], N: int, dpn: int) -> tuple[tuple[int, ...], ...]:
    """`pack_stages`, kept per arguments: every candidate of one (dp, tp, pp) asks for the same
    packing (a scan of the cluster's ranks per stage: 3 ms on 1536 devices)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    free = [True] * N
    out: list[list[int]] = [[] for _ in sizes]
    for i in order:
        u = sizes[i]
        step = u if u <= dpn else dpn
        for start in range(0, N - u + 1, step):
            if all(free[start:start + u]) and (u > dpn or start // dpn == (start + u - 1) // dpn):
                out[i] = list(range(start, start + u))
                for r in out[i]:
                    free[r] = False
                break
        else:
            raise PlanError(f"cannot place stages of {list(sizes)} devices on {N} devices in nodes of {dpn}")
    return tuple(tuple(r) for r in out)


class _Progress:
    """A rich progress bar on stderr once the search has run for more than a second."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self.t0 = time.perf_counter()
        self.bar = None
        self.task = None

    def update(self, i: int, best) -> None:
        if not self.enabled:
            return
        if self.bar is None and time.perf_counter() - self.t0 > 1.0:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("planning"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.description}"), TimeElapsedColumn(),
                                console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("", total=self.total)
        if self.bar is not None:
            desc = (f"best {best.iteration_s:.4g} s (dp={best.dp} tp={best.tp} pp={best.pp})" if best else "")
            self.bar.update(self.task, completed=i, description=desc)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# why `evaluate` leaves a candidate out of a free search (`_layouts_agree`)
LAYOUTS_DISAGREE = ("its layers' per-op solutions disagree at a boundary, so the executor cannot run them "
                    "(pin tp to plan it anyway)")


def op_by_op(cand: "Candidate") -> bool:
    """Whether the runtime executes the candidate's stages op by op as solved (the plan then
    carries their layouts: `planner._op_layouts`): every stage of a candidate with a tp stage,
    pipelined or not, its stages of one tp degree or of several (Alpa's sub-mesh choice), under
    ZeRO-3 too (FSDP2 units around the executor's runs of ops:
    `runtime.zero.ZeroSharding._shard_solved`), with context parallelism too (below)."""
    if cand.hetero_tps:
        return any(st.tp > 1 for st in cand.stages) if cand.stages else max(cand.hetero_tps) > 1
    # context parallelism: the program (or its pipeline chunks) of a rank's tokens, its
    # attention ops the cp attention (`runtime.context_parallel.ProgramContext`)
    return cand.tp > 1
