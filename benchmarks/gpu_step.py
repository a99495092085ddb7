"""Predicted against measured on one GPU: step time and peak memory of plans run with `autopar run`.

Each case is planned for one device of a bundled cluster profile (`--cluster`, default dgx-h100
with one node of one device), run on the GPU with `autopar run` (NCCL, bf16 parameters with fp32
master weights, the autopar software profile: fused attention), and compared with the plan's
prediction: the median step after the first against `predicted.iteration_time_s`, and
`torch.cuda.max_memory_allocated` against `predicted.peak_memory_bytes`.

    python benchmarks/gpu_step.py plan --out DIR                  # plan every case (any machine)
    python benchmarks/gpu_step.py run --out DIR [--steps 6]       # run the plans in DIR (a GPU)
    python benchmarks/gpu_step.py profile --out DIR --only NAME   # torch.profiler ops of one case
    python benchmarks/gpu_step.py optimizer --out DIR --only NAME # AdamW variants on a case's parameters
    python benchmarks/gpu_step.py gemm --out DIR                  # bf16 GEMMs, aligned against not
    python benchmarks/gpu_step.py wgrad --out DIR                 # NeMo 175B's GEMMs, wgrad into fp32 too
    python benchmarks/gpu_step.py memory --out DIR --only NAME    # what the peak holds, tensor by tensor
    python benchmarks/gpu_step.py breakdown --out DIR --only NAME [--cluster P]  # predicted time by op
    python benchmarks/gpu_step.py report --out DIR [--metrics M] [--cluster P]  # the table (plans made
                                                                  # where missing; M: measured summaries,
                                                                  # e.g. benchmarks/results/h100-2026-11-25/
                                                                  # after); with P (e.g. a profile
                                                                  # measured by `autopar profile`) the
                                                                  # same layouts re-predicted on it

Planning and reporting need no GPU: the device only runs the steps. Collective counting is off
while timing (CommDebugMode dispatches every op through Python; one device has no collectives).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 2 ** 30

# name, model reference, global batch, pinned options (none: the planner chooses)
CASES: list[tuple[str, str, int, list[str]]] = [
    ("gpt3-350m", "gpt3-350m", 16, []),
    ("gpt3-1.3b", "gpt3-1.3b", 16, []),
    ("gpt3-1.3b-mb4-none", "gpt3-1.3b", 16, ["--microbatch-size", "4", "--recompute", "none"]),
    ("gpt3-1.3b-mb4-full", "gpt3-1.3b", 16, ["--microbatch-size", "4", "--recompute", "full"]),
    ("gpt3-1.3b-mb4-selective", "gpt3-1.3b", 16, ["--microbatch-size", "4", "--recompute", "selective"]),
    ("gpt3-2.7b", "gpt3-2.7b", 16, []),
    ("llama-1b", "gpu_step:llama_1b", 16, []),
    ("gpt2-medium", "gpt2-medium", 32, []),
    ("bert-large", "bert-large", 64, []),
]


def llama_1b():
    """A Llama-3.2-1B-shaped zoo Llama (h 2048, 16 layers, 32 heads, 8 KV heads, ffn 8192,
    vocabulary 128256, untied head) at sequence 4096: a Llama that fits one 80 GB device.

    Its attention is the one the H100 measurement ran (benchmarks/results/h100-2026-11-25):
    K and V repeated over the query heads before SDPA (`RepeatKVAttention`, two [b, 32, s, d]
    copies saved a layer, `memory_llama-1b.txt`). The zoo's Llama has since run grouped-query
    attention inside SDPA (`enable_gqa`, a272bca), a different program: 1.5 GiB less at this
    case's peak (the copies gone, the 8-head K and V saved instead). A report re-plans the
    measured program; measuring the zoo's attention is a new case with a new measurement."""
    import torch

    from autopar.models.configs import LlamaConfig
    from autopar.models.llama import Llama, RepeatKVAttention
    from autopar.models.registry import ModelBundle, token_batch, token_inputs

    cfg = LlamaConfig(vocab_size=128256, seq_len=4096, hidden=2048, layers=16, heads=32, kv_heads=8,
                      ffn_hidden=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.layers:
        block.attn.__class__ = RepeatKVAttention
    return ModelBundle("llama-1b", model, token_inputs(cfg.seq_len)(1), token_batch(cfg.vocab_size, cfg.seq_len),
                       "Llama-3.2-1B-shaped (h 2048, 16 layers, GQA 8, K and V repeated before SDPA)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    env["AUTOPAR_COUNT_COLLECTIVES"] = "0"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _cases(only: str | None) -> list[tuple[str, str, int, list[str]]]:
    if not only:
        return CASES
    names = only.split(",")
    unknown = set(names) - {c[0] for c in CASES}
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c[0] for c in CASES)}")
    return [c for c in CASES if c[0] in names]


