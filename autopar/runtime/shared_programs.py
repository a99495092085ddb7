"""The programs every local rank of a plan traces alike, traced once before the ranks start.

A rank exports the model to run it op by op (`intra_op.execute.meta_program`) or traces it into
pipeline chunks (`graph_stages.split_model`, the same under context parallelism), and the
ranks of one machine trace the same program: n ranks, n traces of one model. In a 4-rank
layouts job of the test suite (test_moe's, py-spy) these traces were about 40% of a worker's
samples. Both functions keep what they traced in the process, keyed by everything the trace
depends on (the model's structure, the inputs' shapes and dtypes, the cuts, the device, the
compute dtype, traced positions).

`trace_programs(plan, bundle)` makes the calls a rank of `plan` makes, with the arguments the
engine gives them (`engine.ParallelModel`), in the process the local ranks are then forked from
(`processes.launch(..., prepare=...)`): each rank finds the programs kept, as it finds those of
an earlier plan of the same model, and traces none of them. What a rank runs does not change:
it looks each program up by its own key, so a call made here with other arguments than a
rank's (a context this function does not reproduce) is a key no rank asks for, and that rank
traces its own, as before. A model that cannot be traced here is left to the ranks, which
report it as they do without this step.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from autopar.models.registry import ModelBundle, call_batch_fn
from autopar.schema.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["trace_programs", "traced_counts"]


def traced_counts() -> dict[str, int]:
    """This process's programs kept: {"meta_programs": n, "splits": n}."""
    from autopar.intra_op import execute
    from autopar.runtime import graph_stages

    return {"meta_programs": len(execute._META_PROGRAMS), "splits": len(graph_stages._SPLITS)}


def keep_at_least(n: int) -> None:
    """Keep at least `n` more programs of each kind than are kept now (what `trace_programs`
    traced stays kept while the ranks trace their own too)."""
    from autopar.intra_op import execute
    from autopar.runtime import graph_stages

    execute.META_PROGRAMS_KEPT = max(execute.META_PROGRAMS_KEPT, len(execute._META_PROGRAMS) + n)
    graph_stages.SPLITS_KEPT = max(graph_stages.SPLITS_KEPT, len(graph_stages._SPLITS) + n)


def trace_programs(plan: Plan, bundle: ModelBundle, *, device: Optional[torch.device] = None,
                   seed: int = 0) -> Optional[str]:
    """Trace, in this process, the programs each rank of `plan` traces for `device` (default
    the CPU) before its first step: the op-by-op program of a solved stage, the pipeline chunks
    of a traced pipeline, a context-parallel rank's one chunk. None when done (or nothing to
    trace), else why not (the ranks then trace it themselves)."""
    from autopar.runtime.graph_stages import split_model
    from autopar.runtime.precision import low_dtype
    from autopar.runtime.validate import validate_plan

    device = torch.device(device if device is not None else "cpu")
    stages = sorted(plan.stages, key=lambda s: s.index)
    model = bundle.model
    try:
        pp = len(validate_plan(plan, model)["devsets"])
    except Exception as e:  # noqa: BLE001 - the ranks refuse the plan themselves, with this error
        return f"plan not valid here ({type(e).__name__}: {e})"
    low = low_dtype(plan.dtype)
    cp = stages[0].axis_size("cp")
    seq = plan.model.tokens_per_sample
    keep_at_least(8)

    def local(x: Any) -> Any:
        """`ContextParallel.local_tokens` of rank 0 (its two chunks of each sequence)."""
        if cp > 1 and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq:
            from autopar.runtime.context_parallel import chunk_order

            c = seq // (2 * cp)
            return torch.cat([x.narrow(1, i * c, c) for i in chunk_order(0, cp)], dim=1)
        return x

    def meta_microbatch() -> tuple:
        """`PipelineStages._example_microbatch`."""
        mb = plan.microbatch_size
        return tuple(local(torch.empty((mb,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta"))
                     if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in bundle.example_inputs)

    def real_microbatch() -> tuple:
        """`ParallelModel._real_microbatch` (its shapes and dtypes are what the key reads)."""
        mb = plan.microbatch_size
        if bundle.batch_fn is not None:
            batch = call_batch_fn(bundle.batch_fn, 0, mb, seed)
        else:
            batch = tuple(torch.zeros((mb,) + tuple(x.shape[1:]), dtype=x.dtype)
                          if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in bundle.example_inputs)
        return tuple(local(x) for x in batch)

    try:
        if stages[0].op_layouts is not None:
            from autopar.capture.own_positions import whole_sequence
            from autopar.intra_op.execute import meta_program
            from autopar.models.positions import traced_positions

            # `execute._parallelize_graph` (one stage) / `pipeline_chunks.parallelize_chunks`
            # (a pipeline's): the weights' dtype given where it is not the model's
            floats = [p for p in model.parameters() if p.is_floating_point()]
            dtype = low if pp > 1 or (low is not None and any(p.dtype != low for p in floats)) else None
            ctx = contextlib.ExitStack()
            if cp > 1:
                ctx.enter_context(traced_positions())
                ctx.enter_context(whole_sequence(seq))
            with ctx:
                meta_program(model, real_microbatch(), param_dtype=dtype, device=device)
        elif pp > 1:
            from autopar.models.positions import traced_positions

            # `PipelineStages._build_pipeline`
            cuts = [s.layers[0] for s in stages[1:]]
            with traced_positions() if cp > 1 else contextlib.nullcontext():
                split_model(model, meta_microbatch(), cuts, device, param_dtype=low)
        elif cp > 1:
            from autopar.models.positions import traced_positions

            # `ParallelModel._own_positions_program`
            with traced_positions():
                split_model(model, meta_microbatch(), [], device, param_dtype=low)
    except Exception as e:  # noqa: BLE001 - each rank traces it itself and reports what fails there
        why = f"{type(e).__name__}: {str(e)[:300]}"
        log.info("the programs of %s's ranks were not traced before they started (%s): each traces its own",
                 plan.model.name, why)
        return why
    return None


def trace_plan(plan_json: str, model: Any, seed: int = 0) -> Optional[str]:
    """`trace_programs` for the CPU ranks of `autopar run` (picklable: `processes.launch`'s
    `prepare`): the plan as JSON, the model as the workers get it (a reference or a bundle)."""
    from autopar.models.registry import build_model

    bundle = model if isinstance(model, ModelBundle) else build_model(model, device="meta")
    return trace_programs(Plan.from_json(plan_json), bundle, seed=seed)


def trace_plan_files(paths: list[str], seed: int = 0) -> None:
    """`trace_programs` for each plan file of a job that runs them in turn (picklable), each
    plan's model built from its reference."""
    from autopar.models.registry import build_model
    from autopar.schema.plan import load_plan

    for path in paths:
        plan = load_plan(path)
        why = trace_programs(plan, build_model(plan.model.name, device="meta"), seed=seed)
        if why is not None:
            log.info("%s: its ranks trace their own programs (%s)", path, why)
