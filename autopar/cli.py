"""The `autopar` command: plan, sweep, show, run, verify, profile, models, schema.

Every user mistake ends as one line on stderr (`autopar: error: ...`) and a non-zero exit code,
never a traceback; output files are written atomically, so a failed command leaves none behind.
Set AUTOPAR_DEBUG=1 to see tracebacks of unexpected errors.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import click
from pydantic import ValidationError

from autopar.schema import PlanError
from autopar.schema.cluster import validation_message
from autopar.schema.constraints import RECOMPUTES, SCHEDULES
from autopar.schema.plan import TRAINING_DTYPES

_T0 = time.perf_counter()      # when the CLI module was imported (`plan --timings`)
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _echo_err(msg: str, quiet: bool = False) -> None:
    if not quiet:
        click.echo(msg, err=True)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="autopar", prog_name="autopar")
def cli() -> None:
    """autopar: find the fastest parallel plan for a PyTorch model on a cluster, and run it."""


def _constraints(**kw: Any):
    from autopar.schema import Constraints

    try:
        return Constraints(**kw)
    except ValidationError as e:
        raise PlanError(f"invalid constraint: {validation_message(e)}") from None


def _degrees(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """"1,1,2" -> (1, 1, 2) (`--stage-tp`); None when not given."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None


def _slots(text: Optional[str]) -> Optional[tuple[str, ...]]:
    """"embedding,loss" -> ("embedding", "loss") (`--account-in-split`), "none" -> (); None when
    not given (the names are checked by `Constraints`)."""
    if text is None:
        return None
    return () if text.strip() == "none" else tuple(x.strip() for x in text.split(",") if x.strip())


def _cluster(name: str, nodes: Optional[int], devices_per_node: Optional[int]):
    from autopar.schema import ClusterSpec

    spec = ClusterSpec.load(name, num_nodes=nodes)
    if devices_per_node is not None:
        spec = spec.model_copy(update={"devices_per_node": devices_per_node})
    return spec


SOFTWARE_HELP = ("what the training software does on the cluster (attention kernel, element-wise fusion, "
                 "mixed precision, loss kernel, parameter dtype, ZeRO optimizer, gradient-sync overlap): a "
                 "bundled preset (autopar: what `autopar run` executes, the default; megatron-lm-2021: the "
                 "published Megatron-LM runs' software) or a YAML/JSON file")


def _software_note(p: Any, quiet: bool = False) -> None:
    """One line on stderr when a plan's predictions assume other software than the runtime
    executes (`autopar run` runs the default preset's choices whatever the plan says)."""
    from autopar.schema.software import resolve_software

    runs = resolve_software(None)
    chosen = ("attention_kernel", "pointwise_fusion", "mixed_precision", "loss_kernel", "param_dtype",
              "zero_optimizer", "grad_sync_overlap", "zero3_overlap", "optimizer_states", "expert_dispatch",
              "expert_routing", "pipeline_send_overlap", "pipeline_send_split")
    if any(getattr(p.software, k) != getattr(runs, k) for k in chosen):
        _echo_err(f"autopar: note: the plan's predictions assume software {p.software.name!r} "
                  f"({p.software.summary().split('(', 1)[1]}; the runtime executes {runs.name!r} "
                  f"({runs.summary().split('(', 1)[1]}, so its measurements answer to other figures", quiet)


def _software(name: Optional[str], spec: Any):
    """The SoftwareSpec for `--software` (None: the default, or an old cluster file's attention
    kernel: `software_for_cluster`); a bad name or file is a one-line error."""
    from autopar.schema.software import software_for_cluster

    return software_for_cluster(name, spec)


# `plan` in a process of its own (`entry`: the console script, `python -m autopar`; not a caller's
# `main(argv)` or a test's runner) tunes the garbage collector for a short run: importing torch,
# exporting a model and searching allocate millions of objects that live as long as the command,
# which Python's collector (thresholds 700, 10, 10) walks again and again: a cold GPT-3 175B plan
# spent ~1.2 of its ~8.4 CPU s in collections (8 full ones, ~0.12 s each), a warm one ~0.55 of 4.1.
# With young collections every GC_THRESHOLDS[0] allocations and what is alive after the imports and
# after the capture moved to the permanent generation (`_long_lived`): ~0.35 and ~0.16 s. Not for
# `autopar run` (a training loop's tensors held by garbage cycles must go as soon as they did).
_OWN_PROCESS = False
GC_THRESHOLDS = (20000, 10, 10)


