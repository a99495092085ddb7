"""Layouts of a model autopar knows nothing about (issue 20, "pipelines for any model"): a
nanoGPT written as a user would (`tests.user_models`: fused qkv split in three, head computed as
`x @ wte.weight.t()` with no output module, the loss inside `forward`) has no zoo family and no
`pipeline_loss`; its pipeline stages are cut from the traced model (`runtime.graph_stages`).
Each plan comes from `autopar.plan` pinned to the layout and runs on 4 gloo processes through
`autopar.runtime.run`: losses equal to one process within 1e-4, collectives as the plan counts
them (after the first step, which carries torch.pipelining's warm-up)."""

from __future__ import annotations

import pytest

import autopar
from autopar.planner import plan
from autopar.runtime import run

pytestmark = pytest.mark.slow

REF = "tests.user_models:nanogpt"
STEPS = 3
LAYOUTS = {
    # the head reads wte.weight outside wte: wte is left to FSDP's root unit (issue 20's
    # "fsdp.chunk_cat has no sharding strategy" when it was its own unit)
    "dp4_zero3": dict(dp=4, tp=1, pp=1, zero_stage=3),
    "pp4_1f1b": dict(dp=1, tp=1, pp=4, schedule="1f1b", num_microbatches=4),
    "pp2xdp2_gpipe_zero3": dict(dp=2, tp=1, pp=2, schedule="gpipe", num_microbatches=2, zero_stage=3),
    "pp2xtp2_gpipe": dict(dp=1, tp=2, pp=2, schedule="gpipe", num_microbatches=2),
    "pp2xdp2_interleaved": dict(dp=2, tp=1, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                                num_microbatches=2),
}


def _cluster(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


@pytest.fixture(scope="module")
def reference() -> list[float]:
    p = plan(REF, _cluster(1), global_batch_size=8, dtype="fp32")
    return [r["loss"] for r in run(p, REF, steps=STEPS, quiet=True) if "step" in r]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every layout planned by `autopar.plan`, saved, and run in one 4-process job (the
    runtime tests' layouts job, `tests/plans.py`): {layout: (plan, rows)}."""
    import json
    from pathlib import Path

    from tests.launch import elastic_run

    folder = tmp_path_factory.mktemp("user_plans")
    plans = {}
    for name, cons in LAYOUTS.items():
        p = plan(REF, _cluster(4), global_batch_size=8, dtype="fp32", constraints=autopar.Constraints(**cons))
        p.save(folder / f"{name}.json")
        plans[name] = p
    out = folder / "rows.json"
    root = Path(__file__).resolve().parents[1]
    elastic_run(root / "tests" / "plans.py", ["--out", str(out), "--steps", str(STEPS),
                                               *[f"plan:{folder / f'{n}.json'}" for n in plans]], 4)
    rows = json.loads(out.read_text())
    return {n: (plans[n], rows[f"plan:{folder / f'{n}.json'}"]) for n in plans}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_user_model_pipelines_equal_one_process(layout: str, reference: list[float], launched: dict) -> None:
    p, rows = launched[layout]
    assert p.pp == {"pp4_1f1b": 4, "dp4_zero3": 1}.get(layout, 2)
    assert not (isinstance(rows, dict) and "error" in rows), rows
    steps = [r for r in rows if "step" in r]
    got = [r["loss"] for r in steps]
    assert len(got) == len(reference) and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, reference)), \
        (got, reference)
    assert steps[-1]["collectives"] == p.predicted.collectives, (steps[-1]["collectives"], p.predicted.collectives)


def test_tensors_made_before_the_first_layer_are_carried_through_every_chunk():
    """A model whose layers also read tensors made once before them (`GatedLM`: a gate that
    needs a gradient and a boolean mask) cut into three chunks: each boundary carries the
    hidden states and both tensors (the middle chunk passes the gate and mask on), and the
    chunks run one after another give the model's loss and gradients exactly."""
    import torch

    from autopar.runtime.graph_stages import FedChunk, split_model
    from autopar.runtime.materialize import canonical_names, materialize
    from tests.user_models import GatedLM

    torch.manual_seed(0)
    model = GatedLM(4)
    idx = torch.randint(1, 128, (2, 16))
    idx[0, :3] = 0                                     # masked tokens
    tgt = torch.randint(0, 128, (2, 16))
    with torch.device("meta"):
        meta = GatedLM(4)
    ex = tuple(torch.empty(2, 16, dtype=torch.long, device="meta") for _ in range(2))
    chunks = split_model(meta, ex, ["layers.1", "layers.3"], torch.device("cpu"))
    assert len(chunks) == 3
    assert [len(c.sends or []) for c in chunks] == [3, 3, 0]
    assert sum(kind == "act" for kind, _ in chunks[1].sends) == 2     # gate and mask, passed on
    state = model.state_dict()
    aliases = canonical_names(model)
    received: tuple = (idx,)
    outs = []
    for ch in chunks:
        materialize(ch.module, seed=0, aliases=aliases)
        ch.module.load_state_dict({k: v for k, v in state.items() if k in ch.module.state_dict()})
        y = FedChunk(ch.module, ch.sources, ch.sends).run(received, lambda k: (idx, tgt)[k])
        received = y if isinstance(y, tuple) else (y,)
        outs.append(ch.module)
    loss = received[0]
    want = model(idx, tgt)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    loss.backward()
    want.backward()
    got = {n: p.grad for m in outs for n, p in m.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-7)


def test_a_pipeline_the_graph_cannot_carry_is_refused_before_launch():
    """Hugging Face GPT-2 hands its blocks the hidden states and a causal mask: two tensors per
    boundary, which graph pipelines do not carry yet. `check_plan` (what `autopar run` calls
    before starting any process) says so in one PlanError."""
    pytest.importorskip("transformers")
    from autopar.models.registry import build_model
    from autopar.runtime import check_plan
    from autopar.schema.errors import PlanError

    ref = "hf:gpt2?num_hidden_layers=4&n_embd=64&n_head=4&n_positions=64&seq_len=16&vocab_size=128"
    p = plan(ref, _cluster(4), global_batch_size=8, dtype="fp32",
             constraints=autopar.Constraints(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2))
    with pytest.raises(PlanError, match="pipeline chunk 1 of GPT2LMHeadModel .* carry one activation"):
        check_plan(p, build_model(ref, device="meta"), world_size=4, model_ref=ref)
