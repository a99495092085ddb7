"""What the published Qwen3-235B runs paid that the cost model leaves out (issue 14), candidate by
candidate, in seconds a step on one rank.

    python benchmarks/moe_missing_time.py [--case TEXT] [--lift-memory 2.0]

Plans each published Qwen3-235B-A22B run of `moe_plans.PUBLISHED` (the zoo's rows 1, 3, 4, 5;
`--case` picks the published runs whose name contains TEXT, e.g. Qwen3-30B or Mixtral; the
devices' memory times `--lift-memory` so that rows 4 and 5 plan) and prints, beside the predicted
and published step and the gap between them:

* the rank's layer micro-batches (a micro-batch through one decoder layer; rows 1, 4 and 5 run
  the same FLOPs a rank, 94 layers x 2048 sequences over 256 GPUs) and the gap per one;
* the host's share: the dispatch waits on the host once a layer's forward (DeepEP's normal
  `Buffer.dispatch` spins on the received counts, Megatron's all-to-all dispatcher copies the
  split sizes to the host before its all-to-all), so the host cannot queue more than one layer
  ahead. The layer's forward ops in order, each priced as the model prices it (GPU seconds) and
  launched by the host at `HOST_OP_S` apart (the per-op host time this project measured on an
  H100 with eager PyTorch ops under autograd, benchmarks/results/h100-2026-11-25/h100-profile.yaml
  `kernel_overhead_s`: 21.8 us per op and pass), the GPU starting each when both it is launched
  and the previous one is done, from an empty queue at the dispatch: the GPU's idle time in a
  layer's forward, times the layer micro-batches (and the upper bound, the host time not
  overlapped at all);
* the pipeline sends the model charges (what the stage's communication holds beyond its layers'
  collectives), and the expert GEMMs' rows per expert and their rate on
  the profile's GEMM curve (the efficiency that would close the gap alone);
* the expert GEMMs one library GEMM an expert (Transformer Engine 2.2's GroupedLinear in the zoo's
  container: a host loop of cuBLASLt calls over 4 streams): the launches a layer micro-batch, the
  GPU time of each against `HOST_GEMM_S` of host, the forward's idle time from the dispatch's empty
  queue with each grouped GEMM so split, the bound with every launch's host time exposed, and the
  gap per launch; before the cases, the GEMM curve against TE 2.2's own measured grouped-GEMM rate
  (`TE22_GROUPED`) at per-expert sizes of rows 4 and 5;
* `--log-params-norm` (on in the zoo's model config the day of the table; row 3's note says it
  was disabled there): an fp32 copy of every expert weight and an L2 norm each step
  (megatron/training/utils.py calc_params_l2_norm at 1e057005), its bytes over the HBM.

Each candidate's size is printed against the gap; none is added to the prediction here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_plans  # noqa: E402

from autopar.capture.flops import VIEW_OPS  # noqa: E402
from cost_models.compute import bytes_scale, grouped_gemm_time  # noqa: E402

# per-op host time of an eager PyTorch step on an H100 host (forward op with autograd recording,
# or a backward node): benchmarks/results/h100-2026-11-25/h100-profile.yaml kernel_overhead_s,
# measured by cost_models.profiler on a 64-op chain of one-element tensors
HOST_OP_S = 2.177034615382485e-05

# Transformer Engine's GroupedLinear in the zoo's container (dockers/Dockerfile at 8017e11, the table's
# commit: TransformerEngine release_v2.2 on nvcr.io/nvidia/pytorch:25.02-py3; Megatron 1e057005 builds
# TEGroupedMLP from it under --moe-grouped-gemm, moe_module_specs.py) runs a grouped GEMM as one
# cuBLASLt GEMM per expert from a host loop over 4 streams (cpp_extensions/gemm.py general_grouped_gemm
# -> te_general_grouped_gemm -> common/gemm/cublaslt_gemm.cu nvte_multi_stream_cublas_gemm,
# num_streams = 4 in gemm.h); each call builds its cuBLASLt descriptors and queries the heuristic
# (cublaslt_gemm.cu cublas_gemm). A CUTLASS grouped kernel came in TE 2.8 (PR 2045, opt-in).
# Megatron's TEGroupedMLP: linear_fc1 (gate and up fused) and linear_fc2, 2 GEMMs an expert forward,
# each with a data- and a weight-gradient GEMM backward
GEMMS_PER_EXPERT = 2
# host time of one such cuBLASLt call: github.com/rapidsai/raft pull 1736 (cuBLASLt matmul "kernel
# launch latency approx 10us -> 5us, as measured by NVTX from entering matmul wrapper on the host to
# the launch of the kernel", descriptors and heuristic per call -> memoized); TE 2.2 does the former.
# A transferred figure (another library's wrapper of the same cuBLASLt calls), not measured in TE
HOST_GEMM_S = 10e-6
# TE 2.2's own grouped GEMM on an H100, bf16 (github.com/NVIDIA/TransformerEngine pull 2045, the
# description's table, "TE V2.2 (TFLOPs)"): (experts, rows, N, K) -> TFLOP/s
TE22_GROUPED = {(8, 4096, 768, 2048): 508.77e12, (16, 2048, 768, 2048): 398.81e12}


def layer_ops(self, i: int, mb: int, tp: int, cluster, dtype: str) -> list[tuple[str, str, float]]:
    """(op, module, forward GPU seconds) of layer `i`'s launching ops in order at micro-batch `mb`,
    work split over `tp` where the op is a matrix op (an estimate of the solved layout: the
    dense GEMMs and attention split over tp, the rest on the rank's sequence slice or whole),
    one entry per fused chain under the software's `pointwise_fusion`."""
    from autopar.intra_op.ilp import op_compute_time

    dev = cluster.device
    layer = self.layers[i]
    g, rg, att, copies, fusion, fp32 = self.op_pricing(layer, mb, dev, dtype)
    out: list[tuple[str, str, float]] = []
    seen_chains: dict[int, int] = {}
    for name in layer.nodes:
        n = g.node(name)
        if n.kind != "call" or n.op in VIEW_OPS or not n.outputs:
            continue
        if n.flops <= 0 and n.bytes_moved <= 0 and name not in copies[0]:
            continue
        split = tp if n.flops > 0 and n.op in ("linear", "mm", "matmul", "bmm", "scaled_dot_product_attention") else 1
        f, _ = op_compute_time(n, rg, rg.get(name, False), dev, dtype, split, g._index, att, copies, fusion, fp32)
        chain = fusion.chain_of.get(name) if fusion is not None else None
        if chain is not None:
            k = id(chain)
            if k in seen_chains:
                j = seen_chains[k]
                op, mod, t = out[j]
                out[j] = (op, mod, t + f)
                continue
            seen_chains[k] = len(out)
        out.append((n.op, n.module_path or "", f))
    return out


def starved(ops: list[float], host_s, first: float = 0.0) -> float:
    """Seconds the GPU idles running `ops` (GPU seconds, in order) when the host launches one
    every `host_s` (seconds, or a list: each op's own host time) from an empty queue and the GPU
    runs each once launched and the one before is done; `first`: a GPU block queued at the start
    (the dispatch's exchange)."""
    hosts = host_s if isinstance(host_s, (list, tuple)) else [host_s] * len(ops)
    issue, gpu = 0.0, first
    for t, h in zip(ops, hosts):
        issue += h
        gpu = max(gpu, issue) + t
    return gpu - (first + sum(ops))


def per_expert_launches(rot: list[float], ops: list[tuple[str, str, float]], k: int, local: int,
                        host_gemm_s: float, gemm_s: list[float]) -> tuple[list[float], list[float]]:
    """The forward from the dispatch (`rot`, GPU seconds, `ops` rotated by `k`) with each expert
    grouped GEMM split into `local` per-expert GEMMs of equal GPU time (the i-th grouped GEMM's
    the model's forward seconds `gemm_s[i]`, all local experts), each launched `host_gemm_s` after
    the one before (Transformer Engine 2.2's GroupedLinear: a C++ loop of cuBLASLt calls), the other
    ops `HOST_OP_S` apart: (GPU seconds, host seconds) per launch."""
    gpu: list[float] = []
    host: list[float] = []
    i = 0
    for (op, _, _), t in zip(ops[k:] + ops[:k], rot):
        if op == "grouped_mm":
            t = gemm_s[min(i, len(gemm_s) - 1)]
            i += 1
            gpu += [t / local] * local
            host += [HOST_OP_S] + [host_gemm_s] * (local - 1)    # the module's own call, then the loop
        else:
            gpu.append(t)
            host.append(HOST_OP_S)
    return gpu, host


def te22_check() -> None:
    """The profile's GEMM curve against TE 2.2's measured grouped GEMM (TE22_GROUPED) at the same
    per-expert shapes: bf16 operands and output, each expert's GEMM priced alone (`grouped_gemm_time`)."""
    from autopar.planner import resolve_cluster  # noqa: PLC0415
    dev = resolve_cluster("dgx-h100").device
    for (g, m, n, kk), measured in TE22_GROUPED.items():
        flops = 2.0 * g * m * n * kk
        moved = 2.0 * g * (m * kk + kk * n + m * n)
        t = grouped_gemm_time(flops, moved, g, dev, "bf16")[0]
        print(f"TE 2.2 grouped GEMM (TE pull 2045, H100 bf16) g={g} m={m} n={n} k={kk}: {measured / 1e12:.0f} "
              f"TFLOP/s measured, {flops / g / 1e9:.1f} GFLOP a GEMM; the profile's curve {flops / t / 1e12:.0f} "
              f"TFLOP/s ({flops / t / measured:.2f}x); a host-bound loop would take at most "
              f"{flops / measured / g * 1e6:.1f} us of host a GEMM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="Qwen3-235B")
    ap.add_argument("--lift-memory", type=float, default=2.0)
    args = ap.parse_args()
    cases = [c for c in moe_plans.PUBLISHED if args.case.lower() in c.name.lower()]
    te22_check()
    for case in cases:
        p, (self, costs, out, ep, mb, tp, cluster, dtype, etp, fold) = moe_plans.plan_watching_experts(
            case, args.lift_memory)
        i = sorted(self.by_layer)[len(self.by_layer) // 2]
        b = self.by_layer[i][0]
        c = out[i]
        m, v = p.num_microbatches, max(1, p.virtual_stages)
        st = p.stages[1] if len(p.stages) > 1 else p.stages[0]
        per_rank = len(st.layers) * v if len(p.stages) > 1 else len(self.by_layer)
        lmb = m * per_rank
        pred, pub = p.predicted.iteration_time_s, moe_plans.published_seconds(case, p)
        gap = pub - pred
        print(f"\n{case.name}: predicted {pred:.2f} s, published {pub:.1f} s, gap {gap:+.2f} s; {m} micro-batches "
              f"x {per_rank} layers a rank = {lmb} layer micro-batches, {gap / lmb * 1e3:.2f} ms each")
        print(f"  a layer micro-batch in the model: compute fwd {c.fwd_s * 1e3:.2f} + bwd {c.bwd_s * 1e3:.2f} ms, "
              f"collectives fwd {c.fwd_comm_s * 1e3:.2f} + bwd {c.bwd_comm_s * 1e3:.2f} ms")
        # the host: the layer's forward launched from an empty queue at the dispatch
        ops = layer_ops(self, i, mb, tp, cluster, dtype)
        # the ops' shares of the layer's priced forward (the one-process graph holds every expert's
        # rows and the dense ops unsplit: the layer's solved and expert-sharded cost is the total)
        raw = [t for _, _, t in ops]
        gpu = [t * c.fwd_s / sum(raw) for t in raw]
        k = next((j for j, (_, mod, _) in enumerate(ops) if mod == b.module or mod.startswith(b.module + ".")), 0)
        rot = gpu[k:] + gpu[:k]                 # from the dispatch to the next layer's dispatch
        a2a = self.exchange_time(b, mb, dtype, ep, cluster, self.ep_group(ep, tp, fold and tp > 1),
                                 1.0 / tp if fold and tp > 1 else 1.0)
        idle = starved(rot, HOST_OP_S, first=a2a)          # the dispatch's exchange queued at the sync
        syncs = 2 if st.recompute == "full" else 1      # full recomputation re-runs the dispatch
        host = len(ops) * HOST_OP_S
        print(f"  host: {len(ops)} launching ops a layer forward (fused chains one each), {host * 1e3:.2f} ms at "
              f"{HOST_OP_S * 1e6:.1f} us, GPU {sum(gpu) * 1e3:.2f} ms + collectives {c.fwd_comm_s * 1e3:.2f} ms; "
              f"the GPU idles {idle * 1e3:.3f} ms a forward from an empty queue: {idle * lmb * syncs:.2f} s a step "
              f"({syncs} sync(s) a layer micro-batch); not overlapped at all (bound): {host * lmb * syncs:.2f} s; "
              f"host-bound at the published step: {pub / lmb / HOST_OP_S:.0f} op-passes a layer micro-batch")
        # pipeline sends, expert GEMMs
        tot = c.fwd_comm_s + c.bwd_comm_s
        sends = (st.predicted.communication_s - tot * m * len(st.layers)) * v if len(p.stages) > 1 else 0.0
        local = b.num_experts // ep
        rows = b.pairs_per_sample * mb / (tp if fold and tp > 1 else 1) / local
        print(f"  the stage's communication beyond its layers' collectives (pipeline sends as the software "
              f"leaves them exposed, pipeline_send_overlap {p.software.pipeline_send_overlap}): {sends:.2f} s a step")
        share = 1.0 / tp if fold and tp > 1 else 1.0
        gf = gb = 0.0
        gemm_f = []
        for flops, moved, wbytes, out_dtype, _, _ in self._block_gemms(b):
            act = max(moved - wbytes, 0.0) * mb
            t = grouped_gemm_time(flops * mb * self.imbalance * share,
                                  (act * self.imbalance * share + wbytes / ep) * bytes_scale(out_dtype, dtype),
                                  local, cluster.device, dtype)
            gf, gb = gf + t[0], gb + t[1]
            gemm_f.append(t[0])
        g_step = (gf * (2 if st.recompute == "full" else 1) + gb) * lmb
        print(f"  expert GEMMs: {local} local experts x {rows:.0f} rows at the mean (K {b.hidden}), "
              f"fwd {gf * 1e3:.2f} + bwd {gb * 1e3:.2f} ms a layer micro-batch, {g_step:.2f} s a step; the gap alone "
              f"would make them {1 + gap / g_step:.2f}x slower than the GEMM curve's per-expert GEMMs")
        # TE 2.2's per-expert cuBLASLt GEMMs: their launches (the GPU's rate is TE22_GROUPED's check in main)
        n_fwd = GEMMS_PER_EXPERT * local
        n = n_fwd * (2 if st.recompute == "full" else 1) + 2 * n_fwd
        g_fwd, h_fwd = per_expert_launches(rot, ops, k, local, HOST_GEMM_S, gemm_f)
        idle_e = max(starved(g_fwd, h_fwd, first=a2a), 0.0)
        split = sum(1 for op, _, _ in ops if op == "grouped_mm")
        gflop = [fl * mb * share / local for fl, *_ in self._block_gemms(b)]   # each GEMM of an expert
        # the zoo's rows (Megatron MoE model zoo) ran TE 2.2 and --log-params-norm; other runs are
        # sized with the same per-expert loop as a what-if, said so
        zoo = "Megatron-MoE-ModelZoo" in case.source
        how = "TE 2.2 in the zoo's rows" if zoo else "TE 2.2's loop as a what-if: this run's software differs"
        print(f"  per-expert GEMMs (one cuBLAS(Lt) call an expert, {how}): {n} launches "
              f"a layer micro-batch ({n_fwd} forward"
              f"{' twice' if st.recompute == 'full' else ''}, {2 * n_fwd} backward), an expert's forward GEMMs "
              f"{' + '.join(f'{x / 1e9:.1f}' for x in gflop)} GFLOP, {gf / n_fwd * 1e6:.0f} us forward / "
              f"{gb / (2 * n_fwd) * 1e6:.0f} us backward of GPU each at the mean against "
              f"{HOST_GEMM_S * 1e6:.0f} us of host; the forward's {split} grouped GEMMs so split, the GPU idles "
              f"{idle_e * 1e3:.3f} ms a forward from the dispatch's empty queue: {idle_e * lmb * syncs:.2f} s a "
              f"step; every launch's host time exposed (bound): {n * HOST_GEMM_S * lmb:.2f} s; the gap is "
              f"{gap / (n * lmb) * 1e6:.0f} us a launch")
        # --log-params-norm: fp32 copies of the expert weights, then their L2 norm
        expert_elems = sum(v_ for w, v_ in c.param_elems.items() if ".experts." in w) * per_rank
        nbytes = expert_elems * (2 + 4 + 4)
        bw = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
        # the distributed optimizer's step on the rank's shards, and the last chunk's gradient
        # reduce-scatter (fp32, Megatron's default for bf16), the one --overlap-grad-reduce cannot hide
        dense_elems = sum(v_ for w, v_ in c.param_elems.items() if ".experts." not in w) * per_rank
        edp = p.experts.expert_dp if p.experts else 1
        shard = expert_elems / max(edp, 1) + dense_elems / max(p.dp, 1)
        opt = shard * 30 / bw        # fp32 param, grad, two moments read, three written, the bf16 copy
        rs = (4 * expert_elems / v * (edp - 1) / edp / cluster.intra_node.bandwidth
              + 4 * dense_elems / v * (p.dp - 1) / p.dp / cluster.inter_node.bandwidth)
        print(f"  optimizer step on the shards: {shard / 1e9:.2f} G elements, {opt:.3f} s; the last chunk's "
              f"gradient reduce-scatter: {rs:.3f} s")
        if zoo:
            off = " (off in this row: the table's note)" if p.zero_stage == 3 else ""
            print(f"  --log-params-norm{off}: {expert_elems / 1e9:.2f} G expert elements a rank, "
                  f"{nbytes / 1e9:.1f} GB moved: {nbytes / bw:.3f} s a step")


if __name__ == "__main__":
    main()