def _long_lived() -> None:
    """What is alive now (the modules torch and autopar imported, the model, its graph) lives as
    long as the command: moved to the collector's permanent generation (`gc.freeze`), so that the
    collections the search's allocations trigger no longer walk it (cycles already garbage are
    kept until the process ends). Only in a process of its own (`_OWN_PROCESS`)."""
    if _OWN_PROCESS:
        gc.freeze()


@cli.command("plan", context_settings=CONTEXT)
@click.option("--model", "model_ref", required=True, help="zoo name, MODULE:FACTORY, or hf:NAME")
@click.option("--cluster", required=True, help="bundled profile name or a YAML/JSON file")
@click.option("--nodes", type=click.IntRange(min=1), help="number of nodes (overrides the profile)")
@click.option("--devices-per-node", type=click.IntRange(min=1), help="devices per node (overrides)")
@click.option("--global-batch-size", "-b", type=int, required=True, help="samples per iteration")
@click.option("--dtype", type=click.Choice(TRAINING_DTYPES), default="bf16", show_default=True)
@click.option("--software", metavar="NAME|FILE", help=SOFTWARE_HELP)
@click.option("--dp", type=int, help="pin the data-parallel degree")
@click.option("--tp", type=int, help="pin the tensor-parallel degree")
@click.option("--pp", type=int, help="pin the number of pipeline stages")
@click.option("--cp", type=int, help="pin the context-parallel degree (each sequence split over cp ranks, the "
              "attention exchanging keys and values; a power of two, 2 x cp dividing the sequence); default: "
              "searched for long sequences or where nothing fits without it")
@click.option("--microbatch-size", type=int)
@click.option("--num-microbatches", type=int)
@click.option("--schedule", type=click.Choice(list(SCHEDULES)))
@click.option("--virtual-stages", type=int)
@click.option("--recompute", type=click.Choice(list(RECOMPUTES)))
@click.option("--zero-stage", type=int)
@click.option("--ep", type=int, help="pin the expert-parallel degree of a mixture-of-experts model (divides dp "
              "and the expert count, or dp x tp folded: see --expert-dp); default: searched")
@click.option("--expert-dp", type=int, help="pin the copies of each expert: dp / ep, or dp x tp / ep for the expert "
              "mesh folded over the stage's dp x tp ranks (Megatron-Core's MoE parallel folding, EDP); default: "
              "searched")
@click.option("--expert-tp", type=int, help="pin expert tensor parallelism with ep > 1: 1, the experts replicated "
              "over tp; tp, each expert split over the tp ranks; default: searched")
@click.option("--stage-tp", callback=lambda ctx, param, v: _degrees(v), metavar="T1,T2,...",
              help="pin each pipeline stage's tensor-parallel degree, in model order (stages may differ, "
                   "Alpa's sub-mesh choice: e.g. 1,1,2)")
@click.option("--account-in-split", callback=lambda ctx, param, v: _slots(v), metavar="embedding,loss",
              help="give the embedding and/or the loss a pipeline layer slot of their own (a chunk may hold "
                   "one alone; Megatron's --account-for-embedding/loss-in-pipeline-split); \"none\" joins them to "
                   "the first and last block; default: both where the pinned pp x virtual stages exceed the blocks")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="pin Megatron-SP on the tensor-parallel axis on or off (needs the intra-op ILP); "
                   "default: the search decides")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="write the plan as JSON")
@click.option("--compare", is_flag=True, help="also show data-parallel, ZeRO-3 and Megatron baselines")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
@click.option("--timings", is_flag=True, hidden=True,
              help="print the command's parts' wall times to stderr as JSON (benchmarks/search_time.py)")
@click.option("--no-cache", is_flag=True,
              help="capture and solve anew, neither reading nor writing the cache (captures, "
                   "per-layer intra-op solutions, schedule walks: $XDG_CACHE_HOME/autopar/captures, "
                   "or $AUTOPAR_CACHE_DIR)")
@click.option("--verify", "then_verify", is_flag=True,
              help="then build every kind of rank of the plan at full scale on a fake process group "
                   "and check memory and collectives (as `autopar verify`); exit non-zero on a failure")
