"""Every layout the search emits, on models written six ways: losses against one process and
counted collectives against the plan (issue 20, "one executor").

    python benchmarks/layout_matrix.py [--only SUBSTRING] [--steps 3] [--json]
                                       [--architectures | --other-tasks | --user-models]
                                       [--context-parallel]

Models (4 blocks unless said, fp32): the zoo's GPT (`tests.plans:gpt_tiny6`, gpt-tiny with 6
blocks; its output layer's weight is the embedding's: one weight shared by two modules),
nanoGPT (`tests.user_models:nanogpt`: fused qkv split into [q; k; v] blocks, the head written
`x @ wte.weight.t()`), a GPT with separate q/k/v projections and a tied `nn.Linear` head
(`tests.user_models:separate_gpt`), Hugging Face's GPT-2 (dropout off, so that losses compare
with one process) and Llama (separate q/k/v, 2 KV heads, rotary tables) at tiny configurations
(`hf:`), and nanoGPT with its 4 blocks in a ModuleDict under names and its attention module
called `mixer` (`tests.user_models:renamed_gpt`). Layouts, 4 gloo processes: dp4 with ZeRO 0-3,
tp4, dp2 x tp2 (without ZeRO and with ZeRO-3), pp2 x dp2 (1F1B), pp2 x tp2 (GPipe), pp4 with
GPipe and with 1F1B, pp2 x dp2 interleaved (2 chunks per rank; pp4 with 2 chunks each needs 8
layers), dp4 with selective and pp2 x dp2 with full recomputation, and the free plan
(`autopar.plan` unconstrained). `--architectures`: the same layouts of 16 Hugging Face
architectures autopar has no `hf:` family for (`tests/hf_architectures.py`: Falcon, GPTBigCode,
GPT-J, GPT-NeoX, Phi, Phi-3, BLOOM, Gemma, Qwen-2/3, Mistral, OLMo, StableLM, StarCoder-2,
Cohere), each wrapped as a user would. `--user-models`: every layout of
`tests/test_runtime_user_models.py` (models written by others: nanoGPT, GatedLM, an
encoder-decoder, T5-like seq2seq models with shared or aliased embeddings, GPT-2, Llama,
Falcon), those the suite runs and those moved out of its job because another layout of the
suite runs their path (`MATRIX_LAYOUTS`); `--context-parallel`: the context-parallel layouts
moved out of `tests/test_runtime_context_parallel.py`'s job (its `MATRIX_LAYOUTS`). Each is
planned by `autopar.plan` with the layout pinned (`autopar.Constraints`), run for `--steps`
steps by the runtime (one 4-process launch per model), and compared with the same model planned
for and run on one process: the largest relative difference of a step's loss (target 1e-4) and
whether the counted collectives of every step after the first equal the plan's
`predicted.collectives`; where the first step's differ (a pipeline's counts more transfers) the
difference is printed beside. A layout that does not plan, or fails to run, counts as a miss.
Takes about 5 minutes on 2 cores.
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

_TINY = "num_hidden_layers=4&num_attention_heads=4&seq_len=16&vocab_size=128"
MODELS = {
    "zoo-gpt": "tests.plans:gpt_tiny6",
    "nanogpt": "tests.user_models:nanogpt",
    "separate": "tests.user_models:separate_gpt",
    "hf-gpt2": f"hf:gpt2?hidden_size=64&{_TINY}&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0",
    "hf-llama": f"hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&{_TINY}",
    "renamed": "tests.user_models:renamed_gpt",
}


def _architecture_models() -> dict[str, str]:
    """`--architectures`: the Hugging Face architectures without an `hf:` family, wrapped by a
    user (`tests.hf_architectures.ARCHITECTURES`)."""
    from tests.hf_architectures import ARCHITECTURES

    return {f"hf-{name}": f"tests.hf_architectures:{name}" for name in ARCHITECTURES}


def _other_task_models() -> dict[str, str]:
    """`--other-tasks`: Hugging Face models that are not causal LMs (`tests.hf_other_tasks`)."""
    from tests.hf_other_tasks import NAMES

    return {f"hf-{name}": f"tests.hf_other_tasks:{name}" for name in NAMES}


LAYOUTS: dict[str, dict] = {
    "dp4 zero0": dict(dp=4, tp=1, pp=1, zero_stage=0),
    "dp4 zero1": dict(dp=4, tp=1, pp=1, zero_stage=1),
    "dp4 zero2": dict(dp=4, tp=1, pp=1, zero_stage=2),
    "dp4 zero3": dict(dp=4, tp=1, pp=1, zero_stage=3),
    "tp4": dict(dp=1, tp=4, pp=1),
    "dp2 x tp2": dict(dp=2, tp=2, pp=1, zero_stage=0),
    "dp2 x tp2 zero3": dict(dp=2, tp=2, pp=1, zero_stage=3),
    "pp2 x dp2 1f1b": dict(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2),
    "pp2 x tp2 gpipe": dict(dp=1, tp=2, pp=2, schedule="gpipe", num_microbatches=2),
    "pp4 gpipe": dict(dp=1, tp=1, pp=4, schedule="gpipe", num_microbatches=4),
    "pp4 1f1b": dict(dp=1, tp=1, pp=4, schedule="1f1b", num_microbatches=4),
    "pp2 x dp2 interleaved": dict(dp=2, tp=1, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                                  num_microbatches=2),
    "dp4 selective": dict(dp=4, tp=1, pp=1, zero_stage=0, recompute="selective"),
    "pp2 x dp2 1f1b full": dict(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, recompute="full"),
    "free": {},
}
NPROC = 4
GBS = 8
TOLERANCE = 1e-4


def _cluster(n: int):
    import autopar

    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def _plans(specs: list[tuple[str, str, str, dict]], folder: str) -> tuple[list[dict], list[dict]]:
    """Plan every (model name, reference, layout name, constraints); returns (planned specs with
    their plan path, those that did not plan)."""
    import autopar
    from autopar.planner import plan
    from autopar.schema import PlanError

    done, failed = [], []
    for mname, ref, lname, cons in specs:
        spec = {"model": mname, "ref": ref, "layout": lname}
        try:
            p = plan(ref, _cluster(NPROC), global_batch_size=GBS, dtype="fp32",
                     constraints=autopar.Constraints(**cons))
        except PlanError as e:
            failed.append({**spec, "error": f"did not plan: {e}"})
            continue
        path = os.path.join(folder, f"{mname}-{lname.replace(' ', '_')}.json")
        p.save(path)
        done.append({**spec, "path": path})
    return done, failed


def _short_name(ref: str, taken: set[str]) -> str:
    """A model's name in the table: "hf-llama" for "hf:llama?...", "mistral" for
    "tests.hf_architectures:mistral", numbered where another reference has it already."""
    base = f"hf-{ref[3:].split('?')[0]}" if ref.startswith("hf:") else ref.split(":")[-1]
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


def _test_module_specs(module: str, suite: bool) -> list[tuple[str, str, str, dict]]:
    """The layouts `tests/<module>.py` moved out of its 4-process job because another layout of
    the suite runs their path (its `MATRIX_LAYOUTS`: {name: (model, constraints)}), with its
    `LAYOUTS` of the same form where `suite`; GPT-2 with dropout left out (its losses cannot
    equal one process's)."""
    import importlib

    mod = importlib.import_module(f"tests.{module}")
    layouts = {**(mod.LAYOUTS if suite else {}), **mod.MATRIX_LAYOUTS}
    names: dict[str, str] = {}
    for ref, _ in layouts.values():
        names.setdefault(ref, _short_name(ref, set(names.values())))
    return [(names[ref], ref, lname, cons) for lname, (ref, cons) in layouts.items()
            if ref != getattr(mod, "HF_GPT2_DROPOUT", None)]


def _references(models: dict[str, str], steps: int) -> dict[str, list[float]]:
    """Each model's losses planned for and run on one process."""
    from autopar.planner import plan
    from autopar.runtime import run

    out = {}
    for mname, ref in models.items():
        p = plan(ref, _cluster(1), global_batch_size=GBS, dtype="fp32")
        out[mname] = [r["loss"] for r in run(p, ref, steps=steps, quiet=True) if "step" in r]
    return out


def worker(out: str, steps: int, paths: list[str]) -> None:
    """Under torchrun: train every plan; rank 0 writes {path: rows or {"error": ...}} after each.
    A plan every rank fails to run alike is recorded and the launch goes on; one that fails on
    some ranks only ends the launch (the others may wait in a collective)."""
    import torch.distributed as dist

    from autopar.models.registry import build_model
    from autopar.runtime.worker import init_distributed, train
    from autopar.schema.plan import load_plan

    init_distributed()
    results: dict = {}
    for path in paths:
        try:
            plan = load_plan(path)
            rows: object = train(plan, build_model(plan.model.name, device="meta"), steps=steps, seed=0, quiet=True)
        except Exception as e:  # noqa: BLE001 - recorded per plan, a miss in the table
            rows = {"error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-2000:]}
        allr: list = [None] * dist.get_world_size()
        dist.all_gather_object(allr, isinstance(rows, dict))
        results[path] = rows
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(results))
        if any(allr) and not all(allr):
            raise RuntimeError(f"{path}: failed on some ranks only")
        dist.barrier()
    dist.destroy_process_group()


def measure(planned: list[dict], steps: int) -> dict:
    """One launch per model; {path: rows or {"error": ...}}."""
    from tests.launch import elastic_run

    results: dict = {}
    for mname in dict.fromkeys(s["model"] for s in planned):
        paths = [s["path"] for s in planned if s["model"] == mname]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        err = ""
        try:
            elastic_run(Path(__file__).resolve(), ["--worker", out, str(steps), *paths], NPROC)
        except Exception as e:  # noqa: BLE001 - the launch's failure is reported per plan
            err = f"{type(e).__name__}: {str(e)[:300]}"
        got = json.loads(Path(out).read_text()) if os.path.getsize(out) else {}
        os.unlink(out)
        for p in paths:
            results[p] = got.get(p) or {"error": err or "not run (an earlier plan ended the launch)"}
    return results


def compare(planned: list[dict], failed: list[dict], results: dict, refs: dict) -> list[dict]:
    from autopar.schema.plan import load_plan

    recs = list(failed)
    for s in planned:
        rows = results[s["path"]]
        rec = {k: s[k] for k in ("model", "ref", "layout")}
        p = load_plan(s["path"])
        rec["plan"] = (f"dp{p.dp}" + (f" cp{p.cp}" if p.cp > 1 else "") + f" tp{p.tp} pp{p.pp}"
                       + (f" {p.schedule}" if p.pp > 1 else "")
                       + f" z{p.zero_stage} mb {p.microbatch_size} x {p.num_microbatches}")
        if isinstance(rows, dict):
            rec["error"] = rows["error"]
            recs.append(rec)
            continue
        steps = [r for r in rows if "step" in r]
        want = refs[s["model"]]
        got = [r["loss"] for r in steps]
        rec["loss_rel_diff"] = max((abs(a - b) / abs(b) for a, b in zip(got, want)), default=None)
        rec["steps"] = len(got)
        counted = [r for r in steps[1:] if "collectives" in r]     # AUTOPAR_COUNT_COLLECTIVES: which steps
        rec["collectives_equal"] = bool(counted) and all(r["collectives"] == p.predicted.collectives
                                                         for r in counted)
        # a pipeline's first step counts more transfers than the plan's step: shown, not dropped
        first = steps[0].get("collectives") if steps else None
        rec["first_step_extra"] = ({k: first.get(k, 0) - p.predicted.collectives.get(k, 0)
                                    for k in set(first) | set(p.predicted.collectives)
                                    if first.get(k, 0) != p.predicted.collectives.get(k, 0)}
                                   if first is not None and first != p.predicted.collectives else {})
        rec["per_step"] = [r.get("collectives") for r in steps]
        rec["collectives"] = counted[-1]["collectives"] if counted else None
        rec["predicted"] = dict(p.predicted.collectives)
        rec["ok"] = (len(got) == len(want) and rec["loss_rel_diff"] is not None
                     and rec["loss_rel_diff"] <= TOLERANCE and rec["collectives_equal"])
        recs.append(rec)
    return recs


def print_table(recs: list[dict], seconds: float) -> None:
    print(f"Layouts on {NPROC} gloo processes, fp32, global batch {GBS}: largest relative loss difference "
          f"to one process (target {TOLERANCE:g}) and counted collectives against the plan's\n")
    print("| model | layout | plan | loss vs one process | collectives | |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        if "error" in r:
            print(f"| {r['model']} | {r['layout']} | {r.get('plan', '-')} | - | - | **miss**: {r['error'][:160]} |")
            continue
        coll = "equal" if r["collectives_equal"] else f"{r['collectives']} vs {r['predicted']}"
        if r.get("first_step_extra"):
            coll += " (step 1: " + ", ".join(f"{v:+d} {k}" for k, v in sorted(r["first_step_extra"].items())) + ")"
        print(f"| {r['model']} | {r['layout']} | {r['plan']} | {r['loss_rel_diff']:.1e} | {coll} | "
              f"{'ok' if r['ok'] else '**miss**'} |")
    ok = sum(bool(r.get("ok")) for r in recs)
    print(f"\n{ok} of {len(recs)} layouts ok (a layout that does not plan or run is a miss); {seconds:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="the (model, layout) pairs whose 'model layout' contains this")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON record per layout")
    ap.add_argument("--architectures", action="store_true",
                    help="the 16 Hugging Face architectures of tests/hf_architectures.py instead of the six "
                         "models (about 30 minutes)")
    ap.add_argument("--other-tasks", action="store_true",
                    help="Hugging Face models that are not causal LMs (BERT masked LM, T5, ViT: "
                         "tests/hf_other_tasks.py) instead of the six models")
    ap.add_argument("--user-models", action="store_true",
                    help="every layout of tests/test_runtime_user_models.py (models written by others: the "
                         "suite's and those moved out of its job) instead of the six models (about 4 minutes)")
    ap.add_argument("--context-parallel", action="store_true",
                    help="the context-parallel layouts moved out of tests/test_runtime_context_parallel.py's "
                         "job (another layout there runs their path) instead of the six models")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("AUTOPAR_COUNT_COLLECTIVES", "all")     # check every step's, not the first two
    if a.worker:
        try:
            worker(a.worker[0], int(a.worker[1]), a.worker[2:])
        finally:
            from autopar.runtime.worker import hard_exit

            hard_exit(0 if sys.exc_info()[0] is None else 1)
    t0 = time.perf_counter()
    if a.user_models or a.context_parallel:
        specs = [sp for sp in _test_module_specs("test_runtime_user_models", suite=True) * a.user_models
                 + _test_module_specs("test_runtime_context_parallel", suite=False) * a.context_parallel
                 if a.only in f"{sp[0]} {sp[2]}"]
    else:
        pool = _architecture_models() if a.architectures else _other_task_models() if a.other_tasks else MODELS
        specs = [(m, pool[m], lay, LAYOUTS[lay]) for m in pool for lay in LAYOUTS if a.only in f"{m} {lay}"]
    models = {m: ref for m, ref, _, _ in specs}
    with tempfile.TemporaryDirectory(prefix="autopar-matrix-") as d:
        planned, failed = _plans(specs, d)
        refs = _references(models, a.steps)
        results = measure(planned, a.steps)
        recs = compare(planned, failed, results, refs)
    if a.json:
        for r in recs:
            print(json.dumps(r))
        return
    print_table(recs, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
