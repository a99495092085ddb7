"""Mixed precision as planned: a bf16 plan trains under autocast (on CPU as on GPU), every layout
gives the losses of one bf16 process, and pipeline boundaries that autocast leaves in bf16 are
sent and received as bf16 (they were read as fp32 buffers once: the loss went to inf)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
    """A one-process bf16 plan computes its matmuls in bf16 (parameters stay fp32); the fp32 plan
    does not."""
    from autopar.models.registry import build_model
    from autopar.runtime import run

    seen = {}
    for dtype in ("fp32", "bf16"):
        b = build_model("gpt-tiny", device="meta")
        dts = []
        b.model.blocks[0].mlp.fc.register_forward_hook(
            lambda m, a, out: dts.append(out.dtype) if type(out) is torch.Tensor else None)  # not capture's
        run(make_plan("single").model_copy(update={"dtype": dtype}), b, steps=1, quiet=True)
        seen[dtype] = (set(dts), b.model.blocks[0].mlp.fc.weight.dtype)
    assert seen["fp32"] == ({torch.float32}, torch.float32)
    assert seen["bf16"] == ({torch.bfloat16}, torch.float32)


def test_bf16_layouts_equal_one_bf16_process(tmp_path: Path):
    """dp2 x tp2, pp2 x tp2 (GPipe), ZeRO-3 dp4 and the planner's mlp-tiny pp2 x dp2 (whose stage
    boundary is a bf16 linear output) in bf16 on 4 processes: losses within 2e-4 of one bf16
    process (reduction order in bf16), collectives as planned."""
    from autopar.runtime import run

    mlp = tmp_path / "mlp_pp2.json"
    _mlp_plan(4, 2, "bf16").save(mlp)
    layouts = ["dp2xtp2_bf16", "pp2xtp2_bf16", "zero3dp4_bf16", f"plan:{mlp}"]
    res = launch_layouts(layouts, tmp_path)
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
