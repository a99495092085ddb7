"""Software apart from hardware (issue 14): what the training software does (attention kernel,
overlap of the gradient sync) is a `SoftwareSpec` chosen apart from the hardware profile,
recorded in the plan; the default is what `autopar run` executes."""

import json
import subprocess
import sys
import warnings

import pytest
import yaml

import autopar
from autopar.schema import ClusterSpec, Constraints, Plan, PlanError, SoftwareSpec
from autopar.schema.cluster import SoftwareInHardwareWarning, bundled_profiles_dir
from autopar.schema.plan import PLAN_FORMAT_VERSION
from autopar.schema.software import DEFAULT_SOFTWARE, MEMORY_TERM_FIELDS, bundled_software, resolve_software
from cost_models.compute import graph_compute_time
from cost_models.memory import activation_memory


@pytest.fixture(scope="module")
def tiny_graph():
    from autopar.capture import capture
    from autopar.models import build_model

    b = build_model("gpt-tiny")
    return capture(b.model, b.example_inputs).at_batch(4)


def test_presets_are_typed_and_sourced():
    assert {"autopar", "megatron-lm-2021"} <= set(bundled_software())
    for name in bundled_software():
        sw = SoftwareSpec.load(name)
        assert sw.name == name and sw.description
        chosen = ({"attention_kernel", "mixed_precision", "grad_sync_overlap", "pipeline_send_overlap"}
                  | ({"attention_flops"} if sw.attention_flops else set())
                  | ({"pointwise_fusion"} if sw.pointwise_fusion != "eager" else set())
                  | ({"loss_kernel"} if sw.loss_kernel != "eager" else set())
                  | ({"param_dtype"} if sw.param_dtype != "training" else set())
                  | ({"zero_optimizer"} if sw.zero_optimizer != "flat" else set())
                  | ({"loss_scaling"} if sw.loss_scaling != "none" else set())
                  | ({"attention_head_dims"} if sw.attention_head_dims else set())
                  | {k for k in MEMORY_TERM_FIELDS if getattr(sw, k) != SoftwareSpec.model_fields[k].default}
                  | ({"zero3_overlap"} if sw.zero3_overlap else set())
                  | ({"pipeline_send_split"} if sw.pipeline_send_split else set())
                  | ({"optimizer_states"} if sw.optimizer_states != "fp32" else set())
                  | ({"expert_dispatch"} if sw.expert_dispatch != "pairs" else set())
                  | ({"expert_routing"} if sw.expert_routing != "router" else set())
                  | ({"expert_saves"} if sw.expert_saves != "runtime" else set())
                  | ({"norm_saves"} if sw.norm_saves != "eager" else set())
                  | ({"gradient_accumulation_fusion"} if sw.gradient_accumulation_fusion else set())
                  | ({"tp_comm_overlap"} if sw.tp_comm_overlap else set())
                  | ({"param_sync_overlap"} if sw.param_sync_overlap else set())
                  | ({"grad_dtype"} if sw.grad_dtype != "param" else set())
                  | ({"sp_linear_saves"} if sw.sp_linear_saves != "gathered" else set()))
        assert set(sw.sources) == chosen, "every choice names its source"
    with pytest.raises(PlanError, match="unknown software 'flash9'; bundled: autopar, flash-attn-1-2022, "
                                         "flash-attn-2-2023, megatron-lm-2021, megatron-lm-2021-torch-ddp, "
                                         "nemo-automodel-2025, nemo-megatron-core-2024, "
                                         "torch-compile-2025"):
        resolve_software("flash9")
    with pytest.raises(Exception, match="attention_kernel"):
        SoftwareSpec(name="x", attention_kernel="flash")


def test_the_default_is_what_autopar_run_executes():
    """The runtime calls torch's scaled_dot_product_attention (a fused kernel on CUDA) and
    averages gradients after the backward (`runtime/engine.py`): the default says so."""
    import inspect

    from autopar.models import gpt
    from autopar.runtime import engine, precision

    sw = resolve_software(None)
    assert sw.name == DEFAULT_SOFTWARE == "autopar"
    assert sw.attention_kernel == "fused" and "scaled_dot_product_attention" in inspect.getsource(gpt)
    assert sw.grad_sync_overlap is False and "averaged over the dp group after the backward" in " ".join(
        engine.__doc__.split())
    assert sw.pointwise_fusion == "eager"       # the runtime runs the model eagerly, not compiled
    assert sw.mixed_precision == "autocast" and "torch.autocast" in " ".join(precision.__doc__.split())
    assert SoftwareSpec.load("megatron-lm-2021").attention_kernel == "unfused"


