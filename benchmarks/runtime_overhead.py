"""Step time of an executed autopar plan vs hand-written PyTorch for the same layout, on the same
CPU processes (gloo): data parallel (DDP), ZeRO-3 (`fully_shard`), tensor parallel
(`parallelize_module` with ColwiseParallel/RowwiseParallel). Prints a table. The tensor-parallel
plan is `autopar.plan`'s, pinned to tp over every process: it carries the solved per-op layouts,
so autopar runs it op by op as solved (`intra_op.execute`), the path every tp plan outside
ZeRO-3 takes; the hand-written side shards the zoo GPT Megatron's way, and (when the plan splits
the embedding and the tied output layer over the vocabulary) as the plan does too: the logits
all-gathered for the loss, or left split for torch's `loss_parallel` cross-entropy (the plan's
own loss: three all-reduces of one value per row instead of the logits' all-gather).

    python benchmarks/runtime_overhead.py [--nproc 2] [--model gpt-small] [--batch 16] [--steps 10]

autopar is timed twice: with the per-step collective counter on (the default of `autopar run`, a
TorchDispatchMode that sees every op) and off (`train(..., count_collectives=False)`).
Target: <= 10% slower than hand-written with counting off (issue 20: <= 5%). Wall and CPU time
(`time.process_time` of rank 0: steadier on a shared machine) are both printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tp_plan(model: str, n: int, gbs: int, path: str) -> None:
    """The planner's tp plan (planned once, here, and read by every worker)."""
    import autopar
    from autopar.planner import plan

    cl = autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})
    p = plan(model, cl, global_batch_size=gbs, dtype="fp32",
             constraints=autopar.Constraints(dp=1, tp=n, pp=1, recompute="none", microbatch_size=gbs,
                                                 sequence_parallel=False))
    if p.stages[0].op_layouts is None:
        raise SystemExit(f"the tp plan is not executed op by op: {p.search.get('tp_executor')}")
    p.save(path)