def plan_cmd(model_ref: str, cluster: str, nodes: Optional[int], devices_per_node: Optional[int],
             global_batch_size: int, dtype: str, software: Optional[str], output: Optional[str], compare: bool,
             as_json: bool, quiet: bool, no_cache: bool, timings: bool, then_verify: bool, **pins: Any) -> None:
    """Plan MODEL on CLUSTER and print the plan (or write it with -o)."""
    t = [time.perf_counter()]
    if _OWN_PROCESS:
        gc.set_threshold(*GC_THRESHOLDS)
    from autopar.capture import capture
    from autopar.planner import plan as plan_model
    from autopar.planner import resolve_model

    if global_batch_size < 1:
        raise PlanError(f"--global-batch-size must be >= 1, got {global_batch_size}")
    if output and not Path(output).resolve().parent.is_dir():
        raise PlanError(f"cannot write {output}: directory {Path(output).parent} does not exist")
    cons = _constraints(**pins)
    spec = _cluster(cluster, nodes, devices_per_node)
    sw = _software(software, spec)
    _long_lived()
    t.append(time.perf_counter())
    bundle = resolve_model(model_ref, None, None)
    t.append(time.perf_counter())
    # shared with --compare; a model of the same structure captured before is read from the cache
    graph = capture(bundle.model, bundle.example_inputs, name=bundle.name, cache=not no_cache)
    _long_lived()
    t.append(time.perf_counter())
    p = plan_model(bundle, spec, global_batch_size=global_batch_size, dtype=dtype, constraints=cons,
                   progress=not quiet, graph=graph, cache=not no_cache, software=sw)
    t.append(time.perf_counter())
    if output:
        p.save(output)
    if as_json:
        click.echo(p.to_json())
    else:
        click.echo(p.summary())
    t.append(time.perf_counter())
    if timings:
        parts = ("imports_s", "model_s", "capture_s", "search_s", "print_s")
        click.echo(json.dumps({"timings": {**{k: round(b - a, 3) for k, a, b in zip(parts, t, t[1:])},
                                           "assemble_s": p.search.get("assemble_time_s"),
                                           "since_cli_import_s": round(t[-1] - _T0, 3)}}), err=True)
    if compare:
        from autopar.compare import compare_baselines

        click.echo(compare_baselines(p, bundle, spec, as_json=as_json, graph=graph))
    if output and not as_json:
        _echo_err(f"wrote {output}", quiet)
    if then_verify:
        from autopar.runtime.verify import verify

        report = verify(p, model_ref, check=False, jobs=os.cpu_count() or 1, progress=not quiet)
        _verify_out(report, as_json)


def _verify_out(report: Any, as_json: bool) -> None:
    """Print a VerifyReport (table or JSON); a failure ends the command with its first line."""
    click.echo(report.model_dump_json(indent=2) if as_json else report.summary())
    if report.failures:
        more = len(report.failures) - 1
        raise PlanError(f"verify failed: {report.failures[0]}"
                        + (f" (and {more} more failure{'s' if more > 1 else ''}, listed above)" if more else ""))


@cli.command("sweep", context_settings=CONTEXT)
@click.option("--model", "model_ref", required=True, help="zoo name, MODULE:FACTORY, or hf:NAME")
@click.option("--clusters", required=True,
              help="comma-separated cluster types: bundled profile names or YAML/JSON files")
@click.option("--nodes", "nodes_text", default="1..64", show_default=True,
              help="node counts: A..B (the powers of two from A to B), a list (1,2,4,12), or both")
@click.option("--tokens", "tokens_text", required=True, help="the token budget to train, e.g. 1e12, 300B")
@click.option("--seq-len", type=click.IntRange(min=1), help="rebuild a zoo model at this sequence length")
@click.option("--global-batch-size", "-b", type=click.IntRange(min=1), help="samples per iteration")
@click.option("--tokens-per-step", "tokens_per_step_text",
              help="tokens per iteration, made a batch of whole samples [default: 4Mi = 4194304]")
@click.option("--price", "price_text", help="your price per GPU-hour by cluster: CLUSTER=PRICE[,CLUSTER=PRICE] "
                                            "(none are bundled; cost is left out without one)")
@click.option("--deadline", "deadline_text", help="pick the cheapest point finishing within it: 30d, 12h, 2w")
@click.option("--dtype", type=click.Choice(TRAINING_DTYPES), default="bf16", show_default=True)
@click.option("--software", metavar="NAME|FILE", help=SOFTWARE_HELP)
@click.option("--plot", type=click.Path(dir_okay=False), help="draw time to train vs cost (PNG or SVG)")
@click.option("--output", "-o", type=click.Path(dir_okay=False),
              help="write every point with its plan (`autopar show FILE --point CLUSTER:NODES`)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per point instead of the table")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