def test_hardware_profiles_hold_no_software():
    for f in bundled_profiles_dir().glob("*.yaml"):
        assert "attention_kernel" not in f.read_text(), f"{f.name} describes software"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SoftwareInHardwareWarning)
        ClusterSpec.load("dgx-a100-80g")
    assert "attention_kernel" not in ClusterSpec.load("dgx-a100-80g").model_dump_json()


def test_fused_and_unfused_software_cost_differently(tiny_graph):
    """Unfused attention stores the b x heads x s x s scores for its backward and runs its GEMMs
    and softmax apart: more memory and more time than the fused kernel on the same device."""
    g = tiny_graph
    dev = ClusterSpec.load("dgx-a100-80g").device
    t = {k: graph_compute_time(g, dev, "bf16", attention_kernel=k).total_s for k in ("fused", "unfused")}
    assert t["unfused"] > t["fused"]
    mem = {k: activation_memory(g, "bf16", "none", device_type="cuda", attention_kernel=k).saved_bytes
           for k in ("fused", "unfused")}
    att = next(n for n in g.calls if n.op == "scaled_dot_product_attention")
    b, heads, s, _ = att.outputs[0].shape
    layers = sum(1 for n in g.calls if n.op == "scaled_dot_product_attention")
    # each layer keeps its probabilities (2 bytes a score at bf16) instead of output and log-sum-exp
    assert mem["unfused"] - mem["fused"] >= layers * b * heads * s * s * 2 * 0.5
    assert mem["unfused"] > mem["fused"]


def test_half_precision_software_holds_fewer_fp32_tensors():
    """`mixed_precision: half` (the model cast to bf16, fused norm and softmax kernels writing
    it: Megatron-LM's Float16Module) keeps the layer norms' outputs at 2 bytes where CUDA's
    autocast makes them fp32: less activation memory, less element-wise traffic, on the same
    plan; the choice is recorded, and the default's dump omits it (old plans' files unchanged)."""
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=4, recompute="none", zero_stage=0)
    auto = SoftwareSpec(name="a")
    half = SoftwareSpec(name="h", mixed_precision="half")
    pa, ph = (autopar.plan("gpt-tiny", cl, global_batch_size=32, constraints=cons, software=sw)
              for sw in (auto, half))
    assert ph.software.mixed_precision == "half" and Plan.from_json(ph.to_json()).software == half
    assert ph.predicted.peak_memory_bytes < pa.predicted.peak_memory_bytes
    assert ph.predicted.iteration_time_s < pa.predicted.iteration_time_s
    assert "mixed_precision" not in auto.model_dump() and half.model_dump()["mixed_precision"] == "half"
    with pytest.raises(Exception, match="mixed_precision"):
        SoftwareSpec(name="x", mixed_precision="amp")


def test_plan_records_its_software_and_round_trips(tmp_path):
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=2, tp=2, pp=2, microbatch_size=2, recompute="none", zero_stage=0)
    fused = autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons)
    unfused = autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons, software="megatron-lm-2021")
    assert fused.software.name == "autopar" and fused.software.attention_kernel == "fused"
    assert unfused.software == SoftwareSpec.load("megatron-lm-2021")
    # the scores unfused attention stores and its time (Megatron's software also casts the model to
    # bf16, which keeps fewer fp32 tensors and runs no autocast casts, kernels that outweigh a tiny
    # model's attention: compared with autocast's precision, the attention kernel alone differs)
    scores = autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons,
                          software=SoftwareSpec(name="u", attention_kernel="unfused"))
    assert scores.predicted.peak_memory_bytes > fused.predicted.peak_memory_bytes
    assert scores.predicted.iteration_time_s > fused.predicted.iteration_time_s
    back = Plan.from_json(unfused.to_json())
    assert back == unfused and back.format_version == PLAN_FORMAT_VERSION
    unfused.save(tmp_path / "p.json")
    assert autopar.load_plan(tmp_path / "p.json").software.name == "megatron-lm-2021"
    line = [x for x in unfused.summary().splitlines() if x.startswith("software:")]
    assert line == ["software: megatron-lm-2021 (attention unfused, model cast to its 2-byte dtype (no autocast), "
                    "dp gradient sync after the backward, pipeline sends waited, pipeline sends split over tp and "
                    "all-gathered)"]
    # a SoftwareSpec of one's own is recorded as given
    own = SoftwareSpec(name="mine", attention_kernel="unfused", grad_sync_overlap=True)
    assert autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons, software=own).software == own


