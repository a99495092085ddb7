"""Mixture-of-experts plans on DGX H100 nodes (issue 17): Mixtral 8x7B (Hugging Face config,
s=4096, global batch 256) and the zoo's DeepSeekMoE 16B (64 routed experts top-6 + 2 shared,
s=4096, global batch 1024) planned freely on 1 to 16 nodes, the search choosing ep with
dp/tp/pp; and Mixtral pinned to the layout of Megatron-Core's published Mixtral run, against
its figure.

    python benchmarks/moe_plans.py [--nodes 1,2,4,8,16] [--only mixtral|deepseek]

Published (the comparison row): NVIDIA's Megatron-Core MoE guide, "468 TFLOPS for Mixtral 8X7B
bf16 training" with MCore v0.9 on H100
(https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html). The page
does not give the layout; TP1 PP4 EP8 on 64 GPUs, micro-batch 1, global batch 256, s=4096 is
the configuration of a third-party reproduction script quoting that figure, an assumption
here. autopar's TFLOP/s count the captured FLOPs (routed tokens through their top-k experts
only), as Megatron's MoE formula counts active parameters.
"""

from __future__ import annotations

import argparse
import time

from autopar import ClusterSpec, Constraints
from autopar.capture import capture
from autopar.planner import plan, resolve_model
from autopar.schema.plan import format_table

MODELS = {"mixtral": ("hf:mixtral-8x7b?seq_len=4096", 256), "deepseek": ("deepseek-moe-16b", 1024)}
PUBLISHED = ("mixtral", 8, dict(tp=1, pp=4, dp=16, ep=8, microbatch_size=1), 468.0)


def _row(name: str, nodes: int, p, secs: float, pinned: str = "", published: str = "") -> list[str]:
    st = p.stages[0]
    return [name, str(nodes), f"{p.dp}/{p.ep}/{p.tp}/{p.pp}", f"{p.microbatch_size}x{p.num_microbatches}",
            p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""), str(p.zero_stage), st.recompute,
            f"{p.predicted.iteration_time_s:.3g}", f"{p.predicted.tflops_per_device:.0f}",
            f"{p.predicted.peak_memory_bytes / 2**30:.1f}", f"{secs:.1f}", pinned, published]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--only", choices=list(MODELS))
    args = ap.parse_args()
    nodes = [int(x) for x in args.nodes.split(",")]
    rows = []
    for name, (ref, gbs) in MODELS.items():
        if args.only and name != args.only:
            continue
        bundle = resolve_model(ref, None, None)
        t = time.perf_counter()
        graph = capture(bundle.model, bundle.example_inputs, name=bundle.name, cache=True)
        print(f"{name}: captured in {time.perf_counter() - t:.1f} s", flush=True)
        for n in nodes:
            t = time.perf_counter()
            try:
                p = plan(bundle, ClusterSpec.load("dgx-h100", num_nodes=n), global_batch_size=gbs, graph=graph,
                         cache=True)
            except Exception as e:  # noqa: BLE001 - a point that does not plan is a row saying why
                rows.append([name, str(n), "-", "-", "-", "-", "-", "-", "-", "-",
                             f"{time.perf_counter() - t:.1f}", "", f"no plan: {str(e)[:60]}"])
                continue
            rows.append(_row(name, n, p, time.perf_counter() - t))
            print(format_table(HEAD, rows[-1:]), flush=True)
        if PUBLISHED[0] == name and PUBLISHED[1] in nodes:
            _, n, pins, tf = PUBLISHED
            t = time.perf_counter()
            p = plan(bundle, ClusterSpec.load("dgx-h100", num_nodes=n), global_batch_size=gbs, graph=graph,
                     cache=True, constraints=Constraints(**pins))
            err = (p.predicted.tflops_per_device - tf) / tf
            rows.append(_row(name, n, p, time.perf_counter() - t, "Megatron's", f"{tf:.0f} ({err:+.0%})"))
    print(format_table(HEAD, rows))


HEAD = ["model", "nodes", "dp/ep/tp/pp", "mb x m", "schedule", "zero", "recompute", "s/iter", "TFLOP/s/GPU",
        "peak GiB", "search s", "pinned", "published TFLOP/s (error)"]

if __name__ == "__main__":
    main()
