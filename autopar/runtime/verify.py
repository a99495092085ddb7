"""`autopar verify`: every distinct kind of rank of a plan built and stepped at the plan's full
world size, in this process, with no devices.

Each kind (`rank_kinds`: stage x mesh coordinate, deduplicated by the shards it holds) is built
exactly as `autopar run` builds a rank (`engine.ParallelModel`, the one executor) on torch's fake
process group (`init_process_group("fake")` at the plan's world size and that rank: collectives
return at once, moving nothing) and on fake tensors (`FakeTensorMode`: shapes, dtypes and
storages without data; the model comes from the meta device). It runs two training steps as
`autopar run` does - every micro-batch of the schedule, backward, gradient sync, optimizer
step; the first allocates AdamW's state - and the second under the runtime's memory tracker
(`memory_tracking.track_step`) and collective counter (`counting.CollectiveCounter`, here by
phase of the step). The process group is destroyed before the next kind. Each step runs the
fewest micro-batches reaching the plan's schedule states (`short_step`: the same peak; the
batch and the forward/backward collectives put back to the plan's), and a GPU plan's ranks run
CUDA's autocast lists and fused RMSNorm (`cuda_program`), which the CPU program runs otherwise.

Checked per kind: the local shard of every parameter against the plan's placements
(`rank_kinds.expected_shards`), the tracked peak against the device's capacity (and the plan's
usable memory) beside the plan's prediction for the rank's stage, and, for stages run as solved,
the forward/backward collectives against the solution's (`op_layouts.collectives`). For the plan:
the representatives' collectives combined by `counting.combine` against
`plan.predicted.collectives`. What the runtime does that needs values is not run here: the
loss's value (NaN), the warm-up vote of torch.pipelining (`pipeline._vote_static`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from autopar.models.registry import ModelBundle, build_model, call_batch_fn, default_batch_fn
from autopar.runtime import fake_kernels
from autopar.runtime.counting import CollectiveCounter, combine
from autopar.runtime.rank_kinds import RankKind, expected_shards, rank_kinds
from autopar.runtime.short_step import MicrobatchTags, ShortStepError, extrapolate, full_inputs, shortened
from autopar.runtime.tied_grads import fake_backend_of
from autopar.schema.errors import PlanError
from autopar.schema.plan import Plan, format_bytes
from autopar.schema.verify import RankCheck, ShardMismatch, VerifyReport

# what building or stepping a rank on fake tensors raises when the plan cannot run: reported as
# that rank's failure (and the other kinds still verified), not as a crash of the command
BUILD_ERRORS: tuple[type[BaseException], ...] = (PlanError, RuntimeError, ValueError, TypeError, KeyError,
                                                 IndexError, AssertionError, NotImplementedError, AttributeError)
PHASES = ("forward_backward", "grad_sync", "optimizer")


class PhasedCounter(CollectiveCounter):
    """`CollectiveCounter` that also records the phase of the step each collective ran in: the
    phase of the memory tracker of the step (`memory_tracking.track_step`, which follows the
    step's parts), the first outside one.

    Entered while a step is tracked, it is no dispatch mode of its own: the step's tracker
    (`memory_tracking.StepMemTracker`, the mode it would sit right above) calls its `observe`
    for each op it is handed, before its own work, so every op of a fake step crosses one
    Python dispatch mode less (about 8% of a GPT-3 175B kind's step). The two see the same ops:
    each hands every op it does not keep to the mode below (the tracker is that one for the
    counter), both let DTensor ops through to be seen as the local ops they become, and the
    phase and micro-batch read before the op runs are those after it (a single op changes
    neither: `track_step`'s wrappers and `MicrobatchTags` set them around whole calls).
    Entered outside a tracked step, it is a dispatch mode as `CollectiveCounter` is."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = []
        self.microbatch = MicrobatchTags()       # the micro-batch each collective is attributed to
        self.tags: list[Optional[int]] = []
        self._entered: list[Any] = []            # per `with`: the tracker attached to, or None

    def observe(self, func: Any, args: Any, kwargs: dict) -> None:
        from autopar.runtime import memory_tracking

        n = len(self.events)
        super().observe(func, args, kwargs)
        if len(self.events) > n:
            mt = memory_tracking._ACTIVE
            self.phases.append(mt.phase if mt is not None else PHASES[0])
            self.tags.append(self.microbatch.current)

    def __enter__(self) -> "PhasedCounter":
        from autopar.runtime import memory_tracking

        mt = memory_tracking._ACTIVE
        if mt is None:
            self._entered.append(None)
            return super().__enter__()
        self._entered.append((mt, mt.counter))
        mt.counter = self
        return self

    def __exit__(self, *exc: Any) -> None:
        held = self._entered.pop()
        if held is None:
            return super().__exit__(*exc)
        mt, before = held
        mt.counter = before
        return None


def by_phase(events: Sequence[tuple[str, tuple[int, ...], str]],
             skip_groups: Sequence[tuple[int, ...]] = ()) -> dict[str, dict[str, int]]:
    """phase -> kind -> count of (kind, group ranks, phase) events, receives as send_recv and
    sends left out (`CollectiveCounter.local_counts`); collectives of the groups `skip_groups`
    (their ranks) left out too."""
    out: dict[str, Counter] = {}
    for kind, ranks, ph in events:
        if kind == "send_recv" or ranks in skip_groups:
            continue
        out.setdefault(ph, Counter())["send_recv" if kind == "recv" else kind] += 1
    return {ph: dict(sorted(c.items())) for ph, c in out.items()}


def _tp_predicted(plan: Plan, kind: RankKind) -> Optional[dict[str, int]]:
    """The solved layouts' forward/backward collectives of the rank's chunks over one step: every
    micro-batch's forward, backward and recomputation, and the moves of parameter gradients to
    their layouts, which the executor makes in every backward (the norms' partial gradients of
    sequence parallelism; the planner counts them the same way, `planner.assemble`)."""
    stages = [s for s in plan.stages if s.index in kind.stages]
    if not stages or any(s.op_layouts is None for s in stages):
        return None
    total: Counter = Counter()
    for s in stages:
        for phase in ("forward", "backward", "grad_sync", "recompute"):
            for k, v in s.op_layouts.collectives.get(phase, {}).items():
                total[k] += v * plan.num_microbatches
    return dict(sorted((k, v) for k, v in total.items() if v))


def _expert_tp_counts(plan: Plan, kind: RankKind) -> Counter:
    """The experts' collectives in one step of the rank's stages that run beside the solved
    layouts' and are counted with them (`inter_op.experts.ExpertCosting.expert_collectives`: per
    block and micro-batch one forward, one backward, the forward's again under full
    recomputation): expert tensor parallelism's all-reduces over tp; folded, the all-gathers over
    tp and the exchange's all-to-alls (its ep group may be a tp group: not told apart by ranks)."""
    ex = plan.experts
    if ex is None or ex.ep == 1 or (ex.expert_tp == 1 and not ex.folded):
        return Counter()
    from autopar.inter_op.experts import (
        A2A_BACKWARD,
        A2A_FORWARD,
        ETP_BACKWARD,
        ETP_FORWARD,
        FOLD_BACKWARD,
        FOLD_FORWARD,
    )

    out: Counter = Counter()
    for s in plan.stages:
        if s.index not in kind.stages:
            continue
        # the blocks of this stage (a pipeline stage holds some of the model's), per micro-batch
        n = plan.num_microbatches * sum(any(_under(b.module, lay) for lay in s.layers) for b in ex.blocks)
        again = s.recompute == "full"          # the forward's again in the backward
        if ex.folded:
            out["all_gather"] += n * (FOLD_FORWARD + FOLD_BACKWARD + (FOLD_FORWARD if again else 0))
            out["all_to_all"] += n * (A2A_FORWARD + A2A_BACKWARD + (A2A_FORWARD if again else 0))
        else:
            out["all_reduce"] += n * (ETP_FORWARD + ETP_BACKWARD + (ETP_FORWARD if again else 0))
    return +out


def _under(fqn: str, prefix: str) -> bool:
    """Whether module `fqn` is `prefix` or lies inside it."""
    return fqn == prefix or fqn.startswith(prefix + ".")


def verify_rank(plan: Plan, make_bundle: Callable[[], ModelBundle], kind: RankKind, *,
                top: int = 0, all_microbatches: bool = False) -> tuple[RankCheck, list]:
    """Build and step rank `kind.rank` on a fake process group and fake tensors (this process
    must have no process group); returns its RankCheck and its collective events of the step
    (for `counting.combine`). `autopar run` tracks its second step, whose update finds AdamW's
    state allocated by the first: here the first is that update alone, on zero gradients (the
    gradient sync and the optimizer step), not a whole forward and backward. (It once tracked
    +81% on gpt-tiny tp4 in a fresh process: DTensor's shape propagation on fake tensors, counted
    until `memory_tracking` left it out; reports equal a full first step's on every kind of the
    verify_sweep cases checked, gpt3-6.7b tp2 pp4 interleaved 86 -> 53 CPU s.) Each step runs
    the fewest micro-batches that
    reach the plan's schedule states (`short_step`; `all_microbatches`: the plan's own number),
    its batch and collectives put back to the plan's micro-batches."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.engine import ParallelModel, default_optimizer
    from autopar.runtime.memory_tracking import (
        PLAN_CATEGORIES,
        baseline,
        predicted_for_rank,
        relative_error,
        track_step,
    )
    from cost_models.memory import fused_optimizer

    t0, c0 = time.perf_counter(), time.process_time()
    check = RankCheck(rank=kind.rank, stages=kind.stages, coordinate=kind.coordinate,
                      ranks_of_kind=len(kind.ranks), representative=kind.representative)
    pred = predicted_for_rank(plan, kind.rank)
    if pred is not None:
        check.predicted_peak_bytes = pred["peak_bytes"]
        check.predicted_stage = pred["stage"]
        check.predicted_categories = {k: pred[k] for k in PLAN_CATEGORIES}
    events: list = []
    # the rank's place in the pipeline: stage i runs on the pp-th device set i mod pp
    position = min(kind.stages) % plan.pp if plan.pp > 1 and kind.stages else None
    run_plan, run = (plan, plan.num_microbatches) if all_microbatches else shortened(plan, position)
    check.microbatches_stepped = run
    _clear_dtensor_caches()
    _BUILT.add(_layout(plan))
    dist.init_process_group("fake", store=FakeStore(), rank=kind.rank, world_size=plan.world_size)
    try:
        fake_kernels.install()          # the CPU kernels torch's fake ones misstate (fp32 grouped GEMMs)
        bundle = make_bundle()
        skip = baseline()
        with FakeTensorMode(allow_non_fake_inputs=True), _real_mesh_concatenation(), _device_lists(plan), \
                _dispatch_without_dynamo_guard(), fake_backend_of(plan.cluster.device.device_type):
            # the optimizer the plan's device runs (fused AdamW on CUDA: no temporaries)
            opt = functools.partial(default_optimizer, fused=fused_optimizer(plan.cluster.device.device_type))
            pm = ParallelModel(run_plan, bundle, seed=0, optimizer_factory=opt)
            batch_fn = bundle.batch_fn or default_batch_fn(bundle.example_inputs)
            batch = pm.local_batch(call_batch_fn(batch_fn, 0, run_plan.global_batch_size, 0))
            # `autopar run`'s first step allocates the optimizer's state in its update: only the
            # update runs here (on zero gradients), the tracked step is the second
            pm.sync_and_update()
            counter = PhasedCounter()
            with counter.microbatch.installed(pm):
                _, rep = track_step(pm, batch, counter=counter, skip=skip, top=top)
        _check_shards(check, pm, plan, bundle.model)
        full = extrapolate(counter.events, counter.phases, counter.tags, run, plan.num_microbatches)
        events = [(k, r) for k, r, _ in full]
        check.collectives = by_phase(full)
        check.tp_predicted = _tp_predicted(plan, kind)
        if check.tp_predicted is not None:
            # on the tp group: under ZeRO-3 FSDP's gathers and reduce-scatters run on the dp one,
            # expert parallelism's token exchange on its ep group (`runtime.experts`), context
            # parallelism's on its cp group
            other = [tuple(dist.get_process_group_ranks(pm.dp_group))] if pm.zero3 and pm.dp_group is not None else []
            if pm.expert_groups is not None and not plan.experts.folded:
                other.append(tuple(dist.get_process_group_ranks(pm.expert_groups.ep_group)))
                if pm.expert_groups.edp_group is not None:
                    # the experts' own gradient sync, ZeRO shard or FSDP units over the ranks
                    # holding the same experts (`ExpertGroups`)
                    other.append(tuple(dist.get_process_group_ranks(pm.expert_groups.edp_group)))
            if pm.cp is not None:
                # context parallelism's exchange and loss count on its cp group (`runtime.context_parallel`)
                other.append(tuple(dist.get_process_group_ranks(pm.cp.group)))
            fb = dict(by_phase(full, other).get("forward_backward", {}))
            fb.pop("send_recv", None)
            for k, n in _expert_tp_counts(plan, kind).items():
                # expert tensor parallelism's all-reduces run on the tp group beside the solved
                # layouts' (`runtime.experts`: the experts' output and their input's gradient),
                # folding's all-gathers too, and its exchange on ep groups that may be tp groups
                if fb.get(k, 0) >= n:
                    fb[k] -= n
                    if not fb[k]:
                        fb.pop(k)
            check.tp_measured = fb
        # the batch of the plan's micro-batches, alive through the step: `run` of them were held
        extra = full_inputs(rep.detail.get("inputs", 0), run, plan.num_microbatches)
        check.tracked_peak_bytes = rep.peak_bytes + extra
        check.tracked_peak_phase = rep.peak_phase
        check.tracked_categories = dict(rep.categories)
        check.tracked_categories["buffers"] = check.tracked_categories.get("buffers", 0) + extra
        check.tracked_phases = {k: v.peak_bytes + extra for k, v in rep.phases.items()}
        check.peak_tensors = rep.peak_tensors
        check.notes = list(rep.notes)
        check.notes += [f"ran the program traced on the meta device: {why}" for why in pm.programs_traced_on_meta()]
        if run < plan.num_microbatches:
            check.notes.insert(0, f"stepped {run} of the plan's {plan.num_microbatches} micro-batches, which pass "
                                  f"through the same schedule states (the same peak); the batch's other "
                                  f"{plan.num_microbatches - run} micro-batches ({format_bytes(extra)}) added to "
                                  f"the tracked memory, the forward/backward collectives extrapolated")
        if pred is not None:
            check.memory_error = relative_error(check.tracked_peak_bytes, pred["peak_bytes"])
    except ShortStepError as e:
        check.error = f"{e} (verify with all micro-batches: --all-microbatches)"
    except BUILD_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        check.error = f"{type(e).__name__}: {msg}" if not isinstance(e, PlanError) else msg
    finally:
        dist.destroy_process_group()
    check.time_s = time.perf_counter() - t0
    check.cpu_s = time.process_time() - c0
    return check, events


@contextlib.contextmanager
def _dispatch_without_dynamo_guard() -> Iterator[None]:
    """Call the fake step's dispatch modes (FakeTensorMode, torch's MemTracker and the runtime's
    tracker and counters) without the Dynamo guard torch puts around every `TorchDispatchMode`
    subclass's `__torch_dispatch__` (`TorchDispatchMode.__init_subclass__`: `_disable_dynamo`,
    which swaps Dynamo's frame callback out and back in, a few us a call). It keeps Dynamo from
    compiling the mode's frames when a mode runs under `torch.compile`; nothing runs compiled here
    (the model comes from the meta device, the runtime compiles nothing), and a fake step makes
    about 5 such calls per op (gpt3-6.7b tp2 pp4 rank 0: 263k; GPT-3 175B's kind: 845k). The
    classes' own methods are restored on exit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from autopar.runtime.memory_tracking import StepMemTracker

    saved = []
    for cls in (FakeTensorMode, MemTracker, StepMemTracker, CollectiveCounter, PhasedCounter):
        fn = cls.__dict__.get("__torch_dispatch__")
        raw = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if raw is not None and code is not None and code.co_filename.endswith("_compile.py") \
                and code.co_name == "inner":     # torch._compile._disable_dynamo's wrapper
            saved.append((cls, fn))
            cls.__torch_dispatch__ = raw
    try:
        yield
    finally:
        for cls, fn in saved:
            cls.__torch_dispatch__ = fn


def _device_lists(plan: Plan) -> Any:
    """What the plan's device runs where this CPU program differs: for a GPU plan, CUDA's
    autocast lists and fused RMSNorm (`cuda_program`), else nothing to change."""
    from autopar.runtime.cuda_program import cuda_program

    if plan.cluster.device.device_type == "cuda":
        return cuda_program()
    return contextlib.nullcontext()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached redistribution plans and sharding propagation (what Python
    holds; see `_isolated` for what it cannot reach)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def _layout(plan: Plan) -> tuple:
    """What fixes the process groups a rank creates, and their names: the stages' device sets
    and meshes."""
    return tuple((tuple(s.devices), tuple(s.mesh_shape), tuple(s.mesh_axis_names))
                 for s in sorted(plan.stages, key=lambda s: s.index))


def _isolated(plan: Plan) -> tuple[bool, bool]:
    """(run the kinds in another process, one process per kind). DTensor caches sharding
    decisions (in C++ too, out of `_clear_dtensor_caches`' reach) with the meshes they were
    made for, and a mesh of an earlier plan, kept alive by its parameters, equals a new one over
    the same devices: a cache hit then runs the new rank's collectives on the old mesh's
    process-group names, which the re-initialised group numbers anew (seen: every parameter of
    a 4-rank pp2 x tp2 plan on a tp mesh whose group was the whole world, after a 2-rank tp2
    plan in the same process). Ranks of one plan create the same groups in the same order, so
    the names agree and its kinds can share a process; a stage with several dp or tp axes
    flattens them into groups only its own ranks create, so then each kind gets a process."""
    flattened = any(s.mesh_axis_names.count(k) > 1 for s in plan.stages for k in ("dp", "tp"))
    return bool(_BUILT - {_layout(plan)}) or flattened, flattened


_BUILT: set[tuple] = set()     # layouts of the plans whose ranks this process has built


@contextlib.contextmanager
def _real_mesh_concatenation() -> Iterator[None]:
    """FSDP2 over tp DTensors joins the dp and tp meshes (`DeviceMesh._concatenate`, torch
    2.13), which computes the rank's coordinate from the rank-id tensor with `nonzero`: under
    fake tensors a data-dependent shape, refused. Rank ids are not the program's data: the join
    runs outside fake mode (as the runtime builds its own meshes, `engine._build_meshes`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    orig = DeviceMesh.__dict__["_concatenate"]

    def concatenate(device_mesh_list: list) -> Any:
        with unset_fake_temporarily():
            return orig.__func__(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = orig


def _check_shards(check: RankCheck, pm: Any, plan: Plan, model: Any) -> None:
    """Every parameter the rank holds against the local shard the plan's placements give."""
    from torch.distributed.tensor import DTensor

    built = {}
    for name, p in pm.local_named_parameters():
        loc = p._local_tensor if isinstance(p, DTensor) else p
        built[name] = tuple(loc.shape)
    expected = expected_shards(plan, model, check.rank, aliases=pm.aliases, held=sorted(built))
    check.params_checked = len(built)
    for name in sorted(built):
        e, b = expected.get(name), built[name]
        if e != b:
            check.shard_mismatches.append(ShardMismatch(name=name, expected=list(e) if e is not None else None,
                                                        built=list(b) if b is not None else None))


def _bundle_factory(model: str | ModelBundle | Callable[[], Any]) -> Callable[[], ModelBundle]:
    """A function making a fresh bundle per rank (the runtime materialises a bundle in place)."""
    if isinstance(model, str):
        return lambda: build_model(model, device="meta")
    if isinstance(model, ModelBundle):
        import copy

        return lambda: copy.deepcopy(model)

    def make() -> ModelBundle:
        out = model()
        if isinstance(out, ModelBundle):
            return out
        return ModelBundle("custom", out[0], tuple(out[1]), out[2] if len(out) > 2 else None)
    return make


def verify(plan: Plan | str, model: str | ModelBundle | Callable[[], Any], *,
           device_memory_bytes: Optional[float] = None, ranks: Optional[Sequence[int]] = None,
           top: int = 0, check: bool = True, jobs: Optional[int] = None,
           progress: bool = False, all_microbatches: bool = False) -> VerifyReport:
    """Build and step every kind of rank of `plan` at its full world size on a fake process group
    and fake tensors; see the module docstring. `model`: a model reference, a ModelBundle (on
    meta) or a factory. `device_memory_bytes`: the capacity to check against (default the plan's
    device). `ranks`: verify only the kinds of these ranks (the plan's total collectives are
    then compared only when every device set's representative is among them). `top` > 0: each
    kind lists the `top` largest storages at its peak. `check`: first check the plan against the
    model (fingerprint, as `autopar run`). `jobs`: worker processes building kinds side by
    side (default 1: this process; at most one per kind; a model given as a reference only).
    Workers fork from a server that imports the calling script (`processes`): a script needs an
    `if __name__ == "__main__":` guard.
    `all_microbatches`: step the plan's micro-batches, not the fewest reaching the same schedule
    states (`short_step`; the report's `microbatches_stepped` says which ran). Raises
    PlanError for bad input; a rank that fails to build is a failure in the report."""
    from autopar.runtime import _load, check_plan

    t0 = time.perf_counter()
    p = _load(plan)
    if dist.is_initialized():
        raise PlanError("verify needs a process without a process group (it makes a fake one per rank); "
                        "call it before init_process_group or from another process")
    make = _bundle_factory(model)
    bundle = make()
    if check:
        check_plan(p, bundle, model_ref=model if isinstance(model, str) else None)
    kinds = rank_kinds(p, bundle.model)
    if ranks is not None:
        want = set(ranks)
        bad = sorted(want - set(range(p.world_size)))
        if bad:
            raise PlanError(f"rank {bad[0]} is not in the plan (ranks 0..{p.world_size - 1})")
        kinds = [k for k in kinds if want & set(k.ranks)]
    cap = float(device_memory_bytes) if device_memory_bytes is not None else float(p.cluster.device.memory_bytes)
    usable = float(p.predicted.usable_memory_bytes or 0) if device_memory_bytes is None else 0.0
    report = VerifyReport(model=p.model.name, world_size=p.world_size, device=p.cluster.device.name,
                          capacity_bytes=cap, usable_bytes=usable, microbatches=p.num_microbatches,
                          collectives_predicted={k: v for k, v in p.predicted.collectives.items() if v})
    events: dict[int, list] = {}
    jobs = min(jobs or 1, len(kinds))
    elsewhere, per_kind = _isolated(p)
    if not isinstance(model, str):
        if elsewhere:
            raise PlanError("this process has built the ranks of another plan; give the model as a reference "
                            "(zoo name, MODULE:FACTORY or hf:NAME) so verify can build them in a fresh process, "
                            "or verify from a new process")
        jobs = 1   # workers rebuild the model from its reference; a bundle or factory stays here
    results = _run_kinds(p, model, make, kinds, top=top, jobs=jobs, progress=progress, elsewhere=elsewhere,
                         per_kind=per_kind, all_microbatches=all_microbatches)
    for kind, (rc, ev) in zip(kinds, results):
        report.ranks.append(rc)
        if rc.error is None:
            events[kind.rank] = ev
    _judge(p, report, kinds, events)
    report.time_s = time.perf_counter() - t0
    return report


def _run_kinds(plan: Plan, model: Any, make: Callable[[], ModelBundle], kinds: list[RankKind], *, top: int,
               jobs: int, progress: bool, elsewhere: bool = False, per_kind: bool = False,
               all_microbatches: bool = False) -> list[tuple[RankCheck, list]]:
    """`verify_rank` for each kind: in this process one after the other, or over `jobs` worker
    processes (forked from the runtime's server, `processes`; also with `elsewhere`; each builds
    the model from its reference `model`;
    `per_kind`: a fresh process for each kind, see `_isolated`)."""
    def note(i: int, kind: RankKind, rc: RankCheck) -> None:
        if progress:
            got = rc.error or (f"tracked peak {format_bytes(rc.tracked_peak_bytes)}"
                               + (f", predicted {format_bytes(rc.predicted_peak_bytes)} ({rc.memory_error:+.1%})"
                                  if rc.memory_error is not None and rc.predicted_peak_bytes is not None else "")
                               + f", {rc.microbatches_stepped} micro-batches, {rc.cpu_s:.0f} CPU s")
            print(f"autopar verify: rank {kind.rank} (stage {','.join(map(str, kind.stages))}, "
                  f"{len(kind.ranks)} ranks of its kind) [{i + 1}/{len(kinds)}]: {got}", file=sys.stderr, flush=True)

    if jobs <= 1 and not elsewhere:
        out = []
        for i, kind in enumerate(kinds):
            out.append(_quiet(verify_rank, plan, make, kind, top=top, all_microbatches=all_microbatches))
            note(i, kind, out[-1][0])
        return out
    from concurrent.futures import ProcessPoolExecutor

    from autopar.runtime.processes import in_launcher_env, launcher_args, worker_context

    text = plan.to_json(indent=None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=worker_context(),
                             max_tasks_per_child=1 if per_kind else None) as pool:
        futs = [pool.submit(in_launcher_env, *launcher_args(_kind_job, text, model, kind, top, all_microbatches))
                for kind in kinds]
        out = []
        for i, (kind, fut) in enumerate(zip(kinds, futs)):
            rc_json, ev = fut.result()
            out.append((RankCheck.model_validate_json(rc_json), ev))
            note(i, kind, out[-1][0])
        return out


def _kind_job(plan_json: str, model: str, kind: RankKind, top: int, all_microbatches: bool) -> tuple[str, list]:
    """A worker process's task: one kind, from the plan's JSON and the model's reference."""
    plan = Plan.from_json(plan_json)
    rc, ev = _quiet(verify_rank, plan, _bundle_factory(model), kind, top=top, all_microbatches=all_microbatches)
    return rc.model_dump_json(), ev


def _quiet(fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
    with warnings.catch_warnings():
        # torch's deprecation notice of the c10d all-gather the runtime's ZeRO-1/2 path calls
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
        return fn(*a, **k)


def _judge(plan: Plan, report: VerifyReport, kinds: list[RankKind], events: dict[int, list]) -> None:
    """Fill the report's failures and warnings, and the plan's combined collectives."""
    cap, usable = report.capacity_bytes, report.usable_bytes
    for rc in report.ranks:
        where = f"stage {','.join(map(str, rc.stages))} (rank {rc.rank})"
        if rc.error is not None:
            report.failures.append(f"{where} failed to build or step: {rc.error}")
            continue
        if rc.tracked_peak_bytes > cap:
            report.failures.append(f"{where} does not fit: tracked peak {format_bytes(rc.tracked_peak_bytes)} "
                                   f"({rc.tracked_peak_phase}) exceeds the device's {format_bytes(cap)}")
        elif usable and rc.tracked_peak_bytes > usable:
            report.warnings.append(f"{where}: tracked peak {format_bytes(rc.tracked_peak_bytes)} is above the "
                                   f"plan's usable {format_bytes(usable)} (within the device's {format_bytes(cap)})")
        if rc.shard_mismatches:
            m = rc.shard_mismatches[0]
            report.failures.append(f"{where}: {len(rc.shard_mismatches)} parameter shards differ from the plan, "
                                   f"e.g. {m.name}: plan {m.expected}, built {m.built}")
        if rc.tp_predicted is not None and rc.tp_measured != rc.tp_predicted:
            report.failures.append(f"{where}: forward/backward collectives {rc.tp_measured} differ from the "
                                   f"solved layouts' {rc.tp_predicted}")
    devsets = {tuple(s.devices) for s in plan.stages}
    reps = {ds[0] for ds in devsets}
    if reps <= set(events):
        measured = combine({r: events[r] for r in reps}, reps)
        report.collectives_measured = measured
        report.collectives_match = measured == report.collectives_predicted
        if not report.collectives_match:
            report.failures.append(f"collectives per step {measured} differ from the plan's "
                                   f"{report.collectives_predicted}")