def _autopar() -> list[str]:
    return [sys.executable, "-m", "autopar"]


def _cluster_args(cluster: str) -> list[str]:
    return ["--cluster", cluster, "--nodes", "1", "--devices-per-node", "1"]


def plan_cases(out: Path, cluster: str, only: str | None) -> None:
    (out / "plans").mkdir(parents=True, exist_ok=True)
    for name, model, batch, pins in _cases(only):
        dest = out / "plans" / f"{name}.json"
        cmd = _autopar() + ["plan", "--model", model, *_cluster_args(cluster), "-b", str(batch), *pins,
                            "-o", str(dest), "-q"]
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
        print(f"{name}: {'planned' if r.returncode == 0 else 'FAILED ' + r.stderr.strip()[-300:]}", flush=True)


def run_cases(out: Path, steps: int, only: str | None, timeout: float) -> None:
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    for name, model, _, _ in _cases(only):
        plan = out / "plans" / f"{name}.json"
        if not plan.exists():
            print(f"{name}: no plan", flush=True)
            continue
        metrics = out / "metrics" / f"{name}.jsonl"
        cmd = _autopar() + ["run", str(plan), "--model", model, "--steps", str(steps), "--metrics", str(metrics), "-q"]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
            rc, err = r.returncode, r.stderr
        except subprocess.TimeoutExpired as e:
            raw = e.stderr or b""
            rc, err = "timeout", raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        wall = time.perf_counter() - t0
        (out / "metrics" / f"{name}.stderr").write_text(err or "")
        status = "ok" if rc == 0 else f"FAILED rc={rc}: {(err or '').strip()[-400:]}"
        print(f"{name}: {status} ({wall:.0f} s)", flush=True)


