"""Predicted vs tracked peak memory, per plan, rank and category (issue 18).

    python benchmarks/memory_accuracy.py [--json] [--only SUBSTRING] [--list] [--top N] [--timeline] [--markdown]

Plans come from `autopar.plan` (`autopar.planner.plan`, the model captured once) on the
bundled CPU cluster profile (`cpu`, its devices per node set to the job's 2 or 4 processes),
for the zoo's `gpt-tiny`, `mlp-tiny` and `moe-tiny` (and `tests.plans:gpt_tiny6`, gpt-tiny with 6 blocks,
where a pipeline needs more layers: 4 stages, interleaving), a GPT written independently of the
zoo (`tests.user_models:nanogpt`), tiny Hugging Face GPT-2 and Llama configurations (`hf:`,
with their default dropout; Mixtral and Qwen3-MoE, `HF_MOE`) and a Hugging Face Mistral wrapped by a user
(`tests.hf_architectures:mistral`, under context parallelism: its own positions), each
pinned with `autopar.Constraints` to one combination: dp / tp
/ pp and their products, ZeRO 0-3, recompute none / selective / full, schedules gpipe / 1f1b /
interleaved_1f1b, Megatron-SP (`sequence_parallel`, pinned off where a combination does not name
it), bf16 and fp32. Combinations that do not plan are listed with the PlanError's
text and, like a plan that fails to run, counted as misses (a plan every rank fails to build
alike is recorded and the launch goes on). The global batch is large enough that activations
weigh as much as the model states or more (gpt-tiny: 32 sequences of 16 tokens; mlp-tiny: 256
rows).

Every plan then runs on the real runtime (`ParallelModel`, gloo, 2 or 4 processes, one launch
per world size for all its plans): one step untracked (AdamW allocates its state in the first
step's update), then the second step under `autopar.runtime.memory_tracking.track_step`. Printed
per plan and rank: the tracked peak and the phase it fell in, the prediction of the stage the
rank belongs to (of the chunks a rank holds, the largest: each is the device's peak), the error
(predicted - tracked) / tracked, and per category tracked / predicted (KiB): the plan predicts
one moment, and where the run reaches its peak at several moments within 1% of each other
(`memory_tracking.NEAR_PEAK`), the tracked categories are those of the moment nearest the
prediction (`closest_moment`). `--json` prints one record per plan instead; `--timeline`
prints each rank's local peaks op by op.

Takes about 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT6 = "tests.plans:gpt_tiny6"
NANOGPT = "tests.user_models:nanogpt"
MISTRAL = "tests.hf_architectures:mistral"
_TINY = "num_hidden_layers=2&num_attention_heads=4&seq_len=16&vocab_size=128"
HF = (f"hf:gpt2?hidden_size=64&{_TINY}",
      f"hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&{_TINY}")
# Hugging Face mixtures of experts (tiny configs; their grouped-GEMM experts behind the
# exchange at ep > 1, `runtime.experts.ExpertParallelExperts`)
HF_MOE = ("hf:mixtral?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_local_experts=4"
          "&num_hidden_layers=2&num_attention_heads=4&seq_len=32&vocab_size=128",
          "hf:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=32&num_key_value_heads=2"
          "&num_experts=8&num_experts_per_tok=2&num_hidden_layers=2&num_attention_heads=4&vocab_size=128"
          "&seq_len=32")
CATS = ("weights", "gradients", "optimizer", "activations", "buffers")


def _specs() -> list[dict]:
    """The combinations: model, processes, global batch, dtype, constraints."""
    out: list[dict] = []

    def add(model: str, n: int, gbs: int, dtype: str, **cons: object) -> None:
        short = model.split("?")[0].split(":")[-1]
        name = f"{short} {dtype} " + " ".join(f"{k}={v}" for k, v in cons.items())
        out.append({"name": name, "model": model, "nproc": n, "gbs": gbs, "dtype": dtype, "constraints": cons})

    for dtype in ("bf16", "fp32"):
        g = "gpt-tiny"
        # data parallel, every ZeRO stage; recomputation
        for z in (0, 1, 2, 3):
            add(g, 2, 32, dtype, dp=2, tp=1, pp=1, zero_stage=z, recompute="none")
        add(g, 2, 32, dtype, dp=2, tp=1, pp=1, zero_stage=0, recompute="selective")
        add(g, 2, 32, dtype, dp=2, tp=1, pp=1, zero_stage=0, recompute="full")
        # tensor parallel
        add(g, 2, 32, dtype, dp=1, tp=2, pp=1, recompute="none")
        add(g, 2, 32, dtype, dp=1, tp=2, pp=1, recompute="full")
        add(g, 2, 32, dtype, dp=1, tp=2, pp=1, recompute="norm_act")
        # pipelines
        for sched in ("gpipe", "1f1b"):
            add(g, 2, 32, dtype, dp=1, tp=1, pp=2, schedule=sched, num_microbatches=4, recompute="none")
        add(g, 2, 32, dtype, dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4, recompute="full")
        add(GPT6, 2, 32, dtype, dp=1, tp=1, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
            num_microbatches=4, recompute="none")
        # 4 processes: products
        add(g, 4, 32, dtype, dp=4, tp=1, pp=1, zero_stage=0, recompute="none")
        add(g, 4, 32, dtype, dp=4, tp=1, pp=1, zero_stage=3, recompute="none")
        add(g, 4, 32, dtype, dp=2, tp=2, pp=1, zero_stage=0, recompute="none")
        add(g, 4, 32, dtype, dp=2, tp=2, pp=1, zero_stage=1, recompute="none")
        add(g, 4, 32, dtype, dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=4, zero_stage=0,
            recompute="none")
        add(g, 4, 32, dtype, dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=4, zero_stage=2,
            recompute="none")
        add(g, 4, 32, dtype, dp=2, tp=1, pp=2, schedule="gpipe", num_microbatches=4, zero_stage=3,
            recompute="none")
        add(g, 4, 32, dtype, dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=4, recompute="none")
        add(g, 4, 32, dtype, dp=1, tp=2, pp=2, schedule="gpipe", num_microbatches=4, recompute="selective")
        # Megatron-SP (norms and residual adds on sequence slices)
        add(g, 2, 32, dtype, dp=1, tp=2, pp=1, recompute="none", sequence_parallel=True)
        add(g, 4, 32, dtype, dp=2, tp=2, pp=1, zero_stage=1, recompute="full", sequence_parallel=True)
        add(g, 4, 32, dtype, dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=4, recompute="none",
            sequence_parallel=True)
        add(GPT6, 4, 32, dtype, dp=1, tp=1, pp=4, schedule="1f1b", num_microbatches=4, recompute="none")
        # context parallelism (each sequence over the cp ranks, keys and values exchanged in
        # attention): alone, with full recomputation, with dp and ZeRO-1, with tp (op by op as
        # solved) and in a pipeline
        add(g, 2, 32, dtype, dp=1, tp=1, pp=1, cp=2, recompute="none")
        add(g, 2, 32, dtype, dp=1, tp=1, pp=1, cp=2, recompute="full")
        add(g, 4, 32, dtype, dp=2, tp=1, pp=1, cp=2, zero_stage=1, recompute="none")
        add(g, 4, 32, dtype, dp=1, tp=2, pp=1, cp=2, recompute="none")
        add(g, 4, 32, dtype, dp=1, tp=1, pp=2, cp=2, schedule="1f1b", num_microbatches=4, recompute="none")
        # separate K and V projections (nothing keeps the rank's own K and V once gathered)
        add("llama-tiny", 2, 32, dtype, dp=1, tp=1, pp=1, cp=2, recompute="none")
        # models that make their own positions (`capture.own_positions`: run as their program
        # traced at a rank's tokens): nanoGPT (learned positions) and a Hugging Face Mistral
        # wrapped by a user (rotary, labels shifted inside), alone and with tp (op by op)
        add(NANOGPT, 2, 32, dtype, dp=1, tp=1, pp=1, cp=2, recompute="none")
        add(MISTRAL, 2, 8, dtype, dp=1, tp=1, pp=1, cp=2, recompute="none")
        add(MISTRAL, 4, 8, dtype, dp=1, tp=2, pp=1, cp=2, recompute="none")
        # the MLP
        m = "mlp-tiny"
        add(m, 2, 256, dtype, dp=2, tp=1, pp=1, zero_stage=0)
        add(m, 2, 256, dtype, dp=2, tp=1, pp=1, zero_stage=3)
        # ZeRO-3 reduce-scattering every micro-batch's gradients (fp32 shards accumulated)
        add(m, 2, 256, dtype, dp=2, tp=1, pp=1, zero_stage=3, num_microbatches=4, zero3_grad_sync="microbatch")
        add(m, 2, 256, dtype, dp=1, tp=2, pp=1)
        add(m, 2, 256, dtype, dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4)
        add(m, 4, 256, dtype, dp=2, tp=2, pp=1, zero_stage=0)
        # a GPT written as nanoGPT does, not the zoo's (fused qkv split, head read from the
        # embedding's weight, its own loss): the layouts a user's model is planned and run with
        u = NANOGPT
        add(u, 2, 32, dtype, dp=2, tp=1, pp=1, zero_stage=0, recompute="none")
        add(u, 2, 32, dtype, dp=2, tp=1, pp=1, zero_stage=3, recompute="none")
        add(u, 2, 32, dtype, dp=1, tp=2, pp=1, recompute="none")
        add(u, 2, 32, dtype, dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4, recompute="none")
        # the zoo's mixture of experts (8 routed experts top-2 and a shared one per block, each
        # expert's tokens gathered by index and combined by index_add): data parallel, ZeRO-3,
        # and expert parallelism (each rank its slice of the experts, tokens exchanged all-to-all)
        e = "moe-tiny"
        add(e, 2, 16, dtype, dp=2, tp=1, pp=1, zero_stage=0, recompute="none")
        add(e, 2, 16, dtype, dp=2, tp=1, pp=1, zero_stage=3, recompute="none")
        add(e, 4, 16, dtype, dp=4, tp=1, pp=1, ep=4, zero_stage=0, recompute="none")
        # ZeRO-3 with one copy of each expert (ep = dp): FSDP leaves the experts alone, so
        # each rank holds its experts' weights whole beside the dense units' shards (session
        # 35: HF Mixtral's dp8 x ep8 ZeRO-3 plan at full scale verified -8.4%, the 2-byte
        # expert weights left out)
        add(e, 2, 16, dtype, dp=2, tp=1, pp=1, ep=2, zero_stage=3, recompute="none")
        # ZeRO-1 with two copies of each expert: the dense and the expert flat buffers apart
        add(e, 4, 16, dtype, dp=4, tp=1, pp=1, ep=2, zero_stage=1, recompute="none")
        # output-discarding recomputation ("norm_act") on a tp stage, run op by op: the norms'
        # DTensor outputs discarded once saved and re-made (`execute._DiscardState`), the
        # experts' SiLU product by the experts modules replaced for expert parallelism
        add(e, 4, 16, dtype, dp=2, tp=2, pp=1, ep=2, zero_stage=1, recompute="norm_act")
        # two sequences a rank: the experts' backward, not the loss's, holds the peak
        add(e, 4, 8, dtype, dp=4, tp=1, pp=1, zero_stage=3, recompute="none")
        # the same, two copies of each expert (their FSDP units over 2 ranks), every
        # micro-batch's gradients reduce-scattered
        add(e, 4, 16, dtype, dp=4, tp=1, pp=1, ep=2, zero_stage=3, num_microbatches=2, zero3_grad_sync="microbatch",
            recompute="none")
        # Hugging Face mixtures of experts at ep 2, with and without "norm_act" (session 36:
        # Mixtral bf16 ep 2 was -5.6% (the exchange's saves were counted for the zoo's combine
        # only) and -10.7% with norm_act, dp 2 norm_act -5.3% (the tracker's look at the
        # experts' `act_fn` output ended the activation's region); now within 2%)
        for hf in HF_MOE:
            for rc in ("none", "norm_act"):
                add(hf, 2, 16, dtype, dp=2, tp=1, pp=1, ep=2, zero_stage=1, recompute=rc)
        add(HF_MOE[0], 2, 16, dtype, dp=2, tp=1, pp=1, zero_stage=1, recompute="norm_act")
        # Hugging Face classes (tiny configs, default dropout): data parallel, ZeRO-3, tensor
        # parallel and a pipeline cut from the traced model (position ids, a causal mask and,
        # for Llama, rotary tables cross its boundary beside the hidden states)
        for hf in HF:
            add(hf, 2, 8, dtype, dp=2, tp=1, pp=1, zero_stage=0, recompute="none")
            add(hf, 2, 8, dtype, dp=2, tp=1, pp=1, zero_stage=3, recompute="none")
            add(hf, 2, 8, dtype, dp=1, tp=2, pp=1, recompute="none")
            add(hf, 2, 8, dtype, dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4, recompute="none")
    return out


def _architecture_specs() -> list[dict]:
    """`--architectures`: Hugging Face architectures autopar has no `hf:` family for, wrapped as
    a user would (`tests/hf_architectures.py`), each at dp 2 with ZeRO-3, tp 2, pp 2 under 1F1B
    and tp 2 with full recomputation, bf16 and fp32, on 2 processes."""
    from tests.hf_architectures import ARCHITECTURES

    out: list[dict] = []
    for dtype in ("bf16", "fp32"):
        for name in ARCHITECTURES:
            m = f"tests.hf_architectures:{name}"
            for cons in (dict(dp=2, tp=1, pp=1, zero_stage=3, recompute="none"),
                         dict(dp=1, tp=2, pp=1, recompute="none"),
                         dict(dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4, recompute="none"),
                         dict(dp=1, tp=2, pp=1, recompute="full")):
                out.append({"name": f"{name} {dtype} " + " ".join(f"{k}={v}" for k, v in cons.items()), "model": m,
                            "nproc": 2, "gbs": 32, "dtype": dtype, "constraints": cons})
    return out


def make_plans(specs: list[dict], folder: str) -> tuple[list[dict], list[dict]]:
    """Plan every spec into `folder`; returns (planned: spec + "path", skipped: spec + "reason")."""
    import autopar
    from autopar.capture import capture
    from autopar.models.registry import build_model
    from autopar.planner import ProviderCache, plan
    from autopar.schema.errors import PlanError

    graphs: dict = {}   # one capture per model (what autopar.plan does first, every call)
    # per-layer costs shared by the plans of one model, device and dtype (as `autopar.sweep`
    # shares them): the plan `autopar.plan` makes without them (`ProviderCache`)
    providers = ProviderCache()
    planned, skipped = [], []
    for i, s in enumerate(specs):
        cluster = autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": s["nproc"]})
        if s["model"] not in graphs:
            b = build_model(s["model"], device="meta")
            graphs[s["model"]] = capture(b.model, b.example_inputs, name=b.name)
        try:
            p = plan(s["model"], cluster, global_batch_size=s["gbs"], dtype=s["dtype"],
                     constraints=autopar.Constraints(**{"sequence_parallel": False, **s["constraints"]}),
                     graph=graphs[s["model"]], providers=providers)
        except PlanError as e:
            skipped.append(dict(s, reason=str(e)))
            continue
        path = os.path.join(folder, f"plan{i}.json")
        p.save(path)
        planned.append(dict(s, path=path))
    return planned, skipped


# -- the job each launched process runs -------------------------------------------------------

def worker(out: str, plan_paths: list[str]) -> None:
    """Under torchrun: for each plan, one untracked step, then one tracked; rank 0 writes
    {path: [report per rank] or {"error": ...}} to `out` after every plan."""
    import gc

    import torch.distributed as dist

    from autopar.models.registry import build_model, call_batch_fn
    from autopar.runtime.engine import ParallelModel
    from autopar.runtime.memory_tracking import baseline, track_step
    from autopar.runtime.worker import init_distributed
    from autopar.schema.plan import load_plan

    init_distributed()
    results: dict = {}
    for path in plan_paths:
        plan = load_plan(path)
        t0 = time.perf_counter()
        try:
            base = baseline()
            bundle = build_model(plan.model.name, device="meta")
            pm = ParallelModel(plan, bundle, seed=0)
            G = plan.global_batch_size
            pm.train_step(pm.local_batch(call_batch_fn(bundle.batch_fn, 0, G, 0)))
            _, rep = track_step(pm, pm.local_batch(call_batch_fn(bundle.batch_fn, 1, G, 0)), skip=base,
                                top=int(os.environ.get("AUTOPAR_MEMORY_TOP", "0")),
                                timeline=bool(os.environ.get("AUTOPAR_MEMORY_TIMELINE")))
            mine = rep.to_dict()
            del pm, bundle, base
        except Exception as e:  # noqa: BLE001 - recorded per plan; the launch fails below
            mine = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        mine["seconds"] = time.perf_counter() - t0
        allr: list = [None] * dist.get_world_size()
        dist.all_gather_object(allr, mine)
        results[path] = allr
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(results))
        failed = [r for r in allr if "error" in r]
        if failed and len(failed) < len(allr):
            # some ranks failed, others may wait in a collective: the launch cannot go on
            raise RuntimeError(f"{path}: " + "; ".join(r["error"] for r in failed))
        # every rank failed alike (a plan the runtime refuses while building): recorded as a
        # miss, the launch goes on with the next plan
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def measure(planned: list[dict]) -> dict:
    """Run the planned specs, one launch per world size; returns {path: [report per rank]}.
    A launch that fails keeps the plans it finished; the others get {"error": ...}."""
    import functools

    from autopar.runtime.shared_programs import trace_plan_files
    from tests.launch import elastic_run

    results: dict = {}
    for n in sorted({s["nproc"] for s in planned}):
        paths = [s["path"] for s in planned if s["nproc"] == n]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        err = ""
        try:
            # the programs each rank traces alike, traced once before they fork
            elastic_run(Path(__file__).resolve(), ["--worker", out, *paths], n,
                        prepare=functools.partial(trace_plan_files, paths))
        except Exception as e:  # noqa: BLE001 - the launch's failure is reported per plan
            err = f"{type(e).__name__}: {str(e)[:500]}"
        got = json.loads(Path(out).read_text()) if os.path.getsize(out) else {}
        os.unlink(out)
        for p in paths:
            results[p] = got.get(p) or [{"error": err or "not run"}]
    return results


# -- the comparison ---------------------------------------------------------------------------

def compare(planned: list[dict], results: dict) -> list[dict]:
    """One record per plan: per rank tracked vs predicted (its stage), per category."""
    from autopar.runtime.memory_tracking import predicted_for_rank, relative_error
    from autopar.schema.plan import load_plan

    recs = []
    for s in planned:
        plan = load_plan(s["path"])
        reps = results.get(s["path"], [{"error": "not run"}])
        rec = {k: s[k] for k in ("name", "model", "nproc", "gbs", "dtype", "constraints")}
        rec["plan"] = {"stages": [(st.index, st.devices, list(st.mesh_shape), list(st.mesh_axis_names),
                                   st.recompute) for st in plan.stages],
                       "schedule": plan.schedule, "zero_stage": plan.zero_stage,
                       "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches}
        errs = [r["error"] for r in reps if "error" in r]
        if errs:
            rec["error"] = errs[0]
            recs.append(rec)
            continue
        ranks = []
        for r, rep in enumerate(reps):
            p = predicted_for_rank(plan, r)
            pc = {c: p[c] for c in CATS} if p else None
            at_peak = closest_moment([rep["categories"], *rep.get("near", [])], pc)
            ranks.append({"rank": r, "stage": p["stage"] if p else None, "tracked": rep["peak_bytes"],
                          "tracked_phases": {k: closest_moment([v["categories"], *v.get("near", [])],
                                                               (p or {}).get("phases", {}).get(k))
                                             for k, v in rep["phases"].items()},
                          "near_moments": len(rep.get("near", [])),
                          "predicted_phases": p["phases"] if p else {},
                          "tracked_phase": rep["peak_phase"],
                          "predicted": p["peak_bytes"] if p else None,
                          "predicted_phase": p["peak_phase"] if p else None,
                          "error": relative_error(rep["peak_bytes"], p["peak_bytes"]) if p else None,
                          "tracked_categories": at_peak, "tracked_detail": rep["detail"],
                          "predicted_categories": pc,
                          "phases": {k: v["peak_bytes"] for k, v in rep["phases"].items()},
                          "untracked_bytes": rep["untracked_bytes"], "notes": rep["notes"],
                          "peak_tensors": rep.get("peak_tensors", []),
                          **({"timeline": rep["timeline"]} if rep.get("timeline") else {})})
        rec["ranks"] = ranks
        rec["category_misses"] = [f"rank {x['rank']} {c} {_kib(x['tracked_categories'][c])}/{_kib(v)}"
                                  for x in ranks for c, v in (x["predicted_categories"] or {}).items()
                                  if not category_within(x["tracked_categories"][c], v)]
        rec["phase_misses"] = [f"rank {x['rank']} {ph[:3]} {c} {_kib(t)}/{_kib(pr)}"
                               for x in ranks for ph, c, t, pr in phase_categories(x)
                               if not category_within(t, pr)]
        errs = [abs(x["error"]) for x in ranks if x["error"] is not None]
        rec["max_abs_error"] = max(errs) if errs else None
        recs.append(rec)
    return recs


def closest_moment(moments: list[dict], predicted: dict | None) -> dict:
    """Of the tracked moments at a peak (the peak's and those within `memory_tracking.NEAR_PEAK`
    of it: `MemoryReport.near`, `PhasePeak.near`), the one whose categories are nearest the
    predicted ones (the smallest largest miss, in multiples of each category's tolerance); the
    peak's own when nothing is predicted. The plan predicts one moment: when the run reaches
    its peak at several near-equal ones, it is compared with the one it describes."""
    cats = [{c: int(m[c]) for c in CATS} for m in moments]
    if not predicted:
        return cats[0]
    return min(cats, key=lambda m: max(abs(predicted[c] - m[c]) / max(0.05 * m[c], 2048) for c in CATS))


def category_within(tracked: float, predicted: float, tolerance: float = 0.05) -> bool:
    """One category at the peak: within `tolerance` or 2 KiB (the tracker and the plan split a
    few small tensors differently: FSDP's unsharded storages vs its flat all-gather output)."""
    return abs(predicted - tracked) <= max(tolerance * tracked, 2048)


def phase_categories(rank: dict) -> list[tuple[str, str, float, float]]:
    """(phase, category, tracked, predicted) for every phase both the run and the plan have:
    each phase's own peak, so that two moments of near-equal total in different phases (the
    step's peak in one, the plan's in the other) are each compared with their own."""
    out = []
    for ph, pred in rank.get("predicted_phases", {}).items():
        got = rank["tracked_phases"].get(ph)
        if got is not None:
            out.extend((ph, c, got[c], pred[c]) for c in CATS)
    return out


def _kib(x: float | None) -> str:
    return "-" if x is None else f"{x / 1024:.0f}"


def print_timeline(rows: list[dict]) -> None:
    """A rank's tracked timeline (`--timeline`), KiB: the moments that are a local peak (more
    than the moments either side), each with its categories and the op and module there."""
    for i, t in enumerate(rows):
        before = rows[i - 1]["bytes"] if i else -1
        after = rows[i + 1]["bytes"] if i + 1 < len(rows) else -1
        if t["bytes"] > before and t["bytes"] >= after:
            cats = " ".join(f"{c[0]}{_kib(v):>5}" for c, v in t["categories"].items())
            print(f"         {i:5d} {_kib(t['bytes']):>7} {cats}  {t['phase'][:3]} {t['pass'][:3]} "
                  f"{t['op']} {t['module']}")


def print_markdown(recs: list[dict], skipped: list[dict]) -> None:
    """The README's table: per layout, the worst rank's tracked and predicted peak (KiB) and
    error, and whether every category matched at the peak and at each phase's peak."""
    print("| layout | plan | worst rank: tracked / predicted KiB | error | categories at the peak | "
          "at each phase's peak |")
    print("|---|---|---|---|---|---|")
    for rec in recs:
        name = rec["name"].replace(" tp=1", "").replace(" pp=1", "").replace(" dp=1", "")
        p = rec["plan"]
        plan = (f"gbs {rec['gbs']}, mb {p['microbatch_size']} x {p['num_microbatches']}, {p['schedule']}, "
                f"zero {p['zero_stage']}")
        if "error" in rec:
            print(f"| {name} | {plan} | failed: {rec['error'][:80]} | miss | | |")
            continue
        w = max(rec["ranks"], key=lambda r: abs(r["error"] or 0.0))
        err = "-" if w["error"] is None else f"{100 * w['error']:+.1f}%"
        print(f"| {name} | {plan} | {_kib(w['tracked'])} / {_kib(w['predicted'])} | {err} | "
              f"{'; '.join(rec['category_misses'][:2]) or 'yes'} | {'; '.join(rec['phase_misses'][:2]) or 'yes'} |")
    for s in skipped:
        print(f"| {s['name']} | no plan: {s['reason'][:80]} | | miss | | |")
    ok = [r for r in recs if r.get("max_abs_error") is not None]
    total = len(recs) + len(skipped)
    errs = sorted(r["max_abs_error"] for r in ok)
    if errs:
        print(f"\n{total} combinations; worst rank's |error| median {100 * errs[len(errs) // 2]:.1f}%, max "
              f"{100 * errs[-1]:.1f}%; **{sum(e <= 0.05 for e in errs)} within 5%** (a plan that failed to run "
              f"or did not plan counts as a miss); every category within 5% or 2 KiB at the peak: "
              f"{sum(not r['category_misses'] for r in ok)}; at each phase's peak: "
              f"{sum(not r['phase_misses'] for r in ok)}.")


def print_table(recs: list[dict], skipped: list[dict]) -> None:
    head = (f"{'rank':>4} {'st':>2} {'tracked':>8} {'pred':>8} {'err':>7} {'phase t/p':>9}  "
            + "  ".join(f"{c[:7]:>15}" for c in CATS))
    print("Peak memory per rank, KiB: tracked (MemTracker, 2nd step) vs predicted (the rank's stage); "
          "err = (pred - tracked) / tracked; categories tracked/pred (tracked: of the moments within "
          "1% of the peak, the one nearest the prediction)")
    for rec in recs:
        p = rec["plan"]
        print(f"\n{rec['name']}  [gbs {rec['gbs']}, mb {p['microbatch_size']} x {p['num_microbatches']}, "
              f"{p['schedule']}, zero {p['zero_stage']}]")
        if "error" in rec:
            print(f"  RUN FAILED: {rec['error'][:300]}")
            continue
        print("  " + head)
        for r in rec["ranks"]:
            err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
            tc, pc = r["tracked_categories"], r["predicted_categories"] or {}
            cats = "  ".join(f"{_kib(tc[c]):>7}/{_kib(pc.get(c)):<7}" for c in CATS)
            ph = f"{r['tracked_phase'][:3]}/{(r['predicted_phase'] or '-')[:3]}"
            print(f"  {r['rank']:>4} {r['stage'] if r['stage'] is not None else '-':>2} {_kib(r['tracked']):>8} "
                  f"{_kib(r['predicted']):>8} {err:>7} {ph:>9}  {cats}")
            print_timeline(r.get("timeline", []))
            for t in r.get("peak_tensors", []):
                print(f"         {t['bytes'] / 1024:8.1f} KiB  {t['label']:<16} {t.get('dtype', '')}"
                      f"{t.get('shape', '')} {t['op']} {t.get('pass', '')} {t.get('module', '')} "
                      f"({t.get('phase', '')})")
    ok = [r for r in recs if r.get("max_abs_error") is not None]
    failed = [r for r in recs if "error" in r]
    if ok:
        errs = sorted(r["max_abs_error"] for r in ok)
        within = sum(e <= 0.05 for e in errs)
        total = len(recs) + len(skipped)
        print(f"\n{len(ok)} plans measured: worst rank's |error| median {100 * errs[len(errs) // 2]:.1f}%, "
              f"max {100 * errs[-1]:.1f}%; {within} of {total} combinations within 5% (a plan that "
              f"failed to run or did not plan counts as a miss: {len(failed) + len(skipped)})")
        cat = [r for r in ok if r["category_misses"]]
        print(f"every category (weights, gradients, optimizer, activations, buffers) within 5% or 2 KiB "
              f"at the peak: {len(ok) - len(cat)} of {total}; the others, category tracked/predicted KiB "
              f"(where the phase column differs, or totals are close, the two peaks are different "
              f"moments):")
        for r in cat:
            print(f"  {r['name']}: {', '.join(r['category_misses'][:4])}")
        ph = [r for r in ok if r["phase_misses"]]
        print(f"every category within 5% or 2 KiB at each phase's own peak (forward/backward, gradient "
              f"sync, optimizer step): {len(ok) - len(ph)} of {total}; the others, phase category "
              f"tracked/predicted KiB:")
        for r in ph:
            print(f"  {r['name']}: {', '.join(r['phase_misses'][:4])}")
    if failed:
        print(f"{len(failed)} plans failed to run: " + ", ".join(r["name"] for r in failed))
    if skipped:
        print(f"\nSkipped ({len(skipped)}, no plan):")
        for s in skipped:
            print(f"  {s['name']}: {s['reason'][:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON record per plan")
    ap.add_argument("--only", default="", help="run the combinations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the combinations and exit")
    ap.add_argument("--top", type=int, default=0,
                    help="list the N largest tensors alive at each rank's tracked peak, with the op that made them")
    ap.add_argument("--markdown", action="store_true",
                    help="print the README's table (worst rank per layout) and the summary lines")
    ap.add_argument("--timeline", action="store_true",
                    help="print each rank's tracked local peaks, op by op, with their categories")
    ap.add_argument("--architectures", action="store_true",
                    help="instead of the zoo's combinations: 16 Hugging Face architectures written by others "
                         "(tests/hf_architectures.py), 4 layouts each in bf16 and fp32 (about 7 minutes)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        try:
            worker(a.worker[0], a.worker[1:])
        finally:
            from autopar.runtime.worker import hard_exit

            hard_exit(0 if sys.exc_info()[0] is None else 1)
    specs = [s for s in (_architecture_specs() if a.architectures else _specs()) if a.only in s["name"]]
    if a.list:
        print("\n".join(s["name"] + f"  ({s['nproc']} processes)" for s in specs))
        return
    if a.top:
        os.environ["AUTOPAR_MEMORY_TOP"] = str(a.top)      # read by the launched workers
    if a.timeline:
        os.environ["AUTOPAR_MEMORY_TIMELINE"] = "1"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-mem-") as d:
        planned, skipped = make_plans(specs, d)
        t1 = time.perf_counter()
        results = measure(planned)
        recs = compare(planned, results)
    t2 = time.perf_counter()
    if a.json:
        for r in recs:
            print(json.dumps(r))
        for s in skipped:
            print(json.dumps({"name": s["name"], "skipped": s["reason"]}))
        return
    if a.markdown:
        print_markdown(recs, skipped)
    else:
        print_table(recs, skipped)
    print(f"\nplanning {t1 - t0:.0f} s, runs {t2 - t1:.0f} s")


if __name__ == "__main__":
    main()