def test_overlapped_gradient_sync_hides_behind_the_backward():
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=0)
    base = SoftwareSpec.load("autopar")
    after = autopar.plan("gpt-small", cl, global_batch_size=8, constraints=cons, software=base)
    during = autopar.plan("gpt-small", cl, global_batch_size=8, constraints=cons,
                          software=base.model_copy(update={"name": "overlap", "grad_sync_overlap": True}))
    assert after.stages[0].predicted.communication_s > 0
    assert during.predicted.iteration_time_s < after.predicted.iteration_time_s
    assert during.predicted.collectives == after.predicted.collectives      # the same collectives, hidden


def test_fp16_dynamic_loss_scaling_unscales_the_gradients_once_a_step():
    """`loss_scaling` "dynamic" (torch GradScaler under Lightning's precision 16): one pass reading
    and writing every fp32 gradient the optimizer steps, in the step's tail; fp16 runs only."""
    from cost_models.compute import loss_scaling_bytes, memory_time, unscale_time

    assert loss_scaling_bytes("dynamic", "fp16") == 8.0
    assert loss_scaling_bytes("dynamic", "bf16") == loss_scaling_bytes("none", "fp16") == 0.0
    assert SoftwareSpec.load("flash-attn-1-2022").loss_scaling == "dynamic"
    assert resolve_software(None).loss_scaling == "none"      # autopar run scales no loss
    dev = ClusterSpec.load("dgx-a100-80g").device
    n = 1.5e9
    whole = memory_time(8 * n, dev) + dev.kernel_overhead_s
    assert unscale_time(n, dev, 8.0) == pytest.approx(whole)
    # torch's ZeroRedundancyOptimizer: GradScaler walks its param_groups, every parameter
    assert unscale_time(n, dev, 8.0, dp=8, zero=1, zero_optimizer="zero_redundancy") == pytest.approx(whole)
    # a flat ZeRO shard: its 1/dp of the gradients
    assert unscale_time(n, dev, 8.0, dp=8, zero=1) == pytest.approx(memory_time(n, dev) + dev.kernel_overhead_s)
    assert unscale_time(n, dev, 0.0) == 0.0

    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=0)
    base = SoftwareSpec.load("autopar")
    scaled = base.model_copy(update={"name": "scaled", "loss_scaling": "dynamic"})
    plans = {(sw.name, dt): autopar.plan("gpt-small", cl, global_batch_size=8, constraints=cons, software=sw, dtype=dt)
             for sw in (base, scaled) for dt in ("fp16", "bf16")}
    # every gradient unscaled once, in the step's tail: the plan grows by exactly that pass
    extra = plans["scaled", "fp16"].predicted.iteration_time_s - plans["autopar", "fp16"].predicted.iteration_time_s
    assert extra == pytest.approx(unscale_time(plans["autopar", "fp16"].model.num_params, dev, 8.0), rel=1e-6)
    # bf16 scales nothing: the same plan time either way
    assert plans["scaled", "bf16"].predicted.iteration_time_s == plans["autopar", "bf16"].predicted.iteration_time_s
    # the field is written only when it is not the default (plan digests of older software unchanged)
    assert "loss_scaling" not in base.model_dump() and scaled.model_dump()["loss_scaling"] == "dynamic"
    with pytest.raises(Exception, match="loss_scaling"):
        SoftwareSpec(name="x", loss_scaling="static")


def test_old_cluster_file_with_attention_kernel_loads_with_a_warning(tmp_path):
    data = yaml.safe_load((bundled_profiles_dir() / "dgx-a100-80g.yaml").read_text())
    data["device"]["attention_kernel"] = "unfused"
    data["device"]["sources"]["attention_kernel"] = "the 2021 runs"
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(SoftwareInHardwareWarning, match=r"device.attention_kernel \(unfused\).*--software"):
        cl = ClusterSpec.load(path)
    assert cl.device.legacy_attention_kernel == "unfused" and "attention_kernel" not in cl.model_dump_json()
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1)
    p = autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons)
    assert p.software.attention_kernel == "unfused" and p.software.name == "autopar, attention unfused"
    assert autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons,
                        software="autopar").software.attention_kernel == "fused"      # the choice given wins
    # a capacity sweep resizes the cluster: it keeps the old file's kernel too
    swept = autopar.sweep("gpt-tiny", [cl], [1, 2], tokens=1e6, global_batch_size=16)
    assert [pt.plan.software.attention_kernel for pt in swept.points if pt.plan] == ["unfused", "unfused"]
    data["device"]["attention_kernel"] = "flash"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match="field 'device'.*attention_kernel must be fused or unfused.*--software"):
        ClusterSpec.load(path)