def profile_case(out: Path, name: str, steps: int) -> None:
    """torch.profiler over one step after `steps` warm-up steps, in this process: the GPU time by
    op (and by input shape) written to DIR/profile_NAME.txt."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autopar.models.registry import build_model, call_batch_fn, default_batch_fn
    from autopar.runtime.engine import ParallelModel
    from autopar.runtime.worker import init_distributed
    from autopar.schema.plan import Plan

    case = next(c for c in CASES if c[0] == name)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    init_distributed()
    plan = Plan.from_json((out / "plans" / f"{name}.json").read_text())
    bundle = build_model(case[1], device="meta")
    pm = ParallelModel(plan, bundle, seed=0)
    batch_fn = bundle.batch_fn or default_batch_fn(bundle.example_inputs)
    for step in range(steps):
        pm.train_step(pm.local_batch(call_batch_fn(batch_fn, step, plan.global_batch_size, 0)))
    torch.cuda.synchronize()
    batch = pm.local_batch(call_batch_fn(batch_fn, steps, plan.global_batch_size, 0))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        pm.train_step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    gpu_total = sum(e.device_time_total for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    free, total = torch.cuda.mem_get_info()
    alloc, reserved = torch.cuda.max_memory_allocated() / GiB, torch.cuda.max_memory_reserved() / GiB
    text = [f"case {name}: profiled step {wall:.4f} s wall, {gpu_total:.4f} s of GPU kernel time "
            f"(predicted {plan.predicted.iteration_time_s:.4f} s); memory GiB: max allocated "
            f"{alloc:.2f}, max reserved {reserved:.2f}, "
            f"device in use {(total - free) / GiB:.2f} of {total / GiB:.2f} (predicted peak "
            f"{plan.predicted.peak_memory_bytes / GiB:.2f}, usable {plan.predicted.usable_memory_bytes / GiB:.2f})",
            ka.table(sort_by="self_cuda_time_total", row_limit=40),
            prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=60)]
    (out / f"profile_{name}.txt").write_text("\n\n".join(text))
    print(text[0], flush=True)


def optimizer_case(out: Path, name: str) -> None:
    """AdamW over the fp32 master copies of a case's parameters (its real shapes), one step timed
    per variant: per-tensor (`foreach=False`, what the runtime runs), multi-tensor (`foreach=True`)
    and `fused=True`; with the memory each step allocates beyond its inputs."""
    import torch

    from autopar.models.registry import build_model

    case = next(c for c in CASES if c[0] == name)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    shapes = [tuple(p.shape) for p in build_model(case[1], device="meta").model.parameters()]
    lines = [f"case {name}: {len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e9:.3f} B params"]
    for label, kw in (("foreach=False", dict(foreach=False)), ("foreach=True", dict(foreach=True)),
                      ("fused=True", dict(fused=True))):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        opt.step()                        # allocates the moments
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        extra = torch.cuda.max_memory_allocated() - base
        lines.append(f"  {label:14s} median {sorted(times)[2] * 1e3:8.2f} ms  min {min(times) * 1e3:8.2f} ms  "
                     f"temporaries {extra / GiB:.3f} GiB")
        del params, opt
        torch.cuda.empty_cache()
    (out / f"optimizer_{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def memory_case(out: Path, name: str, top: int = 400) -> None:
    """One step tracked by category after a first (`runtime.memory_tracking.track_step`, as
    `autopar run` tracks with AUTOPAR_TRACK_MEMORY): the categories at the peak against the plan's
    prediction, and the `top` largest tensors alive at the peak, counted by (label, op, shape,
    dtype), written to DIR/memory_NAME.txt: what a device holds that the memory model does not."""
    import collections

    import torch

    from autopar.models.registry import build_model, call_batch_fn, default_batch_fn
    from autopar.runtime.engine import ParallelModel
    from autopar.runtime.memory_tracking import track_step
    from autopar.runtime.worker import init_distributed
    from autopar.schema.plan import Plan

    case = next(c for c in CASES if c[0] == name)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    device = init_distributed()
    plan = Plan.from_json((out / "plans" / f"{name}.json").read_text())
    bundle = build_model(case[1], device="meta")
    pm = ParallelModel(plan, bundle, seed=0)
    batch_fn = bundle.batch_fn or default_batch_fn(bundle.example_inputs)
    pm.train_step(pm.local_batch(call_batch_fn(batch_fn, 0, plan.global_batch_size, 0)))
    _, rep = track_step(pm, pm.local_batch(call_batch_fn(batch_fn, 1, plan.global_batch_size, 0)), top=top)
    if device.type == "cuda":
        torch.cuda.synchronize()
    st = plan.stages[0].predicted
    lines = [f"case {name} on {device.type}: tracked peak {rep.peak_bytes / GiB:.3f} GiB at {rep.peak_phase}, "
             f"predicted {st.peak_memory_bytes / GiB:.3f} GiB at {st.peak_phase}",
             "tracked GiB: " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in rep.categories.items()),
             f"predicted GiB: weights {st.weights_bytes / GiB:.3f}, gradients {st.gradients_bytes / GiB:.3f}, "
             f"optimizer {st.optimizer_bytes / GiB:.3f}, activations {st.activations_bytes / GiB:.3f}, "
             f"buffers {st.buffers_bytes / GiB:.3f}", f"the {top} largest tensors at the peak, by kind:"]
    kinds: collections.Counter = collections.Counter()
    size: dict = {}
    for t in rep.peak_tensors:
        k = (t.get("label"), t.get("op"), tuple(t.get("shape") or ()), t.get("dtype"), t.get("pass"))
        kinds[k] += 1
        size[k] = t.get("bytes", 0)
    for k, n in sorted(kinds.items(), key=lambda kv: -kv[1] * size[kv[0]]):
        lines.append(f"  {n:4d} x {size[k] / 2**20:9.2f} MiB  {k[0]:14s} {k[1]} {list(k[2])} {k[3]} {k[4]}")
    (out / f"memory_{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4]), flush=True)


GEMM_SHAPES = [  # (M, K, N): a language-model head at vocabularies 50257 (GPT-2), 50304 (padded), 51200,
    # 32000 and 128256, a projection with one ragged dimension of each kind, and aligned controls
    (32768, 1024, 50257), (32768, 1024, 50304), (32768, 1024, 51200), (16384, 2048, 32000), (16384, 2048, 128256),
    (8192, 2048, 8191), (8192, 2048, 8192), (8191, 2048, 8192), (8192, 2047, 8192), (8192, 2052, 8192),
    (8192, 4096, 4100), (8192, 4096, 4104), (8192, 4096, 4160), (4096, 4096, 4096), (4096, 4096, 4095),
]


def _cuda_rate(fn, flops: float) -> float:
    """TFLOP/s of `fn` doing `flops`: the median of 10 CUDA-event timings after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return flops / sorted(ts)[5] / 1e12