def _plans(model: str, n: int, gbs: int, tp_path: str):
    from autopar.models import build_model
    from tests.plans import StagePlan, _layers, _plan

    b = build_model(model, device="meta")
    nb = len(b.model.blocks)
    L = _layers(nb)
    names = [k for k, _ in b.model.named_parameters()]
    dp = _plan(model, [StagePlan(index=0, devices=list(range(n)), mesh_shape=(n,), mesh_axis_names=("dp",),
                                 layers=L)], gbs=gbs, mb=gbs // n, m=1, nodes_devices=n)
    z3 = _plan(model, [StagePlan(index=0, devices=list(range(n)), mesh_shape=(n,), mesh_axis_names=("dp",),
                                 layers=L, placements={k: ("S(0)",) for k in names})],
               gbs=gbs, mb=gbs // n, m=1, zero=3, nodes_devices=n)
    from autopar.schema.plan import load_plan

    return {"dp": dp, "zero3": z3, "tp": load_plan(tp_path)}


def _vocab_parallel(plan) -> bool:
    """Whether the plan splits the embedding (and the output layer tied to it) over the vocabulary."""
    pl = plan.stages[0].placements.get("embed.tok.weight")
    return pl is not None and pl[-1] == "S(0)"


def _timeit(fns: dict, steps: int, warmup: int = 3) -> dict:
    """Median step time of each variant, the variants interleaved step by step (the machine is
    shared: load changes hit every variant alike): wall time, and under "cpu" this process's
    CPU time per step (`time.process_time`: what the step itself computed, the time it waited
    for the other rank or for a core left out; the steadier figure on a loaded machine)."""
    import torch.distributed as dist

    for s in range(warmup):
        for fn in fns.values():
            fn(s)
    ts: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for s in range(warmup, warmup + steps):
        for k, fn in fns.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(s)
            ts[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in ts.items()}
    out["cpu"] = {k: statistics.median(v) for k, v in cpu.items()}
    return out


def _hand(kind: str, model_ref: str, gbs: int, seed: int, vocab_parallel: bool = False,
          parallel_loss: bool = False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import build_model
    from autopar.runtime.materialize import canonical_names, materialize
    from autopar.runtime.spmd import allow_implicit_replication, register_extra_strategies

    b = build_model(model_ref, device="meta")
    m = b.model
    materialize(m, seed=seed, aliases=canonical_names(m))
    n, r = dist.get_world_size(), dist.get_rank()
    if kind == "dp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(m)
        rows = slice(r * gbs // n, (r + 1) * gbs // n)
    elif kind == "zero3":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        net = fully_shard(m, mesh=mesh)
        rows = slice(r * gbs // n, (r + 1) * gbs // n)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        register_extra_strategies()
        allow_implicit_replication()
        mesh = init_device_mesh("cpu", (n,))
        plan = {}
        for i in range(len(m.blocks)):
            # DTensor outputs: the model's own code splits the fused qkv by global shape
            plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel(use_local_output=False)
            plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel(use_local_output=False)
            plan[f"blocks.{i}.attn.proj"] = RowwiseParallel(use_local_output=True)
            plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel(use_local_output=True)
        if vocab_parallel:
            # the planner's layout for the embedding and the tied output layer: split over the
            # vocabulary, the embedding's partial output all-reduced, the logits all-gathered
            from torch.distributed.tensor import Replicate

            plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            # the logits all-gathered, or (`parallel_loss`, as the plan runs its loss) left split over
            # the vocabulary for torch's `loss_parallel` cross-entropy
            plan["head.out"] = ColwiseParallel(use_local_output=False) if parallel_loss else \
                ColwiseParallel(output_layouts=Replicate())
        net = parallelize_module(m, mesh, plan)
        if vocab_parallel:
            m.head.out.weight = m.embed.tok.weight        # parallelize_module distributes each copy apart
        rows = slice(0, gbs)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)

    def step(s: int) -> None:
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        tok, tgt = b.batch_fn(s, gbs, seed)
        with loss_parallel() if parallel_loss else contextlib.nullcontext():
            loss = net(tok[rows], tgt[rows])
            if hasattr(loss, "full_tensor"):
                loss = loss.full_tensor()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _autopar(plan, model_ref: str, seed: int, count: bool):
    from autopar.models import build_model
    from autopar.models.registry import call_batch_fn
    from autopar.runtime.counting import CollectiveCounter
    from autopar.runtime.engine import ParallelModel

    b = build_model(model_ref, device="meta")
    pm = ParallelModel(plan, b, seed=seed)
    counter = CollectiveCounter() if count else None

    def step(s: int) -> None:
        batch = call_batch_fn(b.batch_fn, s, plan.global_batch_size, seed)
        if counter is not None:
            counter.reset()
        # as `autopar run` runs the steps of its median (memory not tracked there)
        pm.train_step(batch, counter=counter, exact_memory=False)

    return step


def worker(args) -> None:
    import torch.distributed as dist

    from autopar.runtime.worker import init_distributed

    init_distributed()
    plans = _plans(args.model, dist.get_world_size(), args.batch, args.tp_plan)
    res = {}
    for kind in ("dp", "zero3", "tp"):
        fns = {"hand": _hand(kind, args.model, args.batch, 0),
               "autopar": _autopar(plans[kind], args.model, 0, count=False),
               "autopar_counting": _autopar(plans[kind], args.model, 0, count=True)}
        if kind == "tp" and _vocab_parallel(plans[kind]):
            fns["hand_same_layout"] = _hand(kind, args.model, args.batch, 0, vocab_parallel=True)
            fns["hand_parallel_loss"] = _hand(kind, args.model, args.batch, 0, vocab_parallel=True,
                                              parallel_loss=True)
        res[kind] = _timeit(fns, args.steps)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--tp-plan", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        from autopar.runtime.worker import hard_exit

        hard_exit(0)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from autopar.runtime import _free_port

    out = f"/tmp/autopar-overhead-{uuid.uuid4().hex[:6]}.json"
    tp_path = f"/tmp/autopar-overhead-tp-{uuid.uuid4().hex[:6]}.json"
    _tp_plan(args.model, args.nproc, args.batch, tp_path)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = str(ROOT)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=uuid.uuid4().hex[:8],
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                       monitor_interval=0.1)
    elastic_launch(cfg, sys.executable)(str(Path(__file__).resolve()), "--worker", "--out", out,
                                        "--model", args.model, "--batch", str(args.batch),
                                        "--steps", str(args.steps), "--tp-plan", tp_path)
    os.unlink(tp_path)
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    print(f"{args.model}, global batch {args.batch}, {args.nproc} CPU processes (gloo), median step time")
    print(f"{'layout':8} {'hand-written':>14} {'autopar':>10} {'overhead':>9} {'+counting':>10} {'overhead':>9}")
    names = {"dp": "DDP", "zero3": "fully_shard", "tp": "parallelize_module"}
    for what in ("wall", "cpu"):
        if what == "cpu":
            print("CPU time per step (time.process_time, rank 0), median")
        for k, v in res.items():
            v = v if what == "wall" else v.get("cpu", {})
            if not v:
                continue
            h, a, c = v["hand"], v["autopar"], v["autopar_counting"]
            print(f"{k:8} {h * 1e3:11.1f} ms {a * 1e3:7.1f} ms {100 * (a / h - 1):+8.1f}% {c * 1e3:7.1f} ms "
                  f"{100 * (c / h - 1):+8.1f}%   (vs {names[k]})")
            if "hand_same_layout" in v:
                h2 = v["hand_same_layout"]
                print(f"{'':8} {h2 * 1e3:11.1f} ms {a * 1e3:7.1f} ms {100 * (a / h2 - 1):+8.1f}% {c * 1e3:7.1f} ms "
                      f"{100 * (c / h2 - 1):+8.1f}%   (vs {names[k]} in the plan's layout: embedding and "
                      f"output layer split over the vocabulary)")
            if "hand_parallel_loss" in v:
                h3 = v["hand_parallel_loss"]
                print(f"{'':8} {h3 * 1e3:11.1f} ms {a * 1e3:7.1f} ms {100 * (a / h3 - 1):+8.1f}% {c * 1e3:7.1f} ms "
                      f"{100 * (c / h3 - 1):+8.1f}%   (the same, its cross-entropy vocabulary-parallel as the "
                      f"plan's: torch's loss_parallel)")

if __name__ == "__main__":
    main()
