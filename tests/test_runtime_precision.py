"""Mixed precision as planned: a bf16 plan trains under autocast (on CPU as on GPU), every layout
gives the losses of one bf16 process, and pipeline boundaries that autocast leaves in bf16 are
sent and received as bf16 (they were read as fp32 buffers once: the loss went to inf)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.models.registry import build_model
from tests.plans import make_plan
from tests.test_runtime import close, launch_layouts

pytestmark = pytest.mark.slow
STEPS = 4


def _mlp_plan(devices: int, pp: int, dtype: str):
    from autopar.planner import plan as make
    from autopar.schema import ClusterSpec, Constraints

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": devices, "num_nodes": 1})
    return make("mlp-tiny", cl, global_batch_size=8, dtype=dtype, intra_op="analytic",
                constraints=Constraints(dp=devices // pp, tp=1, pp=pp, num_microbatches=2))


def test_bf16_single_process_runs_under_autocast():
    """A one-process bf16 plan computes in bf16 with bf16 weights (its fp32 masters live in the
    optimizer); the fp32 plan does neither."""
    from autopar.runtime import run

    seen, state = {}, {}
    for dtype in ("fp32", "bf16"):
        b = build_model("gpt-tiny", device="meta")
        dts = []
        b.model.blocks[0].mlp.fc.register_forward_hook(
            lambda m, a, out, dts=dts: dts.append(out.dtype) if type(out) is torch.Tensor else None)  # not capture's
        rows = run(make_plan("single").model_copy(update={"dtype": dtype}), b, steps=1, quiet=True)
        seen[dtype] = (set(dts), b.model.blocks[0].mlp.fc.weight.dtype)
        state[dtype] = rows[-1]["measured_model_state_bytes"]
    assert seen["fp32"] == ({torch.float32}, torch.float32)
    assert seen["bf16"] == ({torch.bfloat16}, torch.bfloat16)
    # bytes per parameter, as the planner's precision policies: fp32 weights + Adam 12; bf16
    # weights + fp32 master + Adam 14 (gradients come and go within the step)
    n = sum(p.numel() for p in build_model("gpt-tiny", device="meta").model.parameters())
    assert state["fp32"] == pytest.approx(12 * n, rel=1e-3), (state, n)
    assert state["bf16"] == pytest.approx(14 * n, rel=1e-3), (state, n)


def test_bf16_layouts_equal_one_bf16_process(tmp_path: Path):
    """dp2 x tp2, pp2 x tp2 (GPipe), ZeRO-3 dp4 and the planner's mlp-tiny pp2 x dp2 (whose stage
    boundary is a bf16 linear output) in bf16 on 4 processes: losses within 2e-4 of one bf16
    process (reduction order in bf16), collectives as planned."""
    from autopar.runtime import run

    mlp = tmp_path / "mlp_pp2.json"
    _mlp_plan(4, 2, "bf16").save(mlp)
    layouts = ["dp2xtp2_bf16", "pp2xtp2_bf16", "zero3dp4_bf16", f"plan:{mlp}"]
    res = launch_layouts(layouts, tmp_path, steps=STEPS)   # bf16 drift over 4 steps
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors

    def losses(rows):
        return [r["loss"] for r in rows if "step" in r]

    gpt_ref = losses(run(make_plan("single_bf16"), "gpt-tiny", steps=STEPS, quiet=True))
    gpt_fp32 = losses(run(make_plan("single"), "gpt-tiny", steps=STEPS, quiet=True))
    assert gpt_ref != gpt_fp32          # autocast changed the arithmetic
    mlp_ref = losses(run(_mlp_plan(1, 1, "bf16"), "mlp-tiny", steps=STEPS, quiet=True))
    for lay in layouts:
        rows = res[lay]
        ref = mlp_ref if lay.startswith("plan:") else gpt_ref
        assert all(map(lambda x: x == x and abs(x) < 1e3, losses(rows))), (lay, losses(rows))
        assert close(losses(rows), ref, 2e-4), (lay, losses(rows), ref)
        assert rows[-1]["collectives_match"] is True, (lay, rows[-1])
    # ZeRO-3 under bf16 (FSDP's mixed-precision policy): fp32 shards of the weights and AdamW's
    # moments, 12/4 bytes per parameter on each of 4 ranks (the plan's 16/N less the gradients)
    n = sum(p.numel() for p in build_model("gpt-tiny", device="meta").model.parameters())
    assert res["zero3dp4_bf16"][-1]["measured_model_state_bytes"] == pytest.approx(3 * n, rel=0.01)


def test_bf16_checkpoints_keep_the_fp32_masters(tmp_path: Path):
    """A bf16 plan's checkpoint holds the fp32 masters (not the bf16 weights) under `model.*`,
    from the per-parameter masters of ZeRO 0 and the flat master shard of ZeRO-2 alike, so a
    resume - here the dp2 checkpoint of step 2 resumed by a ZeRO-2 plan - continues from the
    exact weights and ends where the uninterrupted run ends."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from autopar.runtime import run

    steps = 4
    a, z = tmp_path / "a", tmp_path / "z"
    run(make_plan("dp2_bf16"), "gpt-tiny", steps=steps, checkpoint_dir=str(a), checkpoint_every=2, quiet=True)
    z.mkdir()
    shutil.copytree(a / "step_00000002", z / "step_00000002")
    rz = run(make_plan("zero2dp2_bf16"), "gpt-tiny", steps=steps, checkpoint_dir=str(z), checkpoint_every=2,
             quiet=True)
    assert [r["step"] for r in rz if "step" in r] == [2, 3]

    def load(d: Path, step: int) -> dict:
        out = d / f"s{step}.pt"
        dcp_to_torch_save(str(d / f"step_{step:08d}"), str(out))
        return torch.load(out, weights_only=False)

    fa, fz = load(a, steps), load(z, steps)
    keys = [k for k in fa if k.startswith("model.")]
    assert keys and set(keys) == {k for k in fz if k.startswith("model.")}
    exact = total = 0
    for k in keys:
        assert fa[k].dtype == fz[k].dtype == torch.float32, (k, fa[k].dtype, fz[k].dtype)
        assert torch.allclose(fa[k], fz[k], rtol=0, atol=1e-6), (k, (fa[k] - fz[k]).abs().max())
        exact += int((fa[k] == fa[k].bfloat16().float()).sum())
        total += fa[k].numel()
    assert exact < 0.1 * total, (exact, total)   # fp32 masters: bf16 cannot hold these values
