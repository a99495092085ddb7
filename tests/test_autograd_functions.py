"""Custom `torch.autograd.Function`s (`autopar.capture.functions`): a straight-through estimator
and a Function with a backward of its own choosing (`tests.user_models:ste_gpt`), Hugging Face
BLOOM's `GeLUFunction`. torch.export records a Function's forward ops and nothing of its
backward; the capture marks them as the call's, the memory model counts what the Function saves,
and every runtime path runs the user's Function (the eager module under dp/ZeRO, the
tensor-parallel executor, pipeline chunks): losses equal to one process, where autograd through
the traced `round` would give a zero gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.capture import capture
from autopar.capture.export import export_program
from autopar.capture.functions import regions
from cost_models.memory import saved_tensors
from tests.user_models import ste_gpt

STE = "tests.user_models:ste_gpt"


def _ste_graph(layers: int = 2, **kw):
    model, inputs, _ = ste_gpt(layers)
    return capture(model, inputs, **kw)


def test_capture_marks_each_function_call_and_what_it_saves():
    g = _ste_graph()
    by = {n.name: n for n in g.nodes}
    calls: dict[str, list] = {}
    for n in g.calls:
        if n.function:
            calls.setdefault(n.function, []).append(n)
    # two calls a block (RoundSTE: mul, round, div; SquashSTE: tanh), numbered in order
    assert sorted(calls) == ["RoundSTE#0", "RoundSTE#2", "SquashSTE#1", "SquashSTE#3"]
    assert [n.op for n in calls["RoundSTE#0"]] == ["mul", "round", "div"]
    # RoundSTE saves nothing; SquashSTE its input, the RoundSTE's output: listed on its first op
    assert all(not n.function_saves for n in calls["RoundSTE#0"])
    (tanh,) = calls["SquashSTE#1"]
    assert tanh.function_saves == [calls["RoundSTE#0"][-1].name]
    # the memory model: the saved input for the call, nothing for the ops (autograd would save
    # tanh's output and the products' operands)
    assert saved_tensors(tanh, by, "fp32") == [(calls["RoundSTE#0"][-1].name, None)]
    assert all(saved_tensors(n, by, "fp32") == [] for n in calls["RoundSTE#0"])
    # its backward measured on meta: `g / (1 + |x|) ** 2` holds two tensors of x's size at once
    assert tanh.function_work == pytest.approx(2.0)
    assert not any(n.function for n in g.calls if n.op in ("linear", "layer_norm"))


def test_stitched_capture_numbers_calls_as_the_whole_export():
    stitched = _ste_graph(6)
    whole = _ste_graph(6, repeated=False)
    assert stitched.capture_method.endswith("stitched)")
    assert [(n.name, n.function, n.function_saves, n.function_work) for n in stitched.nodes] == \
        [(n.name, n.function, n.function_saves, n.function_work) for n in whole.nodes]


def test_capture_cache_keeps_the_marks(tmp_path):
    from autopar.capture.cache import decode, encode

    g = _ste_graph()
    back = decode(__import__("json").loads(__import__("json").dumps(encode(g))))
    assert [(n.function, n.function_saves, n.function_work) for n in back.nodes] == \
        [(n.function, n.function_saves, n.function_work) for n in g.nodes]


class _MaskedSTE(torch.autograd.Function):
    """Rounds its input; the gradient passes where `mask` is set. The forward does not read the
    mask: no op of the trace names it."""

    @staticmethod
    def forward(ctx, x, mask):  # noqa: ANN001, ANN205
        ctx.save_for_backward(mask)
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        (mask,) = ctx.saved_tensors
        return g * mask, None


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return _MaskedSTE.apply(h, (h > 0).float()).sum()


def test_a_function_its_traced_program_cannot_run_is_refused_by_name():
    """A Function whose forward leaves a tensor argument unread cannot be re-run from the trace
    (nothing names the argument): the program paths refuse it, naming it and the way out,
    rather than run autograd through its forward's ops."""
    ep, _, _ = export_program(_Masked(), (torch.randn(2, 8),))
    with pytest.raises(autopar.PlanError, match=r"_MaskedSTE .*argument\(s\) \[1\].*without tp or pp"):
        regions(ep.graph)


def test_bloom_gelu_saves_its_input():
    """Hugging Face BLOOM's `GeLUFunction` (its GELU in training): the capture marks the tanh
    formula's ops as the call's, which saves its input alone, and measures its backward (the
    formula recomputed: 5 of the input's size at once)."""
    pytest.importorskip("transformers")
    from autopar.models import build_model

    b = build_model("tests.hf_architectures:bloom")
    g = capture(b.model, b.example_inputs)
    firsts = [n for n in g.calls if n.function and n.function_saves]
    assert len(firsts) == 4 and all(n.function.startswith("GeLUFunction#") for n in firsts)
    by = {n.name: n for n in g.nodes}
    for n in firsts:
        (x,) = n.function_saves
        assert by[x].op in ("addmm", "linear", "view")           # the up-projection's output
        assert n.function_work == pytest.approx(5.0)
    inner = [n for n in g.calls if n.function]
    assert sum(len(saved_tensors(n, by, "bf16")) for n in inner) == 4


# -- runtime: losses equal to one process --------------------------------------------------
LAYOUTS = {
    # op by op as solved (the executor runs each call as `Function.apply` on DTensors)
    "tp2xdp2": dict(dp=2, tp=2, pp=1),
    # pipeline chunks traced by torch's pipeline tracer (each call folded into one node)
    "pp2xdp2": dict(dp=2, tp=1, pp=2, schedule="gpipe", num_microbatches=2),
    # pipeline chunks of the solved program (`intra_op.pipeline_chunks`)
    "pp2xtp2": dict(dp=1, tp=2, pp=2, schedule="gpipe", num_microbatches=2),
    # tp and ZeRO-3: each FSDP unit's ops one call, the Function inside
    "tp2xdp2_zero3": dict(dp=2, tp=2, pp=1, zero_stage=3),
}


@pytest.mark.slow
def test_straight_through_estimator_trains_as_one_process(tmp_path):
    """`ste_gpt` on 4 gloo processes under tp, pipelines of both kinds and tp x ZeRO-3: losses
    of 2 steps equal to one process within 1e-4 (autograd through the traced `round` gave
    4.8425 for 4.8405 at step 2 under tp 2), collectives as the plan counts them."""
    from tests.captured import one_process_losses, shared_plan
    from tests.launch import run_plans

    want = one_process_losses(STE, 2)
    plans = {k: shared_plan(STE, 4, constraints=autopar.Constraints(**c)) for k, c in LAYOUTS.items()}
    rows = run_plans(tmp_path, plans, 4, steps=2)
    for k, r in rows.items():
        assert not (isinstance(r, dict) and "error" in r), (k, r)
        steps = [x for x in r if "step" in x]
        got = [x["loss"] for x in steps]
        assert len(got) == len(want) and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (k, got, want)
        assert steps[-1]["collectives"] == plans[k].predicted.collectives, (k, steps[-1]["collectives"])