def test_old_plan_file_migrates_its_device_attention_kernel():
    """A plan of format_version 6 kept the attention kernel in its device: it loads with the
    preset of the choices it was made with, and its device holds hardware only."""
    p = autopar.plan("gpt-tiny", "cpu", global_batch_size=8, dtype="fp32")
    for kernel, preset in (("unfused", "megatron-lm-2021"), ("fused", "autopar")):
        d = json.loads(p.to_json())
        del d["software"]
        d["format_version"] = 6
        d["cluster"]["device"]["attention_kernel"] = kernel
        d["cluster"]["device"]["sources"]["attention_kernel"] = "old"
        with warnings.catch_warnings():
            warnings.simplefilter("error", SoftwareInHardwareWarning)      # a plan migrates silently
            old = Plan.from_json(json.dumps(d))
        assert old.software == SoftwareSpec.load(preset) and old.format_version == PLAN_FORMAT_VERSION
        assert "attention_kernel" not in old.cluster.model_dump_json()
        assert old.stages == p.stages and old.predicted == p.predicted


def test_cli_software_option(tmp_path):
    env_run = dict(capture_output=True, text=True, timeout=300)
    bad = subprocess.run([sys.executable, "-m", "autopar", "plan", "--model", "gpt-tiny", "--cluster", "cpu",
                          "-b", "8", "--software", "flash9", "-q"], **env_run)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "autopar: error: unknown software 'flash9'; bundled: autopar, flash-attn-1-2022, flash-attn-2-2023, "
        "megatron-lm-2021, megatron-lm-2021-torch-ddp, nemo-automodel-2025, nemo-megatron-core-2024, "
        "torch-compile-2025 (or give a "
        "YAML/JSON file path)"]
    own = tmp_path / "sw.yaml"
    own.write_text(yaml.safe_dump({"attention_kernel": "unfused"}))
    out = tmp_path / "p.json"
    ok = subprocess.run([sys.executable, "-m", "autopar", "plan", "--model", "gpt-tiny", "--cluster", "cpu",
                         "-b", "8", "--dtype", "fp32", "--software", str(own), "-q", "-o", str(out)], **env_run)
    assert ok.returncode == 0, ok.stderr
    assert "software: sw (attention unfused, dp gradient sync after the backward)" in ok.stdout
    assert autopar.load_plan(out).software.attention_kernel == "unfused"
    show = subprocess.run([sys.executable, "-m", "autopar", "show", str(out)], **env_run)
    assert "software: sw (attention unfused" in show.stdout


def test_sweep_and_compare_plan_with_the_software(monkeypatch):
    res = autopar.sweep("gpt-tiny", ["cpu"], [1], tokens=1e6, global_batch_size=8, dtype="fp32",
                        software="megatron-lm-2021")
    chosen = res.points[0].plan
    assert chosen.software.name == "megatron-lm-2021"
    import autopar.planner as planner
    from autopar.compare import compare_baselines

    given, real = [], planner.plan

    def spy(*a, **k):
        given.append(k.get("software"))
        return real(*a, **k)
    monkeypatch.setattr(planner, "plan", spy)
    compare_baselines(chosen, "gpt-tiny", chosen.cluster)
    assert given and all(s == chosen.software for s in given)


def test_run_says_when_the_plan_assumes_other_software(capsys):
    from autopar.cli import _software_note

    p = autopar.plan("gpt-tiny", "cpu", global_batch_size=8, dtype="fp32", software="megatron-lm-2021")
    _software_note(p)
    assert capsys.readouterr().err.startswith("autopar: note: the plan's predictions assume software "
                                              "'megatron-lm-2021' (attention unfused")
    _software_note(p.model_copy(update={"software": resolve_software(None)}))
    assert capsys.readouterr().err == ""