@click.option("--no-cache", is_flag=True, help="capture the model anew (see `autopar plan --help`)")
def sweep_cmd(model_ref: str, clusters: str, nodes_text: str, tokens_text: str, seq_len: Optional[int],
              global_batch_size: Optional[int], tokens_per_step_text: Optional[str], price_text: Optional[str],
              deadline_text: Optional[str], dtype: str, software: Optional[str], plot: Optional[str],
              output: Optional[str], as_json: bool, quiet: bool, no_cache: bool) -> None:
    """Best plan of MODEL on every cluster type and node count: step time, time to train the
    token budget, GPU-hours and cost, with the time-vs-cost frontier marked."""
    from autopar.capacity import parse_count, parse_duration, parse_nodes, parse_prices, sweep

    if global_batch_size is not None and tokens_per_step_text is not None:
        raise click.UsageError("give --global-batch-size or --tokens-per-step, not both")
    for path, what in ((output, "-o"), (plot, "--plot")):
        if path and not Path(path).resolve().parent.is_dir():
            raise PlanError(f"cannot write {path} ({what}): directory {Path(path).parent} does not exist")
    if plot and Path(plot).suffix.lower() not in (".png", ".svg"):
        raise PlanError(f"--plot needs a .png or .svg file name, got {Path(plot).name!r}")
    if plot:
        from autopar.plot import require_matplotlib

        require_matplotlib()                 # before minutes of searching, not after
    names = [c.strip() for c in clusters.split(",") if c.strip()]
    res = sweep(model_ref, names, parse_nodes(nodes_text), tokens=parse_count(tokens_text, "--tokens"),
                seq_len=seq_len, global_batch_size=global_batch_size,
                tokens_per_step=(parse_count(tokens_per_step_text, "--tokens-per-step")
                                 if tokens_per_step_text is not None else None),
                prices=parse_prices(price_text),
                deadline_s=parse_duration(deadline_text) if deadline_text else None, dtype=dtype,
                cache=not no_cache, software=software, progress=None if quiet else (lambda msg: _echo_err(msg)))
    if output:
        res.save(output)
    click.echo(json.dumps(res.records(), indent=2) if as_json else res.summary())
    if plot:
        from autopar.sweep_plot import plot_sweep

        plot_sweep(res, plot)
        _echo_err(f"wrote {plot}", quiet)
    if output:
        _echo_err(f"wrote {output} (a point's plan: autopar show {output} --point "
                  f"{next((p.key for p in res.points if p.plan is not None), 'CLUSTER:NODES')})", quiet)


@cli.command("show", context_settings=CONTEXT)
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--point", help="of a sweep file (`autopar sweep -o`): the point CLUSTER:NODES to show, "
                              "e.g. dgx-h100:8; without it, the sweep's table")
@click.option("--plot", type=click.Path(dir_okay=False), help="draw timeline and memory (PNG or SVG); "
                                                               "of a sweep file, time vs cost")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
def show_cmd(plan_file: str, point: Optional[str], plot: Optional[str], as_json: bool) -> None:
    """Print a saved plan's stages, sharding, memory and predicted time (or a sweep's table)."""
    from autopar.schema.sweep import SweepResult, load_plan_or_point, read_plan_or_sweep

    obj = read_plan_or_sweep(plan_file)
    if isinstance(obj, SweepResult) and point is None:
        click.echo(json.dumps(obj.records(), indent=2) if as_json else obj.summary())
        if plot:
            from autopar.sweep_plot import plot_sweep

            plot_sweep(obj, plot)
            _echo_err(f"wrote {plot}")
        return
    p = load_plan_or_point(plan_file, point) if point is not None else obj
    click.echo(p.to_json() if as_json else p.summary())
    if plot:
        from autopar.plot import plot_plan

        plot_plan(p, plot)
        _echo_err(f"wrote {plot}")


@cli.command("run", context_settings=CONTEXT)
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--point", help="of a sweep file: the point CLUSTER:NODES to run, e.g. dgx-h100:8")
@click.option("--model", "model_ref", required=True, help="the model the plan was made for")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--metrics", type=click.Path(dir_okay=False), help="one JSON line per step")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False))
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--quiet", "-q", is_flag=True)
def run_cmd(plan_file: str, point: Optional[str], model_ref: str, steps: int, seed: int,
            metrics: Optional[str], checkpoint_dir: Optional[str], checkpoint_every: int, quiet: bool) -> None:
    """Execute a plan (or a sweep file's point) on torch.distributed (launches torchrun itself
    when needed)."""
    from autopar.schema.sweep import load_plan_or_point

    p = load_plan_or_point(plan_file, point)
    _software_note(p, quiet)
    try:
        from autopar.runtime import run
    except ImportError as e:  # pragma: no cover - runtime always ships
        raise PlanError(f"the runtime is not available: {e}") from None
    rows = run(p, model_ref, steps=steps, seed=seed, metrics_path=metrics,
               checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, quiet=quiet)
    if not quiet and rows and not metrics:
        for r in rows:
            click.echo(json.dumps(r))


