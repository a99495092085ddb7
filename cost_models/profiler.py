"""Measure the machine this runs on and write a cluster profile (`autopar profile -o FILE`).

One "device" is one process: a GPU each when CUDA is available (NCCL), otherwise a CPU process
with its share of the cores (gloo over loopback). All processes run every measurement at once, so
the figures include the contention a real run sees (shared memory bus, shared cores):
- GEMM throughput: square matmuls over a range of sizes, fp32 and bf16; the peak is the best
  measured rate, the efficiency curve is each size's rate over that peak;
- memory bandwidth: a large tensor copy (bytes read + written per second);
- kernel overhead: per op of a chain of one-element ops run forward and backward under autograd;
- element-wise, normalisation and loss ops: forward and backward FLOP/s (the backward kernels of
  these ops run at their own rates, which the cost model would otherwise take from the forward);
- a linear layer's backward over forward time (the weight gradient's transposed GEMM and the bias
  sum run below the forward's rate);
- fused attention (scaled_dot_product_attention): forward and backward FLOP/s per dtype at a few
  (sequence, head dim) sizes (on a CPU it runs far below the GEMM rate);
- the optimizer step as the runtime runs it (AdamW, one tensor at a time): seconds per parameter
  tensor and per element;
- collectives: all_reduce, all_gather, reduce_scatter, all_to_all and send/recv over a range of
  sizes (kept as the link's measured table, which overrides the alpha-beta formulas); the link's
  bandwidth is the bus bandwidth of the largest all_reduce, its latency from the smallest.
The result is a YAML profile in the bundled format (`ClusterSpec.load` reads it), every figure
with a source saying how it was measured, written atomically (temp file + rename).
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from autopar.schema.cluster import (
    AlignmentPoint,
    AttentionPoint,
    ClusterSpec,
    DeviceSpec,
    EfficiencyPoint,
    LinkSpec,
    MeasuredCollective,
    OptimizerCost,
)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# timing windows per measurement; the best is kept (other work on the machine only adds time, and
# on a shared machine five short windows find a quiet one more often than three long ones)
WINDOWS = 5


def _plan(quick: bool, cuda: bool) -> dict[str, Any]:
    """What to measure: sizes and time budgets (quick mode: a few points, for tests)."""
    if cuda:
        return dict(gemm=[256, 512, 1024, 2048, 4096, 8192], dtypes=["fp32", "bf16"], align=4096,
                    coll=[2 ** k for k in range(10, 31, 2)], copy_bytes=1 << 30, min_time=0.05,
                    vector_elems=1 << 26, opt_hidden=2048, linear=(8192, 4096, 16384),
                    attention=[(512, 64), (1024, 64), (2048, 128), (4096, 128)], attention_flops=2.0 ** 36)
    if quick:
        return dict(gemm=[32, 128, 384], dtypes=["fp32", "bf16"], coll=[1 << 10, 1 << 16, 1 << 20, 1 << 22],
                    copy_bytes=16 << 20, min_time=0.03, vector_elems=1 << 18, opt_hidden=256,
                    linear=(1024, 256, 1024), attention=[(64, 32), (256, 64)], attention_flops=2.0 ** 25)
    return dict(gemm=[32, 64, 128, 256, 512, 1024, 2048], dtypes=["fp32", "bf16"],
                coll=[1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22, 1 << 24, 1 << 26], copy_bytes=256 << 20,
                min_time=0.1, vector_elems=1 << 20, opt_hidden=256, linear=(1024, 256, 1024),
                attention=[(64, 32), (128, 64), (256, 64), (512, 64), (1024, 128)], attention_flops=2.0 ** 26)


def _timeit(fn, min_time: float, sync=lambda: None, max_reps: int = 10_000, windows: int = WINDOWS) -> float:
    """Seconds per call of `fn`: one warm-up call, then `windows` timing windows of repeated calls
    (each at least min_time/windows); the best window, as `timeit` does, since interference from
    other work on the machine only ever adds time."""
    fn()
    sync()
    best = math.inf
    for _ in range(windows):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            if reps >= max_reps // windows or time.perf_counter() - t0 >= min_time / windows:
                sync()
                el = time.perf_counter() - t0
                if el >= min_time / windows or reps >= max_reps // windows:
                    break
        best = min(best, el / reps)
    return best


def _timeit_collective(fn, min_time: float, sync, dist: Any, torch: Any, dev: Any, max_reps: int = 500) -> float:
    """Seconds per call of collective `fn`; every rank must make the same number of calls, so the
    repeat count comes from rank 0's first timing (broadcast)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = time.perf_counter() - t0
    reps = torch.tensor([min(max_reps, max(1, int(min_time / WINDOWS / max(one, 1e-7))))], device=dev)
    dist.broadcast(reps, 0)
    n = int(reps.item())
    best = math.inf
    for _ in range(WINDOWS):     # the best window, as in `_timeit`
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _worker(rank: int, world: int, port: int, plan: dict, threads: int, q: Any) -> None:
    """One device: measure compute and memory, then the collectives with the others; rank 0
    reports results on `q` as (tag, payload) tuples."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)   # *_into_tensor renames in new torch
    torch.set_num_threads(max(1, threads))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    report = (lambda tag, payload: q.put((tag, payload))) if rank == 0 else (lambda tag, payload: None)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        # compute: every process at once, so shared cores / memory bus are accounted for
        _measure_gemm(plan, dev, sync, dist.barrier, report)
        _measure_copy(plan, dev, sync, dist.barrier, report)
        _measure_vector(plan, dev, sync, dist.barrier, report)
        _measure_overhead(plan, dev, sync, report)
        _measure_linear(plan, dev, sync, dist.barrier, report)
        _measure_attention(plan, dev, sync, dist.barrier, report)
        _measure_optimizer(plan, dev, sync, dist.barrier, report)
        _measure_collectives(plan, dev, sync, world, rank, report)
        report("done", None)
    finally:
        dist.destroy_process_group()


_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _measure_gemm(plan: dict, dev: Any, sync, barrier, report) -> None:
    """Square torch.mm per dtype and size: reports (dtype, n, FLOPs, seconds)."""
    import torch

    for dt in plan["dtypes"]:
        for n in plan["gemm"]:
            a = torch.randn(n, n, device=dev).to(getattr(torch, _DTYPES[dt]))
            b = torch.randn(n, n, device=dev).to(getattr(torch, _DTYPES[dt]))
            barrier()
            s = _timeit(lambda a=a, b=b: torch.mm(a, b), plan["min_time"], sync)
            report("gemm", (dt, n, 2.0 * n ** 3, s))
    n = plan.get("align")
    if n:
        _measure_alignment(n, plan, dev, sync, barrier, report)


# output widths of the alignment probe, n + d for n a multiple of 16: 2-byte elements aligned to
# 16 bytes (8), 2 (1: odd), 4 (2) and 8 (4)
_ALIGN_OFFSETS = (8, 1, 2, 4)


def _measure_alignment(n: int, plan: dict, dev: Any, sync, barrier, report) -> None:
    """bf16 torch.mm of (n x n) by (n x n+d) for each offset d (`_ALIGN_OFFSETS`; cuBLAS takes
    slower kernels below 16 bytes): reports (bytes of alignment of the width, at most 16, FLOPs,
    seconds); `_build_spec` turns them into `DeviceSpec.gemm_alignment`."""
    import torch

    from cost_models.compute import alignment_bytes

    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    for d in _ALIGN_OFFSETS:
        b = torch.randn(n, n + d, device=dev).to(torch.bfloat16)
        barrier()
        s = _timeit(lambda b=b: torch.mm(a, b), plan["min_time"], sync)
        report("gemm_align", (min(alignment_bytes(n + d, 2), 16), 2.0 * n * n * (n + d), s))


def _measure_copy(plan: dict, dev: Any, sync, barrier, report) -> None:
    """A large tensor copy: reports (bytes read + written, seconds)."""
    import torch

    nel = plan["copy_bytes"] // 4
    src = torch.randn(nel, device=dev)
    dst = torch.empty_like(src)
    barrier()
    s = _timeit(lambda: dst.copy_(src), plan["min_time"], sync)
    report("copy", (2.0 * nel * 4, s))


def _vector_ops(n: int, dev: Any) -> list[tuple[tuple[str, ...], Any, list]]:
    """The measured element-wise / normalisation / loss ops on `n` fp32 elements: (ATen names,
    forward function, leaf tensors its backward differentiates). Rows are 1024 wide (a typical
    hidden or vocabulary width); the layer norm has a weight and bias, as models use it."""
    import torch
    import torch.nn.functional as F

    def leaf(*shape: int) -> Any:
        return torch.randn(*shape, device=dev).requires_grad_()

    vec, rows = leaf(n), leaf(n // 1024, 1024)
    w, b = leaf(1024), leaf(1024)
    labels = torch.randint(0, 1024, (n // 1024,), device=dev)
    return [(("gelu",), lambda: F.gelu(vec, approximate="tanh"), [vec]),
            (("softmax", "_softmax"), lambda: torch.softmax(rows, -1), [rows]),
            (("log_softmax", "_log_softmax"), lambda: torch.log_softmax(rows, -1), [rows]),
            (("cross_entropy_loss",), lambda: F.cross_entropy(rows, labels), [rows]),
            (("layer_norm", "native_layer_norm"), lambda: F.layer_norm(rows, (1024,), w, b), [rows, w, b]),
            (("silu",), lambda: F.silu(vec), [vec]),
            (("tanh",), lambda: torch.tanh(vec), [vec]),
            (("exp",), lambda: torch.exp(vec), [vec])]


def _backward_timer(fn, leaves: list) -> Any:
    """A zero-argument function running the backward of one `fn()` (graph kept between calls)."""
    import torch

    y = fn()
    g = torch.ones_like(y)
    return lambda: torch.autograd.grad(y, leaves, g, retain_graph=True)


def _measure_vector(plan: dict, dev: Any, sync, barrier, report) -> None:
    """Forward and backward FLOP/s of element-wise, normalisation and loss ops, FLOPs counted as
    the capture counts them (`PER_ELEMENT`, the backward's as the forward's). The backward's
    fixed cost (the autograd engine's call, measured on a 1024-element copy of the op and
    subtracted) is left out: the cost model adds a kernel overhead per op itself.
    Reports ({name: forward rate}, elements) and ({name: backward rate}, elements)."""
    import torch

    from autopar.capture.flops import PER_ELEMENT

    n = plan["vector_elems"]
    fwd, bwd = {}, {}
    with torch.no_grad():
        for names, fn, _ in _vector_ops(n, dev):
            barrier()
            rate = PER_ELEMENT[names[0]] * n / _timeit(fn, plan["min_time"] / 4, sync)
            fwd.update({k: rate for k in names})
    report("vector", (fwd, n))
    tiny = {names: (fn, leaves) for names, fn, leaves in _vector_ops(1024, dev)}
    for names, fn, leaves in _vector_ops(n, dev):
        barrier()
        t = _timeit(_backward_timer(fn, leaves), plan["min_time"] / 4, sync)
        t0 = _timeit(_backward_timer(*tiny[names]), plan["min_time"] / 8, sync)
        net = max(t - t0, 0.5 * t)
        bwd.update({k: PER_ELEMENT[names[0]] * n / net for k in names})
    report("vector_bwd", (bwd, n))


def _measure_overhead(plan: dict, dev: Any, sync, report) -> None:
    """Per-kernel overhead as a training step pays it: eager dispatch plus autograd recording
    in the forward and the engine's call in the backward, averaged over both passes."""
    import torch

    leaf = torch.ones(1, device=dev, requires_grad=True)
    chain = 64

    def fwd_bwd() -> None:
        y = leaf
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    s = _timeit(fwd_bwd, plan["min_time"] / 2, sync, max_reps=500)
    report("overhead", s / (2 * (chain + 1)))


