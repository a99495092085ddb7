"""Free-search wall time of `autopar.plan` on large clusters (run on this 2-core machine).

    python benchmarks/search_time.py [--only NAME] [--intra-op auto|analytic|ilp]

Capture (torch.export of the meta model) is timed apart from the search (layers, per-layer
costs, the inter-op DP and the joint loop): the search is what the targets below refer to.
Targets: each < 60 s; GPT-3 175B on 1536 A100s < 10 s.
"""

from __future__ import annotations

import argparse
import time

import torch

from autopar.capture import capture
from autopar.models import build_model
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.registry import ModelBundle, token_inputs
from autopar.planner import plan
from autopar.schema import ClusterSpec
from autopar.schema.cluster import bundled_clusters


def _gpt_bundle(name: str, cfg: GPTConfig) -> ModelBundle:
    with torch.device("meta"):
        m = GPT(cfg)
    return ModelBundle(name, m, token_inputs(cfg.seq_len)(1))


def cases():
    h100 = "dgx-h100" if "dgx-h100" in bundled_clusters() else "dgx-a100-80g"
    return [
        ("gpt3-175b", lambda: build_model("gpt3-175b"), "dgx-a100-80g", 192, 1536),
        ("gpt-1t", lambda: _gpt_bundle("gpt-1t", GPTConfig(vocab_size=51200, seq_len=2048, hidden=25600,
                                                           layers=128, heads=160)), "dgx-a100-80g", 384, 3072),
        # issue 18's case: Megatron's 39.1B run (Narayanan et al. 2021) planned freely
        ("gpt-39.1b", lambda: _gpt_bundle("gpt-39.1b", GPTConfig(vocab_size=51200, seq_len=2048, hidden=8192,
                                                                 layers=48, heads=64)), "dgx-a100-80g", 64, 1536),
        ("llama2-70b", lambda: build_model("llama2-70b"), h100, 8, 1024),
        ("gpt3-1.3b", lambda: build_model("gpt3-1.3b"), "dgx-a100-80g", 1, 512),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="one case, by name")
    ap.add_argument("--intra-op", default="auto")
    args = ap.parse_args()
    names = [c[0] for c in cases()]
    if args.only and args.only not in names:
        ap.error(f"--only {args.only!r}: no such case; one of {', '.join(names)}")
    rows = []
    for name, build, cluster, nodes, gbs in cases():
        if args.only and args.only != name:
            continue
        b = build()
        t0 = time.perf_counter()
        g = capture(b.model, b.example_inputs, name=name)
        t_cap = time.perf_counter() - t0
        cl = ClusterSpec.load(cluster, num_nodes=nodes)
        t0 = time.perf_counter()
        p = plan(b, cl, global_batch_size=gbs, graph=g, intra_op=args.intra_op)
        t_search = time.perf_counter() - t0
        rows.append((name, f"{cl.num_devices} x {cl.device.name} ({cluster})", str(gbs), f"{t_cap:.1f}",
                     f"{t_search:.2f}", f"{p.search['assemble_time_s']:.2f}",
                     f"dp={p.dp} tp={p.tp} pp={p.pp} mb={p.microbatch_size} "
                     f"{p.schedule}{f' v={p.virtual_stages}' if p.virtual_stages > 1 else ''} zero={p.zero_stage} "
                     f"rc={p.stages[0].recompute}",
                     f"{p.predicted.iteration_time_s:.3g}", f"{p.predicted.tflops_per_device:.0f}",
                     f"{p.predicted.peak_memory_bytes / 2**30:.1f} / {p.predicted.usable_memory_bytes / 2**30:.1f}",
                     str(p.search.get("evaluated")), str(p.search.get("intra_op"))))
        print(" | ".join(rows[-1]), flush=True)
    cols = ["model", "cluster", "batch", "capture s", "search s", "of which assembly s", "plan", "iter s",
            "TFLOP/s/dev", "peak / usable GiB", "evaluated", "intra-op"]
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print()
    print("  ".join(c.ljust(x) for c, x in zip(cols, w)))
    print("  ".join("-" * x for x in w))
    for r in rows:
        print("  ".join(v.ljust(x) for v, x in zip(r, w)))


if __name__ == "__main__":
    main()