@cli.command("verify", context_settings=CONTEXT)
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--model", "model_ref", required=True, help="the model the plan was made for")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--device-memory", type=click.FloatRange(min=0, min_open=True), metavar="GIB",
              help="check against this device memory (GiB) instead of the plan's device's")
@click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True,
              help="verify only the kind of this rank (repeatable)")
@click.option("--top", type=click.IntRange(min=0), default=0, show_default=True,
              help="list the N largest tensors at each rank's peak")
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="worker processes (default: one per core)")
@click.option("--all-microbatches", is_flag=True,
              help="step every micro-batch of the plan (default: the fewest that reach the same schedule "
                   "states, the same peak; collectives scaled to the plan's)")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
def verify_cmd(plan_file: str, model_ref: str, as_json: bool, device_memory: Optional[float],
               ranks: tuple[int, ...], top: int, jobs: Optional[int], all_microbatches: bool, quiet: bool) -> None:
    """Build every kind of rank of a plan at full scale without GPUs (fake process group, fake
    tensors), run one training step, and check shards, collectives and memory."""
    from autopar.runtime.verify import verify
    from autopar.schema import load_plan

    p = load_plan(plan_file)
    _software_note(p, quiet)
    report = verify(p, model_ref, device_memory_bytes=device_memory * 2**30 if device_memory else None,
                    ranks=list(ranks) or None, top=top, jobs=jobs or os.cpu_count() or 1, progress=not quiet,
                    all_microbatches=all_microbatches)
    _verify_out(report, as_json)


@cli.command("profile", context_settings=CONTEXT)
@click.option("--output", "-o", type=click.Path(dir_okay=False), required=True)
@click.option("--processes", type=click.IntRange(min=1), help="local processes (default: GPUs or 2)")
@click.option("--quick", is_flag=True, help="fewer sizes (seconds instead of minutes)")
@click.option("--quiet", "-q", is_flag=True)
def profile_cmd(output: str, processes: Optional[int], quick: bool, quiet: bool) -> None:
    """Measure this machine (GEMMs, memory bandwidth, collectives) into a cluster profile."""
    from cost_models.profiler import profile_machine

    if not Path(output).resolve().parent.is_dir():
        raise PlanError(f"cannot write {output}: directory {Path(output).parent} does not exist")
    profile_machine(Path(output), num_processes=processes, quick=quick, progress=not quiet)
    _echo_err(f"wrote {output}", quiet)


@cli.command("models", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True)
def models_cmd(as_json: bool) -> None:
    """List the built-in model zoo."""
    from autopar.models.catalogue import catalogue  # data only: no torch to import
    from autopar.schema.plan import format_count, format_table

    entries = catalogue()
    if as_json:
        click.echo(json.dumps({n: {"family": e.family, "params": e.params, "description": e.description}
                               for n, e in entries.items()}, indent=2))
        return
    rows = [[n, e.family, format_count(e.params), e.description] for n, e in entries.items()]
    click.echo(format_table(["model", "family", "params", "description"], rows))


@cli.command("schema", context_settings=CONTEXT)
def schema_cmd() -> None:
    """Print the JSON Schema of plan files."""
    from autopar.schema import Plan

    click.echo(json.dumps(Plan.json_schema(), indent=2))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: runs the CLI and turns user errors into one line and an exit code."""
    debug = os.environ.get("AUTOPAR_DEBUG") == "1"
    try:
        cli.main(args=argv, prog_name="autopar", standalone_mode=False)
        return 0
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except click.exceptions.Abort:
        click.echo("autopar: aborted", err=True)
        return 130
    except click.UsageError as e:
        hint = (f" (see `autopar {e.ctx.info_name} --help`)"
                if e.ctx is not None and e.ctx.info_name != "autopar" else "")
        click.echo(f"autopar: error: {e.format_message()}{hint}", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"autopar: error: {e.format_message()}", err=True)
        return 1
    except PlanError as e:
        if debug:
            raise
        click.echo(f"autopar: error: {e}", err=True)
        return 1
    except ValidationError as e:
        if debug:
            raise
        click.echo(f"autopar: error: {validation_message(e)}", err=True)
        return 1
    except KeyboardInterrupt:
        click.echo("autopar: interrupted", err=True)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug, not a user mistake: say so in one line
        if debug:
            raise
        click.echo(f"autopar: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                   f"(set AUTOPAR_DEBUG=1 for the traceback; please report it)", err=True)
        return 3


def entry() -> None:
    global _OWN_PROCESS
    _OWN_PROCESS = True
    sys.exit(main())


if __name__ == "__main__":
    entry()