def test_usable_memory_is_the_devices_less_the_softwares_terms(tmp_path):
    """Issue 14, session 35: what a plan may fill is what CUDA reports for the device, less one
    process's context, workspaces and one communicator's NCCL buffers (per channel the device's
    node gets), times 1 - the allocator's fragmentation; a flat `usable_fraction` overrides it; a
    CPU has no CUDA terms. Each term where it belongs: the device's in the hardware profile, the
    stack's in the software."""
    from cost_models.memory import usable_memory, usable_memory_terms

    a100 = ClusterSpec.load("dgx-a100-80g").device
    sw = resolve_software(None)
    t = usable_memory_terms(a100, sw)
    assert t.addressable == a100.memory_bytes - a100.driver_reserved_bytes == 81049 * 2**20
    assert t.collective == 24 * 10 * 2**20 == a100.collective_channels * sw.collective_buffer_bytes_per_channel
    pool = t.addressable - sw.cuda_context_bytes - sw.library_workspace_bytes - t.collective
    assert t.usable == pytest.approx(pool * (1 - sw.allocator_fragmentation)) == usable_memory(a100)
    assert 74 * 2**30 < t.usable < 74.5 * 2**30 and "NCCL buffers 0.23" in t.summary()
    # a device with more memory (a larger part, a bound lifted for a diagnostic) keeps the driver's
    # share and the per-process terms: the rest grows with it (was capped at the 80 GB part's total)
    big = a100.model_copy(update={"memory_bytes": 2 * a100.memory_bytes})
    assert usable_memory(big) - usable_memory(a100) == pytest.approx(
        a100.memory_bytes * (1 - sw.allocator_fragmentation))
    flash = resolve_software("flash-attn-2-2023")        # torch 1.13's lazy-loaded context
    assert usable_memory(a100, flash) - usable_memory(a100) == pytest.approx(
        (sw.cuda_context_bytes - flash.cuda_context_bytes) * (1 - sw.allocator_fragmentation))
    flat = sw.model_copy(update={"usable_fraction": 0.92})
    assert usable_memory(a100, flat) == a100.memory_bytes * 0.92
    cpu = ClusterSpec.load("cpu").device
    assert usable_memory(cpu) == pytest.approx(cpu.memory_bytes * (1 - sw.allocator_fragmentation))
    # a software file sets them; the plan records what it may fill; a bad share names the field
    f = tmp_path / "sw.yaml"
    f.write_text("name: sw\nallocator_fragmentation: 0.2\n")
    p = autopar.plan("gpt-tiny", "cpu", global_batch_size=8, dtype="fp32", software=str(f))
    assert p.predicted.usable_memory_bytes == pytest.approx(cpu.memory_bytes * 0.8)
    f.write_text("name: sw\nusable_fraction: 1.5\n")
    with pytest.raises(PlanError, match="usable_fraction"):
        SoftwareSpec.load(f)


def test_fused_attention_runs_at_its_kernels_head_dimension():
    """Issue 14, session 35: FlashAttention-2 runs a head dimension on the kernel compiled for the
    next multiple of 32 (static_switch.h), FlashAttention-1 any d <= 128 on its 128-wide kernel
    (fmha_api.cpp): the op takes that kernel's time, its FLOPs its own."""
    from cost_models.compute import attention_time, kernel_head_dim

    cl = ClusterSpec.load("dgx-a100-80g")
    fa2 = resolve_software("flash-attn-2-2023").on_cluster(cl).device
    fa1 = resolve_software("flash-attn-1-2022").on_cluster(cl).device
    assert [kernel_head_dim(fa2, d) for d in (64, 80, 96, 128)] == [64, 96, 96, 128]
    assert [kernel_head_dim(fa1, d) for d in (64, 80, 96, 128)] == [64, 128, 128, 128]

    def t(dev, heads, d):
        shape = (16, heads, 2048, d)
        return sum(attention_time(shape, shape, shape, dev, "bf16"))
    # FA1: 16 heads of 96 cost what 16 heads of 128 cost (hidden 1536 vs 2048)
    assert t(fa1, 16, 96) == pytest.approx(t(fa1, 16, 128), rel=1e-6)
    # FA2 compiles a 96-wide kernel: 16 heads of 96 cost about 3/4 of 16 of 128 (the d = 128 table,
    # read at the smaller slice's FLOPs: a little slower a FLOP), not all of it
    assert 0.75 * t(fa2, 16, 128) < t(fa2, 16, 96) < 0.8 * t(fa2, 16, 128)
    # a device with no list keeps the old reading (the nearest measured head dimension)
    bare = cl.device.model_copy(update={"attention_head_dims": None})
    assert kernel_head_dim(bare, 80) == 80