def gemm_alignment(out: Path) -> None:
    """bf16 `F.linear` forward (x @ w.T), input gradient (g @ w) and weight gradient (g.T @ x) of
    each (M, K, N) in GEMM_SHAPES: TFLOP/s of each, the median of 10 after 3 warm-ups."""
    import torch
    import torch.nn.functional as F

    rate = _cuda_rate
    lines = ["M K N: forward, input-gradient, weight-gradient TFLOP/s (bf16, torch " + torch.__version__ + ")"]
    for m, k, n in GEMM_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        f = 2.0 * m * k * n
        r = (rate(functools.partial(F.linear, x, w), f), rate(functools.partial(torch.matmul, g, w), f),
             rate(functools.partial(torch.matmul, g.t(), x), f))
        lines.append(f"{m} {k} {n}: {r[0]:.0f} {r[1]:.0f} {r[2]:.0f}")
        print(lines[-1], flush=True)
        del x, w, g
    (out / "gemm_alignment.txt").write_text("\n".join(lines) + "\n")


# NeMo GPT-3 175B's GEMMs on a rank of its published H100 runs (TP4, s 2048, mb 1, h 12288): tokens,
# input features, output features of qkv (12288 -> 9216), proj (3072 -> 12288) and fc1 / fc2 (12288 ->
# 12288); README "the NeMo 175B step's missing time"
NEMO_175B_TP4_GEMMS = [(2048, 12288, 9216), (2048, 3072, 12288), (2048, 12288, 12288)]


def wgrad_accum(out: Path) -> None:
    """bf16 forward, input gradient, weight gradient into bf16, and weight gradient added into an
    fp32 main_grad in place (`torch.addmm(main_grad, g.T, x, out_dtype=float32, out=main_grad)`: cuBLAS
    with beta = 1, as gradient_accumulation_fusion runs it) of each NEMO_175B_TP4_GEMMS shape:
    TFLOP/s of each, the median of 10 after 3 warm-ups (as `gemm_alignment`). Written to
    DIR/wgrad_accum.txt. Needs a torch whose addmm takes out_dtype (CUDA)."""
    import torch
    import torch.nn.functional as F

    rate = _cuda_rate
    lines = ["M K N: forward, input-gradient, weight-gradient (bf16 out), weight-gradient into fp32 main_grad "
             "TFLOP/s (torch " + torch.__version__ + ")"]
    for m, k, n in NEMO_175B_TP4_GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
        f = 2.0 * m * k * n
        r = (rate(functools.partial(F.linear, x, w), f), rate(functools.partial(torch.matmul, g, w), f),
             rate(functools.partial(torch.matmul, g.t(), x), f),
             rate(functools.partial(torch.addmm, main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad), f))
        lines.append(f"{m} {k} {n}: " + " ".join(f"{v:.0f}" for v in r))
        print(lines[-1], flush=True)
        del x, w, g, main_grad
    (out / "wgrad_accum.txt").write_text("\n".join(lines) + "\n")


