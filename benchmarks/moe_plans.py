"""Mixture-of-experts plans on DGX H100 nodes (issue 17): Mixtral 8x7B (Hugging Face config,
s=4096, global batch 256) and the zoo's DeepSeekMoE 16B (64 routed experts top-6 + 2 shared,
s=4096, global batch 1024) planned freely on 1 to 16 nodes, the search choosing ep with
dp/tp/pp; and Mixtral pinned to the layout of Megatron-Core's published Mixtral run, against
its figure.

    python benchmarks/moe_plans.py [--nodes 1,2,4,8,16] [--only mixtral|deepseek] [--published [--case TEXT]]

Published (`PUBLISHED`, each with its source, FLOP convention and assumptions; `--published`
plans only them; "rs/mb" after the ZeRO stage: ZeRO-3's gradients reduce-scattered every
micro-batch, `Plan.zero3_grad_sync`): MoE training runs in bf16 on GPUs autopar has a profile for, of models it
captures, each planned pinned to its published layout with the software preset of the run: the
Megatron-Core MoE guide's Mixtral 8x7B (468 TFLOP/s; layout from a third-party script, an
assumption), NeMo AutoModel's Qwen3-30B-A3B on 8 H100 and four Qwen3-235B-A22B layouts of
NVIDIA's Megatron MoE model zoo on 256 H100. A run that does not plan is printed as a miss with
its reason. autopar's TFLOP/s count the captured FLOPs (routed tokens through their top-k
experts only, recomputation included).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from autopar import ClusterSpec, Constraints
from autopar.capture import capture
from autopar.planner import plan, resolve_model
from autopar.schema.plan import format_table
from autopar.schema.software import SoftwareSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))    # its sibling, loaded by path from the tests too
from megatron_flops import MEGATRON_TRAINING_PY, megatron_flops_for_ref  # noqa: E402

MODELS = {"mixtral": ("hf:mixtral-8x7b?seq_len=4096", 256), "deepseek": ("deepseek-moe-16b", 1024)}


@dataclass(frozen=True)
class Published:
    """A published MoE training run: its model, cluster, software and layout as the source gives
    them (`assumed` names each field not given there), and its figures."""
    name: str
    model: str
    global_batch: int
    profile: str
    nodes: int
    software: str
    pins: dict
    seconds: float | None      # published step time, s/iter (None: not published)
    tflops: float | None       # published TFLOP/s per GPU (None: not published)
    flops_rule: str            # how the source counts FLOPs
    source: str
    assumed: str
    # fields of the software preset the run changed (`SoftwareSpec`), each source in `assumed`
    software_update: dict = field(default_factory=dict)
    # the source's own FLOPs per sample of `model` (its formula), which turn `tflops` into the step
    # time it measured; None: the plan's captured FLOPs (`ModelInfo.flops_per_sample`)
    source_flops: Optional[Callable[[str], float]] = None


_MZ = ("github.com/yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md, 'Performance Results' (256 H100, "
       "NVLink 4, InfiniBand 8x50 GB/s), row ")
_MZ_FLOPS = "Megatron's 'Per GPU TF' (model FLOPs, active parameters, no recomputation counted)"
_MZ_NORM = ("recompute 'norm, act' (best_practice/qwen3/run_h100_235b.sh: --recompute-granularity selective "
            "--recompute-modules moe_act layernorm, Megatron's output-discarding recomputation of the layer norms and "
            "the expert activation) pinned as autopar's recompute 'norm_act', the same policy")
_MZ_DEEPEP = ("the readme table's Dispatcher column says DeepEP: Megatron's flex dispatcher over DeepEP's normal "
              "kernels (megatron/core/transformer/moe/fused_a2a.py: Buffer.dispatch / combine, the compute stream "
              "waiting on each), a token sent once to each rank holding any of its experts, and across nodes once "
              "to each node over the network, forwarded over NVLink there (expert_dispatch nodes); the EP "
              "exchange exposed: the row without the readme's '+1f1b overlap' note runs sbatch_benchmarking.sh's "
              "A2A_OVERLAP=0 default (no --overlap-moe-expert-parallel-comm / --delay-wgrad-compute)")

# The zoo's Megatron-LM (2025; model_configs/benchmarking/Qwen3-235B-A22B.yaml, every row): Transformer Engine
# (--transformer-impl transformer_engine; its norm kernels: RMSNorm, the q/k norms too, --qk-layernorm) with the
# fused MoE permutation (--moe-permute-fusion true) and Megatron's fused SwiGLU (bias_swiglu_fusion, Megatron's
# default; --no-bias-swiglu-fusion not set): `pointwise_fusion` norm_moe; TE's fused cross-entropy
# (--cross-entropy-loss-fusion true, --cross-entropy-fusion-impl te): `loss_kernel` fused
# The zoo's launch script of the same day as the table (examples/qwen3/run_235b.sh at 31c5686, 2025-05-27; the
# table came in 8017e11 that day) passes --moe-router-force-load-balancing in each of the five rows' commands
# (random router logits, Megatron's apply_random_logits): `expert_routing` forced_balance
# The table's Code column names Megatron-LM main(1e057005) (2025-05-24; row 1 an internal moe_dev branch),
# after 2659630721 (2025-04-09, "Memory efficient token permutation"): TEGroupedMLP applies the routing
# probabilities in the weighted SwiGLU and TE's fused permute / unpermute keep only row maps: `expert_saves`
# megatron_core (`ExpertCosting.megatron_saved`)
# and Megatron-Core's TE layer spec (megatron/core/models/gpt/gpt_layer_specs.py at 1e057005) runs every norm as
# a TE kernel (TENorm for the q/k and pre-MLP norms, the input norm inside TELayerNormColumnParallelLinear), TE's
# RMSNorm saving its input and the inverse RMS (ops/basic/rmsnorm.py): `norm_saves` input
# The zoo's yaml at 31c5686 passes no --tp-comm-overlap (Megatron-LM's store_true, off by default:
# megatron/training/arguments.py:1726 at 1e057005): its tp collectives waited, not the NeMo recipe's
# userbuffers overlaps the base preset carries (`tp_comm_overlap` empty); it leaves gradient accumulation
# fusion at Megatron's default, on (--no-gradient-accumulation-fusion store_false, arguments.py:1856-1860),
# as the base preset has it
# and the zoo's --bf16 with the distributed optimizer keeps fp32 gradients: Megatron-LM's arguments.py at 1e057005
# (lines 618-632) sets accumulate_allreduce_grads_in_fp32 for bf16 unless --grad-reduce-in-bf16 (not set), and
# Megatron-Core's DDP makes its grad buffer fp32 under grad_reduce_in_fp32 (distributed_data_parallel.py line 234;
# megatron/training/training.py line 1101 passes the flag): `grad_dtype` fp32
_MZ_SOFTWARE = {"pointwise_fusion": "norm_moe", "loss_kernel": "fused", "expert_routing": "forced_balance",
                "expert_saves": "megatron_core", "norm_saves": "input", "tp_comm_overlap": {}, "grad_dtype": "fp32"}
_MZ_FUSION = ("fused kernels as the zoo's model_configs/benchmarking/Qwen3-235B-A22B.yaml sets them: TE norms "
              "(--transformer-impl transformer_engine), --moe-permute-fusion true, Megatron's default fused SwiGLU "
              "(pointwise_fusion norm_moe), --cross-entropy-loss-fusion true with --cross-entropy-fusion-impl te "
              "(loss_kernel fused); routing forced balanced (expert_routing forced_balance: the zoo's "
              "examples/qwen3/run_235b.sh at 31c5686, committed the day the table was, passes "
              "--moe-router-force-load-balancing in each of these rows' commands, the FSDP row's with TP=1 where "
              "the table says TP2); the experts' activations as Megatron-Core keeps them (expert_saves megatron_core: "
              "the table's Code column main(1e057005) has 2659630721's weighted SwiGLU and the fused permutation's "
              "row maps); every norm one TE kernel saving its input and a statistic a row (norm_saves input: "
              "gpt_layer_specs.py's TENorm q/k and pre-MLP norms, TE ops/basic/rmsnorm.py "
              "save_for_backward(x, rstdevs)); fp32 gradients (grad_dtype fp32: --bf16 without --grad-reduce-in-bf16, "
              "Megatron-LM 1e057005 arguments.py lines 618-632, the DDP grad buffer fp32, "
              "distributed_data_parallel.py line 234)")

# Every case was looked at after the cost model's constants were set (none is set here): all held out.
PUBLISHED = [
    Published("Mixtral 8x7B, Megatron-Core v0.9", "hf:mixtral-8x7b?seq_len=4096", 256, "dgx-h100", 8,
              "nemo-megatron-core-2024", dict(tp=1, pp=4, dp=16, ep=8, microbatch_size=1), None, 468.0,
              "Megatron's formula as of the figure (" + MEGATRON_TRAINING_PY + " at c230e0d7c2, 2024-11-21, the "
              "commit that put 468 into the MoE README: lines 98-151, GEMMs only, each token through its top-2 "
              "experts, the whole s x s attention counted (line 137: + seq_length / hidden_size; halved only from "
              "8873b55d6a, 2025-03-06), the logits, no router; benchmarks/megatron_flops.py): the step time is "
              "those FLOPs over 468 TFLOP/s",
              "docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html (opening paragraph); "
              "github.com/NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md",
              "the whole layout (TP1 PP4 EP8, dp 16, 64 GPUs, mb 1, batch 256, s 4096) is a third-party "
              "reproduction script's; schedule, recompute and ZeRO left to the search; bf16 run by Megatron-LM, "
              "whose arguments.py at c230e0d7c2 (lines 337-343) forces accumulate_allreduce_grads_in_fp32 for "
              "bf16 and whose DDP keeps an fp32 grad buffer under it (distributed_data_parallel.py line 122): "
              "grad_dtype fp32",
              source_flops=partial(megatron_flops_for_ref, causal_half=False),
              software_update={"grad_dtype": "fp32"}),
    Published("Qwen3-30B-A3B, NeMo AutoModel", "hf:qwen3-30b-a3b?seq_len=4096", 512, "dgx-h100", 1,
              "nemo-automodel-2025",
              dict(tp=1, pp=1, dp=8, ep=8, microbatch_size=4, num_microbatches=16, zero_stage=3, recompute="full"),
              21.773, 277.0,
              "AutoModel's 'Model TFLOPs' (nemo_automodel/components/utils/flops_utils.py qwen3_flops: Megatron's "
              "formula with causal attention halved, line 207; benchmarks/megatron_flops.py with causal_half "
              "gives 277.0 at 21.773 s), so compare the step time",
              "github.com/NVIDIA-NeMo/Automodel docs/performance-summary.md (2025-10-02), 'Pre-Training "
              "Performance, System: DGX-H100, Precision: BF16', row 'Qwen3 MoE 30B'; layout from "
              "examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml",
              "software: the nemo-automodel-2025 preset (software_profiles/, each field from AutoModel's "
              "config and code at 8d9bfb90e) with the config's fake_balanced_gate: true (expert_routing "
              "fake_balanced: moe/layers.py FakeBalancedGate, token t to experts 8t..8t+7 mod 128, so one "
              "rank of 16 experts each); activation_checkpointing: true is moe/parallelizer.py apply_ac, "
              "checkpoint_wrapper around every block: full per-layer recompute; FSDP2 as ZeRO-3 (the "
              "experts, ep 8 over the 8 GPUs, are left out of FSDP: no expert data parallelism)",
              software_update={"expert_routing": "fake_balanced"}),
    Published("Qwen3-235B-A22B, MCore DeepEP, cross-node EP32", "hf:qwen3-235b-a22b?seq_len=4096", 2048, "dgx-h100",
              32, "nemo-megatron-core-2024",
              dict(tp=2, pp=8, virtual_stages=4, dp=16, ep=32, expert_dp=1, expert_tp=1, microbatch_size=1,
                   num_microbatches=128,
                   schedule="interleaved_1f1b", recompute="norm_act"),
              19.7, 245.0, _MZ_FLOPS, _MZ + "1 (TP2 EP32 PP8 VPP4 DP16 EDP1 ETP1, MBS1 GBS2048 GA128)",
              "EP32 spans TP2 x DP16 (Megatron's MoE parallel folding, autopar's folded experts); " + _MZ_NORM
              + "; " + _MZ_DEEPEP + "; " + _MZ_FUSION, software_update={"expert_dispatch": "nodes", **_MZ_SOFTWARE}),
    Published("Qwen3-235B-A22B, MCore DeepEP, intra-node EP8 FSDP", "hf:qwen3-235b-a22b?seq_len=4096", 2048, "dgx-h100",
              32, "nemo-megatron-core-2024",
              dict(tp=2, pp=1, dp=128, ep=8, expert_dp=32, expert_tp=1, microbatch_size=4, num_microbatches=4,
                   zero_stage=3, zero3_grad_sync="microbatch", recompute="full"),
              17.6, 276.0, _MZ_FLOPS, _MZ + "3 (TP2 EP8 PP1 EDP32 DP128 FSDP on, MBS4 GBS2048 GA4, full recompute)",
              "Megatron-FSDP as ZeRO-3, as the zoo runs it (examples/qwen3/run_235b.sh at 31c5686 line 37: "
              "--use-custom-fsdp --data-parallel-sharding-strategy optim_grads_params "
              "--no-gradient-accumulation-fusion) and Megatron-LM 1e057005 codes it "
              "(megatron/core/distributed/custom_fsdp/): every TransformerLayer one FSDP unit "
              "(fully_sharded_data_parallel.py 163-167), all-gathered in the parameters' bf16 "
              "(param_and_grad_buffer.py 1319-1330, 2325) for the forward and again for the full-recompute "
              "forward, which keeps it for the backward (fully_sharded_data_parallel.py 401-434, 522-559: two "
              "gathers a micro-batch); its gradients copied into an fp32 bucket (grad_reduce_in_fp32: "
              "arguments.py 618-632, training.py 1101; param_and_grad_buffer.py 1351-1362) and reduce-scattered "
              "from it in every micro-batch's backward, no_sync or not (optim_grads_params: "
              "fully_sharded_data_parallel.py 390-399, 498-506; pinned `zero3_grad_sync` microbatch); the "
              "experts' units over the expert data-parallel group, the rest over dp (param_and_grad_buffer.py "
              "1292-1296); gradient accumulation fusion off (`gradient_accumulation_fusion` false: the command's "
              "flag, which arguments.py 594-597 requires of optim_grads_params); EDP32 = TP2 x DP128 / EP8: the "
              "expert mesh folded over the tp and dp ranks (autopar's folded experts, expert_tp=1); its "
              "all-gathers and reduce-scatters beside the compute (`zero3_overlap`: optim_grads_params turns on "
              "--overlap-param-gather and --overlap-grad-reduce, arguments.py 531-533, as the zoo's yaml does; "
              "the reduce-scatters on a side stream, fully_sharded_data_parallel.py 232-236; a micro-batch pays "
              "what exceeds its forward, backward and recomputed forward compute); "
              + _MZ_DEEPEP + "; " + _MZ_FUSION,
              software_update={"zero3_overlap": True, "expert_dispatch": "nodes", **_MZ_SOFTWARE,
                               "gradient_accumulation_fusion": False}),
    Published("Qwen3-235B-A22B, MCore all-to-all, PP32", "hf:qwen3-235b-a22b?seq_len=4096", 2048, "dgx-h100", 32,
              "nemo-megatron-core-2024",
              dict(tp=2, pp=32, virtual_stages=3, dp=4, ep=8, expert_dp=1, expert_tp=1, microbatch_size=1,
                   num_microbatches=512, account_in_split=("embedding", "loss"),
                   schedule="interleaved_1f1b", recompute="norm_act"),
              24.2, 200.0, _MZ_FLOPS, _MZ + "4 (A2A dispatcher, TP2 EP8 PP32 VPP3 DP4 EDP1 ETP1, MBS1 GA512)",
              "EP8 spans TP2 x DP4 (folding, autopar's folded experts); the embedding and the loss each a "
              "layer slot of its own (the zoo's model_configs/benchmarking/Qwen3-235B-A22B.yaml lines 27-28 "
              "set --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split; "
              "runtime_configs/benchmarking/runtime.conf line 13 counts 96 layers, so 96 / 32 / 3 = 1 slot a "
              "chunk: the first chunk the embedding alone, the last the loss alone), searched as "
              "`account_in_split`; " + _MZ_NORM + "; " + _MZ_FUSION, software_update=dict(_MZ_SOFTWARE)),
    Published("Qwen3-235B-A22B, MCore DeepEP, TP4 EP8 PP8", "hf:qwen3-235b-a22b?seq_len=4096", 2048, "dgx-h100", 32,
              "nemo-megatron-core-2024",
              dict(tp=4, pp=8, virtual_stages=4, dp=8, ep=8, expert_dp=4, expert_tp=1, microbatch_size=1,
                   num_microbatches=256,
                   schedule="interleaved_1f1b", recompute="none"),
              29.0, 167.0, _MZ_FLOPS, _MZ + "5 (TP4 EP8 PP8 VPP4 EDP4 ETP1 DP8, MBS1 GA256, no recompute)",
              "Megatron's EDP4 = TP4 x DP8 / EP8 reuses the tp ranks as expert data parallelism: autopar's folded "
              "experts (expert_dp=4, expert_tp=1); " + _MZ_DEEPEP + "; " + _MZ_FUSION,
              software_update={"expert_dispatch": "nodes", **_MZ_SOFTWARE}),
]


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
    ap.add_argument("--published", action="store_true", help="only the published runs, pinned")
    ap.add_argument("--case", help="with --published: only the runs whose name contains TEXT (e.g. PP32)")
    args = ap.parse_args()
    if args.published:
        published(args.case)
        return
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
    print(format_table(HEAD, rows))
    if not args.only:
        published()


def plan_published(case: Published, lift_memory: float = 1.0):
    """`autopar.plan` of one published run, pinned to its layout, with the software it ran
    (`lift_memory`: the devices' memory times that, to see the time of a run that does not fit)."""
    bundle = resolve_model(case.model, None, None)
    graph = capture(bundle.model, bundle.example_inputs, name=bundle.name, cache=True)
    software = SoftwareSpec.load(case.software)
    if case.software_update:
        named = ", ".join(f"{k}={v}" for k, v in case.software_update.items())
        software = SoftwareSpec.model_validate({**software.model_dump(), **case.software_update,
                                                "name": f"{software.name} ({named})"})
    cluster = ClusterSpec.load(case.profile, num_nodes=case.nodes)
    if lift_memory != 1.0:
        cluster = cluster.model_copy(update={"device": cluster.device.model_copy(
            update={"memory_bytes": cluster.device.memory_bytes * lift_memory})})
    return plan(bundle, cluster, global_batch_size=case.global_batch, graph=graph, cache=True,
                constraints=Constraints(**case.pins), software=software)


def published_seconds(case: Published, p) -> float:
    """The run's step time: published, or the time its published TFLOP/s give for the FLOPs its
    source counted (`source_flops`, the source's own formula for the model), else for the FLOPs
    the plan captured without recomputation (`ModelInfo.flops_per_sample`: routed tokens through
    their top-k experts)."""
    if case.seconds is not None:
        return case.seconds
    per_sample = case.source_flops(case.model) if case.source_flops else p.model.flops_per_sample
    devices = p.cluster.num_nodes * p.cluster.devices_per_node
    return per_sample * case.global_batch / (devices * case.tflops * 1e12)


def plan_watching_experts(case: Published, lift_memory: float = 1.0):
    """(`plan_published(case, lift_memory)`, the arguments and result of the search's
    `ExpertCosting.layer_costs` call at the case's pinned ep, micro-batch and tp: (costing, costs,
    out, ep, mb, tp, cluster, dtype, etp, fold)), for the benchmarks that break a published run's
    expert terms down (`moe_comm_breakdown.py`, `moe_missing_time.py`)."""
    from autopar.inter_op import experts as ex

    seen: dict = {}
    orig = ex.ExpertCosting.layer_costs

    def spy(self, costs, ep, mb, tp, cluster, dtype, etp=1, fold=False):
        out = orig(self, costs, ep, mb, tp, cluster, dtype, etp, fold)
        if ep == case.pins.get("ep") and mb == case.pins.get("microbatch_size") and tp == case.pins.get("tp"):
            seen["args"] = (self, costs, out, ep, mb, tp, cluster, dtype, etp, fold)
        return out

    ex.ExpertCosting.layer_costs = spy
    try:
        p = plan_published(case, lift_memory)
    finally:
        ex.ExpertCosting.layer_costs = orig
    if "args" not in seen:
        raise SystemExit(f"{case.name}: the search never costed the experts at the case's pins (ep "
                         f"{case.pins.get('ep')}, micro-batch {case.pins.get('microbatch_size')}, tp "
                         f"{case.pins.get('tp')}): nothing to break down")
    return p, seen["args"]


def time_error(case: Published, p) -> float:
    """The prediction's step-time error against the run's step time (`published_seconds`)."""
    return p.predicted.iteration_time_s / published_seconds(case, p) - 1


def published(case_filter: str | None = None) -> None:
    """Each published run planned pinned to its layout, with the software it used (those whose
    name contains `case_filter`, where given)."""
    rows = []
    cases = [c for c in PUBLISHED if not case_filter or case_filter.lower() in c.name.lower()]
    if not cases:
        raise SystemExit(f"--case {case_filter!r} names no published run; one of: "
                         + "; ".join(c.name for c in PUBLISHED))
    for case in cases:
        t = time.perf_counter()
        try:
            p = plan_published(case)
        except Exception as e:  # noqa: BLE001 - a published run that does not plan is a miss, printed with why
            rows.append([case.name, case.profile, str(case.nodes), "-", "-", "-", "-", "-", "-", "-",
                         _fig(case.seconds, None, "s"), _fig(case.tflops, None, ""), f"miss: {str(e)[:80]}"])
            continue
        s, tf = p.predicted.iteration_time_s, p.predicted.tflops_per_device
        fold = f" edp{p.experts.expert_dp}{' folded' if p.experts.folded else ''}" if p.experts else ""
        rows.append([case.name, case.profile, str(case.nodes), f"{p.dp}/{p.ep}/{p.tp}/{p.pp}{fold}",
                     f"{p.microbatch_size}x{p.num_microbatches}",
                     p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""),
                     str(p.zero_stage) + (" rs/mb" if p.zero3_grad_sync == "microbatch" else ""),
                     p.stages[0].recompute, f"{p.predicted.peak_memory_bytes / 2**30:.1f}",
                     f"{time.perf_counter() - t:.1f}", _fig(published_seconds(case, p), s, "s"),
                     _fig(case.tflops, tf, ""),
                     p.search.get("ep_executor", "")[:80]])
        print(format_table(PUB_HEAD, rows[-1:]), flush=True)
    print(format_table(PUB_HEAD, rows))
    for case in cases:
        print(f"- {case.name}: {case.source}. FLOPs: {case.flops_rule}. Assumed: {case.assumed}.")


def _fig(published: float | None, predicted: float | None, unit: str) -> str:
    """'predicted / published (error)' or what of it exists."""
    if predicted is None:
        return "-" if published is None else f"- / {published:g}{unit}"
    if published is None:
        return f"{predicted:.3g}{unit} / -"
    return f"{predicted:.3g}{unit} / {published:g}{unit} ({(predicted - published) / published:+.0%})"


HEAD = ["model", "nodes", "dp/ep/tp/pp", "mb x m", "schedule", "zero", "recompute", "s/iter", "TFLOP/s/GPU",
        "peak GiB", "search s", "pinned", "published TFLOP/s (error)"]
PUB_HEAD = ["published run", "profile", "nodes", "dp/ep/tp/pp", "mb x m", "schedule", "zero", "recompute",
            "peak GiB", "plan s", "s/iter predicted / published (error)", "TFLOP/s/GPU predicted / published (error)",
            "miss / not executed"]

if __name__ == "__main__":
    main()
