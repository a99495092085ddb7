"""What NVIDIA's published NeMo GPT-3 175B H100 steps pay that the cost model leaves out (issue 14),
term by term, in seconds a step on one rank. Nothing here enters a prediction: each candidate is
sized from its source (or labelled an estimate) and printed beside the gap.

    python benchmarks/h100_missing_time.py [--gpus 512]

The run (`cost_model_accuracy.H100_CASES`; dgxc-benchmarking 8f5cbb3, NeMo 24.12): TP4 PP8 VP6,
micro-batch 1 x 64, s = 2048, h = 12288, sequence parallelism, so a rank runs 12 layers x 64
micro-batches = 768 layer micro-batches a step. Printed:

* the model's layer micro-batch by op (`cost_models.compute.node_time` on the rank's quarter of
  each op: the GEMMs and attention split over tp, the element-wise ops over the sequence), with the
  GEMMs' rates and the fused attention's rate on its causal work;
* wgrad into fp32 main_grad (`gradient_accumulation_fusion`): the weight-gradient GEMMs read and
  write K x N x 4 bytes of main_grad (beta = 1). The roofline (bytes beside the GEMM's compute)
  hides them; a kernel whose epilogue does not overlap its main loop pays them in full: the two
  bounds;
* NCCL kernels beside the GEMMs: the ZeRO-1 gradient reduce-scatter and weight all-gather over dp
  (bf16, hydra line 155: grad_sync_dtype) and the pipeline's sends (the [s/tp, b, h] boundary, both
  directions in one kernel), each at the profile's InfiniBand price, times the average (and the
  most) slowdown of compute run beside communication that Lee et al. 2025 measured
  (`OVERLAP_SLOWDOWN`);
* the layer norms on 132 - 8 SMs (NVTE_FWD/BWD_LAYERNORM_SM_MARGIN, `LN_SM_MARGIN`), priced as a
  memory-bound kernel slowed by the SMs it loses (an upper bound).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model_accuracy import H100_CASES, load_cluster, plan_case  # noqa: E402

from autopar.capture import capture  # noqa: E402
from autopar.models.gpt import GPT, GPTConfig  # noqa: E402
from autopar.schema.software import resolve_software  # noqa: E402
from cost_models.compute import MATRIX_OPS, fusion_of, memory_time, node_time  # noqa: E402
from cost_models.layouts import graph_layout_copies  # noqa: E402
from cost_models.memory import graph_fp32_tensors  # noqa: E402

# compute beside communication ran on average 18.9% (at most 40.0%) slower than alone: Lee, Oh, Kim,
# Go, Park, Mahajan 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning" (arXiv 2507.03114, abstract), GPT and LLaMA layers on 4 A100 / H100 /
# MI250 / MI210. An ESTIMATE here: their average over devices and settings, not this run's kernels
OVERLAP_SLOWDOWN = (0.189, 0.400)
# NVTE_FWD/BWD_LAYERNORM_SM_MARGIN: dgxc-benchmarking 8f5cbb3 nemo_megatron/configure.sh lines
# 103-105 take it from NeMo-Framework-Launcher's conditional_cfgs.py get_ln_sm_margin: 8 on
# compute capability >= 9 ("to overlap LN kernel with communication kernels")
LN_SM_MARGIN = 8


def layer_breakdown(cluster, tp: int = 4) -> list[tuple[str, str, float, float, float]]:
    """(op, module, FLOPs, forward s, backward s) of one layer micro-batch on a rank, priced as
    the planner prices each op (`node_time`), every op's work split `tp` ways."""
    sw = resolve_software("nemo-megatron-core-2024")
    case = H100_CASES[0]
    cfg = GPTConfig(vocab_size=case.vocab, seq_len=case.seq, hidden=case.hidden, layers=1, heads=case.heads,
                    dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
    model.train()
    x = torch.zeros(1, case.seq, dtype=torch.long, device="meta")
    g = capture(model, (x, x)).at_batch(1)
    dev = cluster.device
    index = {n.name: n for n in g.nodes}
    copies = graph_layout_copies(g, dev.device_type, sw.attention_kernel)
    fp32 = graph_fp32_tensors(g, dev.device_type, "bf16", sw.attention_kernel, sw.autocast)
    fusion = fusion_of(g, dev, sw.attention_kernel, sw.pointwise_fusion)
    out = []
    for n in g.calls:
        if not (n.module_path or "").startswith("blocks.0"):
            continue
        f, b = node_time(n, dev, "bf16", float(tp), index, sw.attention_kernel, copies, fusion, fp32)
        if f + b > 0:
            out.append((n.op, n.module_path, n.flops / tp, f, b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=512, help="which published case (128 .. 2048)")
    args = ap.parse_args()
    case = next(c for c in H100_CASES if c.gpus == args.gpus)
    cluster = load_cluster(case)
    dev = cluster.device
    h, s, tp, pp = case.hidden, case.seq, case.t, case.p
    dp = case.gpus // (tp * pp)
    lmb = case.layers // pp * (case.batch // dp)          # layer micro-batches a rank runs a step
    made = plan_case(case, cluster)
    pred = made.predicted.iteration_time_s
    gap = case.published_s - pred
    print(f"{case.name}: published {case.published_s:.3f} s, predicted {pred:.3f} s, gap {gap:.3f} s "
          f"({gap / lmb * 1e3:.2f} ms over each of {lmb} layer micro-batches)")

    rows = layer_breakdown(cluster, tp)
    sdpa = "scaled_dot_product_attention"
    gemm = sum(f + b for op, _, _, f, b in rows if op in MATRIX_OPS and op != sdpa)
    att = [(fl, f, b) for op, _, fl, f, b in rows if op == sdpa]
    other = sum(f + b for op, _, _, f, b in rows if op not in MATRIX_OPS and op != sdpa)
    norms = sum(f + b for op, _, _, f, b in rows if op in ("layer_norm", "native_layer_norm"))
    print("\nthe model's layer micro-batch, by op (ms):")
    for op, mod, fl, f, b in rows:
        rate = f" {fl / f / 1e12:6.0f} TFLOP/s forward" if op in MATRIX_OPS and op != sdpa and f > 0 else ""
        print(f"  {op:30s} {mod:22s} fwd {f * 1e3:6.3f} bwd {b * 1e3:6.3f}{rate}")
    att_s = sum(f + b for _, f, b in att)
    print(f"  GEMMs {gemm * 1e3:.3f}, attention {att_s * 1e3:.3f}, the rest {other * 1e3:.3f}: "
          f"{(gemm + att_s + other) * 1e3:.3f} ms; a step's GEMMs {gemm * lmb:.2f} s")
    for fl, f, b in att:
        print(f"  fused attention on its causal work (half the counted FLOPs): forward {fl / 2 / f / 1e12:.0f}, "
              f"backward {2.5 * fl / 2 / b / 1e12:.0f} TFLOP/s")

    # wgrad into fp32 main_grad: the rank's weights, read and written in fp32 once a micro-batch
    weights = 12 * h * h / tp
    epilogue = memory_time(weights * 8, dev)
    print(f"\nwgrad into fp32 main_grad: {weights:.3g} weights a rank and layer, {weights * 8 / 1e9:.2f} GB read + "
          f"written a layer micro-batch, {epilogue * 1e3:.2f} ms at the HBM's achieved rate: 0 (roofline) to "
          f"{epilogue * lmb:.2f} s a step (epilogue after the main loop)")

    # NCCL beside the GEMMs: dp reduce-scatter + all-gather of the rank's bf16 weights, pipeline sends
    link = cluster.inter_node
    shard = case.layers // pp * 12 * h * h / tp * 2
    dp_s = 2 * shard * (dp - 1) / dp / link.bandwidth
    send = s // tp * h * 2 / link.bandwidth + link.latency
    chunks = case.layers // pp // case.v                   # layers a virtual stage holds
    pp_s = 2 * send * lmb / chunks                         # a forward and a backward exchange per chunk
    lo, hi = OVERLAP_SLOWDOWN
    print(f"NCCL beside compute: dp reduce-scatter + all-gather {dp_s:.3f} s, pipeline exchanges {pp_s:.3f} s a "
          f"step; at Lee et al.'s average / most slowdown: {lo * (dp_s + pp_s):.3f} / {hi * (dp_s + pp_s):.3f} s")

    sms = dev.sm_count or 132
    ln = norms * (sms / (sms - LN_SM_MARGIN) - 1)
    print(f"layer norms on {sms - LN_SM_MARGIN} of {sms} SMs: {norms * 1e3:.3f} ms a layer micro-batch, at most "
          f"+{ln * lmb:.4f} s a step")


if __name__ == "__main__":
    main()
