"""Exposed communication of a published MoE run's pipeline chunk, by collective kind (issue 14).

    python benchmarks/moe_comm_breakdown.py [--case "cross-node EP32"] [--lift-memory 1.5] [--dispatch ranks]

Plans the published run (`moe_plans.PUBLISHED`, the devices' memory times `--lift-memory` so that a
run that does not fit still plans) and prints, for one middle decoder layer and one micro-batch,
the seconds of each collective the cost model charges beside its compute: the tensor/sequence-
parallel collectives of the dense part, the expert exchange (dispatch and combine, forward and
backward, and the per-expert counts), folding's all-gathers over tp and expert tensor parallelism's
all-reduces; then a chunk's totals (pipeline sends are the rest of its communication) and the
iteration's. `--dispatch` plans the case with another `SoftwareSpec.expert_dispatch` (ranks: one
flat exchange, as before DeepEP's internode path was priced).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_plans  # noqa: E402

from cost_models.communication import link_collective_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="cross-node EP32")
    ap.add_argument("--lift-memory", type=float, default=1.5)
    ap.add_argument("--dispatch", choices=("pairs", "ranks", "nodes"),
                    help="plan the case's software with this expert_dispatch instead")
    args = ap.parse_args()
    case = next(c for c in moe_plans.PUBLISHED if args.case.lower() in c.name.lower())
    if args.dispatch:
        case = dataclasses.replace(case, software_update={**case.software_update, "expert_dispatch": args.dispatch})
    p, (self, costs, out, ep, mb, tp, cluster, dtype, etp, fold) = moe_plans.plan_watching_experts(
        case, args.lift_memory)
    i = sorted(self.by_layer)[len(self.by_layer) // 2]
    b = self.by_layer[i][0]
    fold = fold and tp > 1
    group = self.ep_group(ep, tp, fold)
    share = 1.0 / tp if fold else 1.0
    nbytes = self.dispatch_bytes(b, mb, dtype, ep) * share
    a2a = self.exchange_time(b, mb, dtype, ep, cluster, group, share)
    counts = self.counts_time(b, cluster, group)
    k, g = self.node_span(cluster, group)
    m = p.num_microbatches
    per_chunk = len(p.stages[1].layers) if len(p.stages) > 1 else len(p.stages[0].layers)
    print(p.summary().splitlines()[1])
    print(p.software.summary())
    nodes = len({r // cluster.devices_per_node for r in group})
    print(f"{case.name}: layer {i} ({b.module}), one micro-batch of {mb}; ep {ep} over stage ranks {group[0]}.."
          f"{group[-1]} ({nodes} node(s)); a chunk's share of an iteration: x {m} micro-batches x {per_chunk} layers")
    if k > 1:
        r_ranks, r_nodes = self.ranks_per_token(b, ep), self.ranks_per_token(b, k)
        net = nbytes / r_ranks * r_nodes
        t_net = link_collective_time("all_to_all", net, k, cluster.inter_node)
        t_nvl = link_collective_time("all_to_all", nbytes, g, cluster.intra_node)
        print(f"  DeepEP internode path: {k} nodes x {g} ranks; a token reaches {r_ranks:.2f} ranks, {r_nodes:.2f} "
              f"nodes ({r_nodes * (k - 1) / k:.2f} others); network {net / 2**20:.0f} MiB a rank {t_net * 1e3:.3f} ms, "
              f"NVLink {nbytes / 2**20:.0f} MiB a rank {t_nvl * 1e3:.3f} ms: the exchange {a2a * 1e3:.3f} ms")
    agf, agb = self.fold_comm_s(b, mb, tp, cluster, dtype) if fold else (0.0, 0.0)
    etp_ar = self.etp_comm_s(b, mb, etp, cluster, dtype) if etp > 1 else 0.0
    c0, c1 = costs[i], out[i]
    rows = [
        ("tp/SP collectives, forward", c0.fwd_comm_s),
        ("tp/SP collectives, backward", c0.bwd_comm_s),
        (f"expert dispatch + combine, fwd ({nbytes / 2**20:.0f} MiB each)", 2 * a2a),
        ("expert dispatch + combine, bwd", 2 * a2a),
        ("expert counts exchange, fwd", counts),
        ("fold all-gathers over tp, fwd", agf),
        ("fold all-gathers over tp, bwd", agb),
        ("ETP all-reduces, fwd + bwd", 2 * etp_ar),
    ]
    tot = 0.0
    for name, s in rows:
        tot += s
        print(f"  {name:48s} {s * 1e3:8.3f} ms a layer {s * m * per_chunk:7.3f} s a chunk")
    print(f"  {'the layer, beside its compute':48s} {tot * 1e3:8.3f} ms a layer {tot * m * per_chunk:7.3f} s a chunk "
          f"(its cost: {(c1.fwd_comm_s + c1.bwd_comm_s) * 1e3:.3f} ms; compute {(c1.fwd_s + c1.bwd_s) * 1e3:.3f} ms)")
    sp = (p.stages[1] if len(p.stages) > 1 else p.stages[0]).predicted
    print(f"  stage 1's chunk: compute {sp.compute_s:.3f} s, communication {sp.communication_s:.3f} s (beyond its "
          f"layers' collectives, the pipeline sends: {sp.communication_s - tot * m * per_chunk:.3f} s), "
          f"bubble {sp.bubble_s:.3f} s")
    pr = p.predicted
    rest = pr.iteration_time_s - pr.compute_s - pr.communication_s - pr.bubble_s
    print(f"  iteration {pr.iteration_time_s:.2f} s = compute {pr.compute_s:.2f} + communication "
          f"{pr.communication_s:.2f} + bubble {pr.bubble_s:.2f} + the rest {rest:.2f}; "
          f"peak {pr.peak_memory_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
