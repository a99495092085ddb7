"""Selective recomputation (issue 13) runs as planned on 4 gloo processes: the attention core's
ops recomputed under torch's selective checkpoint, alone and with dp, tp and pp, module by
module (no tp: the fused attention call intercepted in the module holding it) and op by op as
solved (tp: the executor's regions), and an unfused core (nanoGPT's eager attention: a run of
five ops) op by op under tp and, module by module, its module checkpointed whole (the plan's
recorded fallback), in one launch: losses equal one process within 1e-4, every step's counted
collectives the plan's (the core issues none, so none is re-run). In the same launch
recompute="attention" (the module holding each core checkpointed whole, projections too):
module by module (`torch.utils.checkpoint` around `blocks.*.attn`) and op by op under tp (the
module's ops one executor region, its forward collectives re-run). And recompute="norm_act"
(issue 17: Megatron-Core's output-discarding recomputation of the norms and the routed experts'
activation, `runtime.discard`), module by module: pp2 x dp2 (pipeline chunks cut from the
traced model, their aten ops recorded) and the zoo MoE at dp 4 x ep 2 (the experts' SiLU product
discarded and re-made); and op by op as solved at dp2 x tp2 (`intra_op.execute._DiscardState`:
each norm's DTensor output discarded once the projections saved it, re-made through the
executor in the backward)."""

import pytest

from autopar import Constraints
from tests.captured import reference_losses, shared_plan
from tests.test_runtime_planned import STEPS, _run_in_one_job, _single, assert_ran_as_planned

pytestmark = pytest.mark.slow

EAGER = "tests.user_models:eager_gpt"
PINS = {
    "dp4": ("gpt-tiny", dict(dp=4, tp=1, pp=1)),
    "tp4": ("gpt-tiny", dict(dp=1, tp=4, pp=1)),
    "dp2xtp2": ("gpt-tiny", dict(dp=2, tp=2, pp=1)),
    "pp2xdp2": ("gpt-tiny", dict(dp=2, tp=1, pp=2, schedule="1f1b")),
    "eager_pp2xtp2": (EAGER, dict(dp=1, tp=2, pp=2, schedule="1f1b")),
    "eager_dp4": (EAGER, dict(dp=4, tp=1, pp=1)),
}
# recompute="attention" beside them, in the same launch
ATTENTION = {
    "attention_pp2xdp2": ("gpt-tiny", dict(dp=2, tp=1, pp=2, schedule="1f1b")),
    "attention_dp2xtp2": ("gpt-tiny", dict(dp=2, tp=2, pp=1)),
}
# recompute="norm_act" beside them, in the same launch
NORM_ACT = {
    "norm_act_pp2xdp2": ("gpt-tiny", dict(dp=2, tp=1, pp=2, schedule="1f1b")),
    "norm_act_moe_dp4_ep2": ("moe-tiny", dict(dp=4, tp=1, pp=1, ep=2)),
    "norm_act_dp2xtp2": ("gpt-tiny", dict(dp=2, tp=2, pp=1)),
    "norm_act_moe_dp2xtp2_ep2": ("moe-tiny", dict(dp=2, tp=2, pp=1, ep=2)),
}


def test_selective_plans_run_as_predicted(tmp_path):
    plans = {}
    for name, (ref, pins) in PINS.items():
        cons = Constraints(recompute="selective", num_microbatches=2, **pins)
        p = shared_plan(ref, 4, constraints=cons, intra_op="ilp")
        fallback = name == "eager_dp4"
        assert ("selective_fallback" in p.search) == fallback, (name, p.search)
        for s in p.stages:
            assert s.recompute == "selective" and bool(s.recompute_ops) != fallback, (name, s)
            # run op by op exactly where there is a tp axis; its regions are the plan's ops
            assert (s.op_layouts is not None) == (s.axis_size("tp") > 1), (name, p.search)
            if s.op_layouts is not None:
                assert [o for r in s.op_layouts.recompute_regions() for o in r] == s.recompute_ops
        plans[name] = p
    for name, (ref, pins) in ATTENTION.items():
        cons = Constraints(recompute="attention", num_microbatches=2, **pins)
        p = shared_plan(ref, 4, constraints=cons, intra_op="ilp")
        for s in p.stages:
            assert s.recompute == "attention" and s.recompute_ops is None, (name, s)
            assert s.recompute_modules and all(m.endswith(".attn") for m in s.recompute_modules), (name, s)
            assert (s.op_layouts is not None) == (s.axis_size("tp") > 1), (name, p.search)
            if s.op_layouts is not None:
                # one region per layer: the attention module's ops, its projections among them
                regions = s.op_layouts.recompute_regions()
                assert len(regions) == len(s.recompute_modules) and all(len(r) > 5 for r in regions), regions
        plans[name] = p
    for name, (ref, pins) in NORM_ACT.items():
        p = shared_plan(ref, 4, constraints=Constraints(recompute="norm_act", num_microbatches=2, **pins))
        for s in p.stages:
            assert s.recompute == "norm_act" and (s.op_layouts is not None) == (s.axis_size("tp") > 1), (name, s)
            if s.op_layouts is not None:
                # the norms' regions, one op each, none checkpointed
                assert not s.op_layouts.recompute_regions()
                norms = [r for r in s.op_layouts.discard_regions() if len(r) == 1]
                assert len(norms) == 4 and all(r[0].startswith(("layer_norm", "rms_norm")) for r in norms), norms
            assert s.recompute_modules and all(m.rsplit(".", 1)[-1].startswith(("ln", "attn_norm", "mlp_norm"))
                                               for m in s.recompute_modules), (name, s)
            assert s.recompute_acts == (["layers.0.mlp.experts", "layers.1.mlp.experts"] if p.ep > 1 else []), s
        plans[name] = p
    rows = _run_in_one_job(tmp_path, plans, 4)
    refs = {ref: reference_losses(_single(ref=ref), ref, STEPS)
            for ref in {r for r, _ in [*PINS.values(), *ATTENTION.values(), *NORM_ACT.values()]}}
    for name, p in plans.items():
        ref = {**PINS, **ATTENTION, **NORM_ACT}[name][0]
        assert_ran_as_planned(name, rows[name], p, refs[ref], first=1 if p.pp > 1 else 0)