def breakdown(out: Path, name: str, cluster: str) -> None:
    """The cost model's time for one case's step by captured op (`cost_models.compute.node_time`,
    forward and backward, summed over the plan's micro-batches), to set beside the measured op
    profile (`profile`): where the prediction misses. Written to DIR/breakdown_NAME.txt."""
    import collections

    from autopar.capture import capture
    from autopar.models.registry import build_model
    from autopar.schema.cluster import ClusterSpec
    from autopar.schema.plan import Plan
    from cost_models.compute import autocast_cast_time, bias_grad_time, grad_sum_time, node_time, priced
    from cost_models.layouts import graph_layout_copies
    from cost_models.memory import graph_fp32_tensors

    case = next(c for c in CASES if c[0] == name)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    plan = Plan.from_json((out / "plans" / f"{name}.json").read_text())
    bundle = build_model(case[1], device="meta")
    g = capture(bundle.model, bundle.example_inputs).at_batch(plan.microbatch_size)
    index = {n.name: n for n in g.nodes}
    dev, m = ClusterSpec.load(cluster).device, plan.num_microbatches
    per: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    sw = plan.software
    copies = graph_layout_copies(g, dev.device_type, sw.attention_kernel)
    fp32 = graph_fp32_tensors(g, dev.device_type, plan.dtype, sw.attention_kernel, sw.autocast)
    for n in g.calls:
        if priced(n, copies):
            f, b = node_time(n, dev, plan.dtype, 1.0, index, sw.attention_kernel, copies, None, fp32)
            # autocast's casts for the op (`copy_` in the measured profile): a row of their own
            cf, cb = autocast_cast_time(n, index, fp32, dev, plan.dtype)
            bias = bias_grad_time(n, index, dev, plan.dtype) if n.op in ("linear", "addmm") else 0.0
            sums = grad_sum_time(n, dev, plan.dtype, 1.0, copies, fp32, index)
            k = "reshape copies" if n.name in copies[0] else n.op
            for key, (a, c) in ((k, (f - cf, b - cb - bias - sums)), ("autocast casts", (cf, cb)),
                                ("bias grad sums", (0.0, bias)), ("gradient sums (autograd)", (0.0, sums))):
                if a or c:
                    per[key][0] += a * m
                    per[key][1] += c * m
                    per[key][2] += m
    total = sum(f + b for f, b, _ in per.values())
    lines = [f"case {name} on {Path(cluster).stem}: ops {total * 1e3:.1f} ms over {m} micro-batches "
             f"(plan: {plan.predicted.iteration_time_s * 1e3:.1f} ms a step; recomputation, optimizer and "
             f"gradient accumulation are not ops)", f"{'op':32s} {'fwd ms':>9s} {'bwd ms':>9s} {'calls':>6s}"]
    for op, (f, b, c) in sorted(per.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        lines.append(f"{op:32s} {f * 1e3:9.2f} {b * 1e3:9.2f} {c:6d}")
    (out / f"breakdown_{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def _pins_of(plan: dict) -> list[str]:
    pins = ["--dp", "1", "--tp", "1", "--pp", "1", "--microbatch-size", str(plan["microbatch_size"]),
            "--schedule", plan["schedule"], "--zero-stage", str(plan["zero_stage"])]
    rec = {s["recompute"] for s in plan["stages"]}
    if len(rec) == 1:
        pins += ["--recompute", rec.pop()]
    return pins


def _repredict(out: Path, name: str, model: str, batch: int, plan: dict, cluster: str) -> dict | None:
    dest = out / "plans" / f"{name}@{Path(cluster).stem}.json"
    cmd = _autopar() + ["plan", "--model", model, *_cluster_args(cluster), "-b", str(batch), *_pins_of(plan),
                        "-o", str(dest), "-q"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{name}: re-prediction on {cluster} failed: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(dest.read_text())


def report(out: Path, cluster: str | None, only: str | None, as_json: bool, metrics: Path | None = None) -> None:
    """The table: every case's plan in DIR/plans (planned now where missing, so a report of committed
    measurements, `--metrics`, uses today's cost model) against its measured summary."""
    missing = [c[0] for c in _cases(only) if not (out / "plans" / f"{c[0]}.json").exists()]
    if missing:
        plan_cases(out, "dgx-h100", ",".join(missing))
    rows = []
    for name, model, batch, _ in _cases(only):
        pf, mf = out / "plans" / f"{name}.json", (metrics or out / "metrics") / f"{name}.jsonl"
        if not pf.exists():
            continue
        plan = json.loads(pf.read_text())
        summary = None
        if mf.exists():
            lines = [json.loads(x) for x in mf.read_text().splitlines() if x.strip()]
            summary = next((x for x in lines if x.get("summary")), None)
        pred = plan["predicted"]
        rec = "/".join(sorted({s["recompute"] for s in plan["stages"]}))
        row = {"case": name, "layout": f"mb {plan['microbatch_size']} x {plan['num_microbatches']}, {rec}",
               "predicted_s": pred["iteration_time_s"], "predicted_peak_gib": pred["peak_memory_bytes"] / GiB,
               "predicted_tflops": pred["tflops_per_device"]}
        if summary:
            meas = summary["measured_time_s"]
            row.update(measured_s=meas, time_error=pred["iteration_time_s"] / meas - 1,
                       measured_peak_gib=summary["measured_peak_memory_bytes"] / GiB,
                       memory_error=pred["peak_memory_bytes"] / summary["measured_peak_memory_bytes"] - 1,
                       measured_tflops=pred["tflops_per_device"] * pred["iteration_time_s"] / meas)
        if cluster:
            rp = _repredict(out, name, model, batch, plan, cluster)
            if rp:
                row["repredicted_s"] = rp["predicted"]["iteration_time_s"]
                if summary:
                    row["repredicted_error"] = row["repredicted_s"] / row["measured_s"] - 1
        rows.append(row)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    head = ["case", "layout", "pred s", "meas s", "err", "pred GiB", "meas GiB", "err", "TFLOP/s meas"]
    if cluster:
        head += [f"pred s on {Path(cluster).stem}", "err"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        def f(k, fmt, r=r):
            return format(r[k], fmt) if k in r else "-"
        cells = [r["case"], r["layout"], f("predicted_s", ".4f"), f("measured_s", ".4f"), f("time_error", "+.1%"),
                 f("predicted_peak_gib", ".2f"), f("measured_peak_gib", ".2f"), f("memory_error", "+.1%"),
                 f("measured_tflops", ".0f")]
        if cluster:
            cells += [f("repredicted_s", ".4f"), f("repredicted_error", "+.1%")]
        print("| " + " | ".join(cells) + " |")
    print()
    for line in _summary(rows, len(_cases(only)), cluster):
        print(line)


def _summary(rows: list[dict], cases: int, cluster: str | None) -> list[str]:
    """Mean absolute errors and the cases within 10%, each out of every case asked for: a case
    that failed to plan or run counts as a miss (it is in no mean)."""
    def line(key: str, what: str) -> str:
        errs = [abs(r[key]) for r in rows if key in r]
        if not errs:
            return f"{what}: no case measured (of {cases})"
        return (f"{what}: mean |error| {sum(errs) / len(errs):.1%} over {len(errs)} measured, "
                f"within 10% {sum(e <= 0.10 for e in errs)} of {cases} cases (unmeasured or failed: "
                f"{cases - len(errs)}, misses)")
    out = [line("time_error", "step time"), line("memory_error", "peak memory")]
    if cluster:
        out.append(line("repredicted_error", f"step time on {Path(cluster).stem}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["plan", "run", "profile", "optimizer", "gemm", "wgrad", "memory",
                                       "breakdown", "report"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cluster", help="plan: the profile planned on (default dgx-h100); report: re-predict on it")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per case run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--metrics", type=Path, help="report: the measured summaries (default DIR/metrics), e.g. "
                    "benchmarks/results/h100-2026-11-25/after")
    a = ap.parse_args()
    if a.action == "plan":
        plan_cases(a.out, a.cluster or "dgx-h100", a.only)
    elif a.action == "run":
        run_cases(a.out, a.steps, a.only, a.timeout)
    elif a.action == "profile":
        for name in (a.only or "gpt3-1.3b-mb4-none").split(","):
            profile_case(a.out, name, steps=2)
    elif a.action == "breakdown":
        names = (a.only or "gpt3-1.3b-mb4-none").split(",")
        missing = [n for n in names if not (a.out / "plans" / f"{n}.json").exists()]
        if missing:
            plan_cases(a.out, "dgx-h100", ",".join(missing))
        for name in names:
            breakdown(a.out, name, a.cluster or "dgx-h100")
    elif a.action == "memory":
        for name in (a.only or "bert-large").split(","):
            memory_case(a.out, name)
    elif a.action == "gemm":
        gemm_alignment(a.out)
    elif a.action == "wgrad":
        wgrad_accum(a.out)
    elif a.action == "optimizer":
        for name in (a.only or "gpt3-1.3b").split(","):
            optimizer_case(a.out, name)
    else:
        report(a.out, a.cluster, a.only, a.json, a.metrics)


if __name__ == "__main__":
    main()
