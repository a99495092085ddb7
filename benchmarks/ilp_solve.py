"""ILP size and solve time of the intra-op auto-sharding (autopar.intra_op) on big layers.

    python benchmarks/ilp_solve.py [--quick] [--backend cbc|highs|scip|cp-sat]

Per layer: one GPT-3 175B block and one Llama2-70B block (micro-batch 1, seq 2048), each on the
(1, 8), (2, 4) and (16, 8) logical meshes (DGX-A100-like links: NVLink on the last axis,
InfiniBand on the first), solved alone with `solve_graph(nodes=...)` as the inter-op DP does.
Whole models: GPT-3 175B and Llama2-70B on (1, 8) and (2, 4), identical layers solved once.
Targets: each distinct layer <= 2 s, GPT-3 175B whole < 10 s, gap <= 1%.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import autopar
from autopar.capture import capture
from autopar.intra_op import solve_graph
from autopar.models import build_model

NVLINK = (5e-6, 1 / 230e9)     # intra-node all-reduce bus bandwidth (design.md)
IB = (10e-6, 1 / 24e9)          # per-NIC inter-node


def mesh(shape: tuple[int, int]) -> autopar.LogicalMesh:
    return autopar.LogicalMesh(shape=shape, alpha=(IB[0], NVLINK[0]), beta=(IB[1], NVLINK[1]))


def row(*cols) -> None:
    print("  ".join(str(c) for c in cols), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one mesh per model, skip whole models")
    ap.add_argument("--backend", default="cbc")
    args = ap.parse_args()
    meshes = [(1, 8), (2, 4), (16, 8)]
    ok = True
    graphs = {}
    for name in ("gpt3-175b", "llama2-70b"):
        b = build_model(name)
        t0 = time.perf_counter()
        g = capture(b.model, b.example_inputs)
        graphs[name] = g.at_batch(1)
        row(f"{name}: captured in {time.perf_counter() - t0:.1f} s, {len(g.calls)} ops, {len(g.layers)} layers")
    row(f"\n{'model':12s} {'mesh':8s} {'ops':>4s} {'groups':>6s} {'vars':>6s} {'cons':>6s} {'build_s':>7s} "
        f"{'solve_s':>7s} {'total_s':>7s} {'gap':>6s}  plan")
    for name, g in graphs.items():
        layer = g.layers[0]
        nodes = [n.name for n in g.layer_nodes(layer)]
        for shape in meshes[:1] if args.quick else meshes:
            t0 = time.perf_counter()
            sol = solve_graph(g, mesh(shape), nodes=nodes, backend=args.backend)
            tot = time.perf_counter() - t0
            ok &= tot <= 2.0 and sol.gap <= 0.01
            w = {k.removeprefix(layer + "."): v for k, v in sol.param_placements.items()
                 if k.endswith("weight") and "norm" not in k and "ln" not in k}
            row(f"{name + ' layer':12s} {str(shape):8s} {len(nodes):4d} {sol.num_groups:6d} {sol.num_variables:6d} "
                f"{sol.num_constraints:6d} {sol.build_time_s:7.2f} {sol.solve_time_s:7.2f} {tot:7.2f} "
                f"{sol.gap:6.2%}  {w}  {sol.collective_counts()}")
    if not args.quick:
        for name, g in graphs.items():
            for shape in meshes:
                t0 = time.perf_counter()
                sol = solve_graph(g, mesh(shape), backend=args.backend)
                tot = time.perf_counter() - t0
                if name == "gpt3-175b":
                    ok &= tot < 10 and sol.gap <= 0.01
                row(f"{name + ' whole':12s} {str(shape):8s} {len(g.calls):4d} {sol.num_groups:6d} "
                    f"{sol.num_variables:6d} {sol.num_constraints:6d} {sol.build_time_s:7.2f} {sol.solve_time_s:7.2f} "
                    f"{tot:7.2f} {sol.gap:6.2%}  objective {sol.objective * 1e3:.1f} ms, params "
                    f"{sol.param_bytes_per_device / 2**30:.1f} GiB/dev")
        # under a memory bound: bf16 mixed precision (16 B per parameter with Adam); the
        # unconstrained plan needs ~26 GiB per device, the bound forces a leaner one
        g = graphs["gpt3-175b"]
        for shape, gib in [((16, 8), None), ((16, 8), 24), ((16, 8), 22)]:
            t0 = time.perf_counter()
            sol = solve_graph(g, mesh(shape), backend=args.backend, dtype="bf16",
                              memory_budget_bytes=None if gib is None else gib * 2**30)
            tot = time.perf_counter() - t0
            ok &= tot < 10 and sol.gap <= 0.01
            label = f"gpt3 bf16 {'free' if gib is None else f'<={gib}GiB'}"
            row(f"{label:12s} {str(shape):8s} {len(g.calls):4d} {sol.num_groups:6d} {sol.num_variables:6d} "
                f"{sol.num_constraints:6d} {sol.build_time_s:7.2f} {sol.solve_time_s:7.2f} {tot:7.2f} "
                f"{sol.gap:6.2%}  objective {sol.objective * 1e3:.1f} ms, memory "
                f"{sol.memory_bytes_per_device / 2**30:.1f} GiB/dev (activations "
                f"{sol.activation_bytes_per_device / 2**30:.1f})")
    row("\nall targets met" if ok else "\nSOME TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    gc.disable()
    sys.exit(main())