def _measure_linear(plan: dict, dev: Any, sync, barrier, report) -> None:
    """A linear layer with bias (fp32) at the plan's (tokens, in, out) shape: forward and backward
    (input and weight gradients, bias sum) seconds. Reports (shape, forward s, backward s)."""
    import torch
    import torch.nn.functional as F

    m, k, n = plan["linear"]
    x, w, b = (torch.randn(*shape, device=dev).requires_grad_() for shape in ((m, k), (n, k), (n,)))
    fn = lambda: F.linear(x, w, b)  # noqa: E731
    barrier()
    with torch.no_grad():
        tf = _timeit(fn, plan["min_time"] / 4, sync)
    tb = _timeit(_backward_timer(fn, [x, w, b]), plan["min_time"] / 4, sync)
    report("linear", ((m, k, n), tf, tb))


def _measure_attention(plan: dict, dev: Any, sync, barrier, report) -> None:
    """The fused attention kernel (causal scaled_dot_product_attention, as decoders run it) per
    dtype and (sequence, head dim): forward and backward seconds of `heads` slices. Reports
    (dtype, forward FLOPs per slice 4*s*s*d, forward FLOPs, forward s, backward s)."""
    import torch
    import torch.nn.functional as F

    for dt in plan["dtypes"]:
        for seq, d in plan["attention"]:
            per_head = 4.0 * seq * seq * d
            heads = max(1, int(plan["attention_flops"] // per_head))
            q, k, v = (torch.randn(1, heads, seq, d, device=dev).to(getattr(torch, _DTYPES[dt])).requires_grad_()
                       for _ in range(3))
            fn = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            barrier()
            with torch.no_grad():
                tf = _timeit(fn, plan["min_time"] / 4, sync)
            tb = _timeit(_backward_timer(fn, [q, k, v]), plan["min_time"] / 4, sync)
            report("attention", (dt, per_head, per_head * heads, tf, tb))


def _measure_optimizer(plan: dict, dev: Any, sync, barrier, report) -> None:
    """One step of the runtime's optimizer (`autopar.runtime.engine.default_optimizer`: AdamW,
    fused on CUDA, elsewhere one tensor at a time) over many one-element tensors (the per-tensor cost) and
    over the parameters of one GPT layer of width `opt_hidden` (the per-element cost, less their
    per-tensor cost). Reports (per-tensor s, per-element s, the layer's width)."""
    import torch

    from autopar.runtime.engine import default_optimizer

    def step_time(sizes: list[int]) -> float:
        params = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = default_optimizer(params)
        barrier()
        return _timeit(opt.step, plan["min_time"] / 4, sync)

    tensors, h = 64, plan["opt_hidden"]
    per_tensor = step_time([1] * tensors) / tensors
    layer = _layer_param_sizes(h)
    per_elem = max(step_time(layer) - len(layer) * per_tensor, 0.0) / sum(layer)
    report("optimizer", (per_tensor, per_elem, h))


def _layer_param_sizes(h: int) -> list[int]:
    """Element counts of one GPT layer's parameter tensors at hidden width `h` (two layer norms,
    QKV and output projections, a 4h MLP, weights and biases): the sizes an optimizer step walks."""
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]


def _measure_collectives(plan: dict, dev: Any, sync, world: int, rank: int, report) -> None:
    """Every collective kind over the plan's sizes, the slowest rank's time; kinds the backend
    lacks are reported as unsupported."""
    import torch
    import torch.distributed as dist

    for kind in KINDS:
        ok = True
        for nbytes in plan["coll"]:
            if not ok:
                break
            nel = max(world, nbytes // 4 // world * world)
            x = torch.ones(nel, device=dev)
            try:
                fn = _collective(kind, x, world, rank, dist, torch)
                s = _timeit_collective(fn, plan["min_time"], sync, dist, torch, dev)
                # the slowest rank's time is the collective's time
                t = torch.tensor([s], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                report("coll", (kind, world if kind != "send_recv" else 2, float(nel * 4), float(t.item())))
            except (RuntimeError, NotImplementedError, ValueError) as e:
                ok = False
                report("unsupported", (kind, str(e).splitlines()[0][:120] if str(e) else type(e).__name__))
                dist.barrier()


def _collective(kind: str, x: Any, world: int, rank: int, dist: Any, torch: Any):
    """A zero-argument function running one `kind` collective on `x` (the whole buffer)."""
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        part = x[: x.numel() // world].clone()
        out = torch.empty_like(x)
        return lambda: dist.all_gather_into_tensor(out, part)
    if kind == "reduce_scatter":
        out = torch.empty(x.numel() // world, device=x.device)
        return lambda: dist.reduce_scatter_tensor(out, x)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    if kind == "send_recv":
        # ping-pong between ranks 0 and 1; one direction is half the round trip
        def pingpong() -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
        return pingpong
    raise ValueError(kind)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _total_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8.0 * 2 ** 30


def profile_machine(output: Path, *, num_processes: int | None = None, quick: bool = False,
                    progress: bool = True) -> ClusterSpec:
    """Measure this machine (see the module docstring) and write its profile to `output` (YAML).

    `num_processes`: devices to measure (default: every GPU, else 2 CPU processes; with one, the
    link figures are placeholders and no collective is measured). `quick`: a few
    sizes only (for tests, < 30 s on 2 cores). `progress`: a rich progress bar on stderr.
    Returns the ClusterSpec that was written."""
    import torch
    import torch.multiprocessing as mp

    output = Path(output)
    cuda = torch.cuda.is_available()
    n = int(num_processes or (torch.cuda.device_count() if cuda else 2))
    if n < 1:
        raise ValueError(f"num_processes must be >= 1, got {n}")
    cores = os.cpu_count() or 1
    threads = max(1, cores // n) if not cuda else 1
    plan = _plan(quick, cuda)
    if n == 1:
        plan["coll"] = []         # one device: nothing to communicate with
    total_steps = (len(plan["dtypes"]) * (len(plan["gemm"]) + len(plan["attention"])) + 6
                   + (len(_ALIGN_OFFSETS) if plan.get("align") else 0)
                   + len(KINDS) * len(plan["coll"]))
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    t_start = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, n, port, plan, threads, q), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[str, list] = {"gemm": [], "gemm_align": [], "copy": [], "vector": [], "vector_bwd": [],
                                "overhead": [], "attention": [], "optimizer": [], "linear": [], "coll": [],
                                "unsupported": []}

    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]profiling[/] {task.description}"), BarColumn(),
                       TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=False)
        bar.start()
        task = bar.add_task("starting processes", total=total_steps)
    try:
        done = False
        while not done:
            if q.empty():
                if not any(p.is_alive() for p in procs):
                    break
                time.sleep(0.02)
                continue
            tag, payload = q.get()
            if tag == "done":
                done = True
                continue
            results[tag].append(payload)
            if bar is not None:
                desc = _describe(tag, payload)
                skip = len(plan["coll"]) - sum(1 for c in results["coll"] if c[0] == payload[0]) \
                    if tag == "unsupported" else 0
                bar.update(task, advance=1 + max(skip - 1, 0), description=desc)
        for p in procs:
            p.join(timeout=30)
    finally:
        if bar is not None:
            bar.stop()
        for p in procs:
            if p.is_alive():
                p.terminate()
    if not done:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"profiling processes exited early (exit codes {codes}); "
                           f"check that torch.distributed ({'nccl' if cuda else 'gloo'}) works here")
    spec = _build_spec(results, n, cuda, threads, time.perf_counter() - t_start, quick)
    _write_yaml(output, spec)
    return spec


def _describe(tag: str, p: Any) -> str:
    """The progress bar's text for a finished measurement."""
    return {"gemm": lambda: f"GEMM {p[0]} {p[1]}^3", "copy": lambda: "memory bandwidth",
            "overhead": lambda: "kernel overhead", "vector": lambda: "element-wise ops",
            "vector_bwd": lambda: "element-wise backward", "attention": lambda: f"attention {p[0]}",
            "optimizer": lambda: "optimizer step", "linear": lambda: "linear backward",
            "coll": lambda: f"{p[0]} {int(p[2])} B",
            "unsupported": lambda: f"{p[0]} unsupported"}[tag]()


def _measured_costs(res: dict[str, list], how: str) -> tuple[dict[str, Any], dict[str, str]]:
    """DeviceSpec fields (and their sources) for what the formulas would otherwise guess: the
    element-wise backward rates, the fused attention rates, the optimizer step's cost."""
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if res.get("vector_bwd"):
        rates, n = res["vector_bwd"][0]
        fields["op_backward_flops"] = dict(rates)
        sources["op_backward_flops"] = (
            f"{how}: backward (torch.autograd.grad) of each op on {n} fp32 elements, less its time on "
            f"1024 elements (the engine's fixed cost), FLOPs counted as the forward's")
    if res.get("linear"):
        (m, k, n), tf, tb = res["linear"][0]
        fields["matmul_backward_ratio"] = tb / tf
        sources["matmul_backward_ratio"] = (
            f"{how}: torch.nn.functional.linear with bias, {m} x {k} -> {n} fp32, backward "
            f"(torch.autograd.grad: input and weight gradients, bias sum) over forward seconds")
    if res.get("attention"):
        table: dict[str, list[AttentionPoint]] = {}
        for dt, per_head, flops, tf, tb in res["attention"]:
            table.setdefault(dt, []).append(AttentionPoint(
                flops_per_head=per_head, forward_flops=flops / tf, backward_flops=2.5 * flops / tb))
        fields["attention_flops"] = {dt: sorted(pts, key=lambda p: p.flops_per_head) for dt, pts in table.items()}
        sources["attention_flops"] = (
            f"{how}: causal torch scaled_dot_product_attention forward and backward (torch.autograd.grad) "
            f"per dtype and (sequence, head dim), FLOPs 4*b*h*s*s*d (causality not discounted), "
            f"the backward's 2.5x that")
    if res.get("gemm_align"):
        rates = {align: flops / sec for align, flops, sec in res["gemm_align"]}
        if 16 in rates and len(rates) > 1:
            fields["gemm_alignment"] = [AlignmentPoint(bytes=b, efficiency=min(1.0, r / rates[16]))
                                        for b, r in sorted(rates.items())]
            sources["gemm_alignment"] = (
                f"{how}: bf16 torch.mm of n x n by n x N, N = n + {', '.join(map(str, _ALIGN_OFFSETS))} for n a "
                f"multiple of 16 (16, 2, 4 and 8 bytes of alignment), each rate over the aligned one")
    if res.get("optimizer"):
        per_tensor, per_elem, h = res["optimizer"][0]
        fields["optimizer_step"] = OptimizerCost(per_tensor_s=per_tensor, per_element_s=per_elem)
        sources["optimizer_step"] = (
            f"{how}: the runtime's AdamW step (engine.default_optimizer: fused on CUDA, else one tensor at a "
            f"time) over 64 "
            f"one-element tensors (per tensor) and over the parameters of a GPT layer of width {h} "
            f"({sum(_layer_param_sizes(h))} elements in {len(_layer_param_sizes(h))} tensors; per element, "
            f"less their per-tensor cost)")
    return fields, sources


def _build_spec(res: dict[str, list], n: int, cuda: bool, threads: int, elapsed: float, quick: bool) -> ClusterSpec:
    import torch

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = f"measured by cost_models.profiler ({'quick' if quick else 'full'} mode) on {when}, " \
          f"{n} processes at once"
    peaks: dict[str, float] = {}
    curves: dict[str, list[EfficiencyPoint]] = {}
    for dt in sorted({g[0] for g in res["gemm"]}):
        pts = [(f, f / s) for d, _, f, s in res["gemm"] if d == dt]
        peak = max(r for _, r in pts)
        peaks[dt] = peak
        curves[dt] = [EfficiencyPoint(flops=f, efficiency=min(1.0, max(r / peak, 1e-6))) for f, r in sorted(pts)]
    sizes = sorted({g[1] for g in res["gemm"]})
    copy_bytes, copy_s = res["copy"][0]
    mem_bw = copy_bytes / copy_s
    overhead = res["overhead"][0] if res["overhead"] else 5e-6
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name, mem = props.name.lower().replace(" ", "-"), float(props.total_memory)
        mem_src = "torch.cuda.get_device_properties(0).total_memory"
    else:
        name = f"cpu-process-{threads}t"
        mem = _total_memory_bytes() / n
        mem_src = f"physical memory (os.sysconf) divided by {n} processes"
    extra, extra_sources = _measured_costs(res, how)
    device = DeviceSpec(
        name=name, device_type="cuda" if cuda else "cpu", peak_flops=peaks, memory_bytes=mem,
        memory_bandwidth=mem_bw, gemm_efficiency=curves,
        memory_efficiency=1.0, kernel_overhead_s=overhead,
        vector_flops=(sorted(res["vector"][0][0].values())[len(res["vector"][0][0]) // 2]
                      if res.get("vector") else None),
        op_flops=dict(res["vector"][0][0]) if res.get("vector") else {},
        sources={
            "device_type": "the device the profiler ran on (torch.cuda.is_available())",
            "peak_flops": f"{how}: best rate of square torch.mm over n in {sizes} per dtype"
                          + ("" if cuda else f", {threads} thread(s) per process"),
            "gemm_efficiency": f"{how}: each size's torch.mm rate over the dtype's peak",
            "memory_bytes": mem_src,
            "memory_bandwidth": (f"{how}: torch copy_ of {copy_bytes / 2 / 2**20:.0f} MiB, "
                                 "bytes read + written per second"),
            "memory_efficiency": "1.0: memory_bandwidth is already the achieved copy bandwidth",
            "vector_flops": f"{how}: median of op_flops",
            "op_flops": f"{how}: each op on {res['vector'][0][1] if res.get('vector') else 0} fp32 "
                        f"elements, FLOPs per element as the capture counts them",
            "kernel_overhead_s": f"{how}: per op of a 64-op chain on a one-element tensor, forward with "
                                 f"autograd plus backward, over both passes",
            **extra_sources,
        },
        **extra)
    measured = [MeasuredCollective(kind=k, num_devices=nd, bytes=b, seconds=s) for k, nd, b, s in res["coll"]]
    from cost_models.communication import bus_factor

    ar = sorted((b, s) for k, _, b, s in res["coll"] if k == "all_reduce")
    if ar:
        bw = bus_factor("all_reduce", n) * ar[-1][0] / ar[-1][1]
        lat = ar[0][1] / (2 * (n - 1))
        bw_src = f"{how}: bus bandwidth of the largest all_reduce ({int(ar[-1][0])} B), 2(n-1)/n * S / t"
        lat_src = f"{how}: smallest all_reduce ({int(ar[0][0])} B) time / 2(n-1)"
    else:  # one device: no link to measure
        bw, lat = mem_bw / 2, overhead
        bw_src = "one device, no link: placeholder, half the measured copy bandwidth (a device-local copy)"
        lat_src = "one device, no link: placeholder, the measured kernel overhead"
    unsupported = {k: why for k, why in res["unsupported"]}
    link_sources = {"bandwidth": bw_src, "latency": lat_src}
    if measured:
        link_sources["measured"] = (f"{how}: {'NCCL' if cuda else 'gloo over loopback'}, slowest rank's time "
                                    f"per call, best of {WINDOWS} windows")
    if unsupported:
        link_sources["unsupported"] = "; ".join(f"{k}: {v}" for k, v in unsupported.items())
    link = LinkSpec(bandwidth=bw, latency=lat, measured=measured, sources=link_sources)
    host = platform.node() or "this machine"
    return ClusterSpec(
        name=f"{host}-{'cuda' if cuda else 'cpu'}", num_nodes=1, devices_per_node=n, device=device,
        intra_node=link,
        description=(f"measured on {host} ({platform.processor() or platform.machine()}, "
                     f"{os.cpu_count()} cores, torch {torch.__version__}) in {elapsed:.0f} s; "
                     f"{n} {'GPUs' if cuda else 'CPU processes'} as devices"),
        sources={"all": how})


def _write_yaml(path: Path, spec: ClusterSpec) -> None:
    from autopar.schema.plan import write_atomic

    data = spec.model_dump(mode="json", exclude_none=True)
    header = ("# Profile written by `autopar profile` (cost_models.profiler): every figure measured on\n"
              "# this machine; see `sources`. Units: FLOP/s, bytes, bytes/s per device and direction, s.\n")
    write_atomic(path, header + yaml.safe_dump(data, sort_keys=False, width=120))