def test_fp32_gradients_are_megatrons_main_grad_buffer():
    """`grad_dtype` "fp32" (Megatron-LM under --bf16: accumulate_allreduce_grads_in_fp32, Megatron-
    Core's DDP grad buffer fp32): the model states are Megatron's distributed-optimizer table's "bf16
    parameters, fp32 gradients" row, 18 bytes a parameter, 6 + 12/d sharded
    (docs/source/api-guide/dist_optimizer.md); a plan holds twice the gradient bytes in its forward
    and backward and syncs 4 bytes an element (slower); an optimizer stepping the 2-byte parameters
    cannot take it; the default is left out of a dump, and the zoo's Megatron-LM rows take it."""
    from cost_models.memory import model_state_bytes

    n, d = 1.0e9, 8
    assert model_state_bytes(n, "bf16_fp32grad").total == 18 * n
    assert model_state_bytes(n, "bf16_fp32grad", zero_stage=1, dp=d).total == pytest.approx((6 + 12 / d) * n)
    base = SoftwareSpec.load("autopar")
    fp32 = base.model_copy(update={"name": "fp32 grads", "grad_dtype": "fp32"})
    assert base.state_policy("bf16") == "bf16" and fp32.state_policy("bf16") == "bf16_fp32grad"
    assert fp32.state_policy("fp32") == "fp32" and "fp32 gradients (main_grad buffer)" in fp32.summary()
    assert "grad_dtype" not in base.model_dump() and fp32.model_dump()["grad_dtype"] == "fp32"
    with pytest.raises(Exception, match="grad_dtype 'fp32' needs optimizer_states 'fp32'"):
        SoftwareSpec(name="x", grad_dtype="fp32", optimizer_states="param")
    with pytest.raises(Exception, match="grad_dtype"):
        SoftwareSpec(name="x", grad_dtype="bf16")
    cl = ClusterSpec.load("dgx-a100-80g")
    for zero in (0, 1):
        cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=zero)
        p = {sw.name: autopar.plan("gpt-small", cl, global_batch_size=16, constraints=cons, software=sw, dtype="bf16")
             for sw in (base, fp32)}
        fb = {k: v.stages[0].predicted.phases["forward_backward"] for k, v in p.items()}
        assert fb["fp32 grads"].gradients_bytes == 2 * fb["autopar"].gradients_bytes > 0
        assert fb["fp32 grads"].weights_bytes == fb["autopar"].weights_bytes
        assert fb["fp32 grads"].optimizer_bytes == fb["autopar"].optimizer_bytes
        assert p["fp32 grads"].predicted.iteration_time_s > p["autopar"].predicted.iteration_time_s


def test_zero3_states_bound_lets_fp32_gradients_reduce_every_microbatch():
    """The search's model-states bound for ZeRO-3 with several micro-batches takes the gradients
    reduce-scattered every micro-batch where it may try that: with fp32 gradients (`grad_dtype`
    fp32) the unsharded ones alone can overflow a device a plan reducing every micro-batch fits
    (the zoo's FSDP row, pruned at 119 GiB of states before; here at MiB scale)."""
    from cost_models.memory import runtime_phases

    sw = SoftwareSpec.load("autopar").model_copy(update={"name": "fp32 grads", "grad_dtype": "fp32",
                                                         "usable_fraction": 1.0})
    cl = ClusterSpec.load("dgx-h100")
    base = dict(dp=8, tp=1, pp=1, microbatch_size=1, recompute="full", zero_stage=3)
    each = autopar.plan("gpt-small", cl, global_batch_size=32, software=sw, dtype="bf16",
                        constraints=Constraints(**base, zero3_grad_sync="microbatch"))
    unsharded = max(ph.total for ph in runtime_phases(each.model.num_params, "bf16_fp32grad", 3, 8,
                                                      num_microbatches=4))
    mem = (each.predicted.peak_memory_bytes + unsharded) / 2
    assert each.predicted.peak_memory_bytes < mem < unsharded
    small = cl.model_copy(update={"device": cl.device.model_copy(update={"memory_bytes": mem})})
    p = autopar.plan("gpt-small", small, global_batch_size=32, software=sw, dtype="bf16",
                     constraints=Constraints(**base))
    assert p.zero3_grad_sync == "microbatch"
