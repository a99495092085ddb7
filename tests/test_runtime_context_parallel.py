"""Context parallelism (issue 13) runs as planned on 4 gloo processes: each rank two chunks of
every sequence, the fused attention over K and V all-gathered on the cp axis (their gradients
reduce-scattered), positions of the whole sequence; alone (cp4, with and without recomputing
the attention module; under ZeRO-3, FSDP over the cp ranks), with dp (cp2 x dp2, full
recomputation: the gather re-run) and with tp (cp2 x tp2, op by op as solved, issue 20: with selective
recomputation the region re-run is the cp attention, gather included): losses
equal one process within 1e-4, every step's counted collectives the plan's. BERT's masked-LM
loss averages over the masked tokens only, as many on each rank by chance: under cp4 and
cp2 x tp2 (its loss vocabulary-parallel) its loss equals one process's too, each rank's count
all-reduced over the cp group once per micro-batch (in the plan's collectives). Models that
make their own positions (Hugging Face causal LMs wrapped by a user: their `arange` made the
rank's positions, their labels' shift done before the split) too. Every 4-process plan of the
module runs in one launch (`launched`)."""

import pytest

from autopar import ClusterSpec, Constraints
from tests.captured import reference_losses, shared_plan
from tests.test_context_parallel import solved_counts
from tests.test_runtime_planned import STEPS, _run_in_one_job, _single, assert_ran_as_planned

pytestmark = pytest.mark.slow

REF = "llama-tiny"
PINS = {
    "cp4": dict(cp=4, dp=1, tp=1, recompute="none"),
    "cp4_attention": dict(cp=4, dp=1, tp=1, recompute="attention"),
    "cp2xdp2_full": dict(cp=2, dp=2, tp=1, recompute="full"),
    "cp2xtp2_selective": dict(cp=2, dp=1, tp=2, recompute="selective"),
    "cp4_zero3": dict(cp=4, dp=1, tp=1, recompute="full", zero_stage=3),
}
# cp x tp run op by op as solved (issue 20): the zoo GPT and Llama, with recomputation and ZeRO
SOLVED_PINS = {
    "gpt_cp2xtp2": ("gpt-tiny", dict(cp=2, dp=1, tp=2, recompute="none")),
    "gpt_cp2xtp2_full_zero3": ("gpt-tiny", dict(cp=2, dp=1, tp=2, recompute="full", zero_stage=3)),
    "cp2xtp2_full_zero1": (REF, dict(cp=2, dp=1, tp=2, recompute="full", zero_stage=1)),
}
BERT = "bert-tiny"
BERT_PINS = {
    "bert_cp4": dict(cp=4, dp=1, tp=1, recompute="none"),
    "bert_cp2xtp2": dict(cp=2, dp=1, tp=2, recompute="full"),
}


_REFS: dict[str, list[float]] = {}


def _one_process(ref: str) -> list[float]:
    """`STEPS` steps of `ref`'s one-process plan (`_single`), memory untracked, once in the module."""
    if ref not in _REFS:
        _REFS[ref] = reference_losses(_single(ref=ref), ref, STEPS)
    return _REFS[ref]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The 4-process plans of the tests below (cp alone and with dp / tp, BERT's, Hugging Face
    Llama's, models that make their own positions, in pipeline stages), each planned as its
    test describes, run `STEPS` (2) steps in one 4-process job (`tests/plans.py`, memory
    untracked): {name: (plan, rows)}. Each model is captured once and its per-layer costs
    shared by its layouts (`tests.captured.shared_plan`: the plan `autopar.plan` makes)."""
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})

    def plan(ref: str, cl: ClusterSpec, **kwargs):
        return shared_plan(ref, cl.devices_per_node, **kwargs)

    plans = {name: plan(REF, cl, global_batch_size=8, dtype="fp32",
                        constraints=Constraints(pp=1, num_microbatches=2, **pins)) for name, pins in PINS.items()}
    plans.update({name: plan(ref, cl, global_batch_size=8, dtype="fp32",
                             constraints=Constraints(pp=1, num_microbatches=2, **pins))
                  for name, (ref, pins) in SOLVED_PINS.items()})
    plans.update({name: plan(BERT, cl, global_batch_size=8, dtype="fp32",
                             constraints=Constraints(pp=1, num_microbatches=2, **pins))
                  for name, pins in BERT_PINS.items()})
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        plans.update({name: plan(HF_LLAMA, cl, global_batch_size=8, dtype="fp32",
                                 constraints=Constraints(pp=1, num_microbatches=2, **pins))
                      for name, pins in HF_PINS.items()})
        plans["hf_gpt2_cp2xtp2"] = plan(HF_GPT2, cl, global_batch_size=8, dtype="fp32",
                                        constraints=Constraints(pp=1, num_microbatches=2, cp=2, dp=1, tp=2,
                                                                recompute="selective"))
        plans.update({name: plan(ref, cl, global_batch_size=8, dtype="fp32",
                                 constraints=Constraints(pp=1, num_microbatches=2, **pins))
                      for name, (ref, pins) in OWN_PINS.items()})
    plans.update({name: plan(ref, cl, global_batch_size=8, dtype="fp32",
                             constraints=Constraints(num_microbatches=2, **pins))
                  for name, (ref, pins) in PP_PINS.items()
                  if not ref.startswith("hf:") or "hf_cp4" in plans})      # transformers installed
    rows = _run_in_one_job(tmp_path_factory.mktemp("cp_plans"), plans, 4)
    return {name: (p, rows[name]) for name, p in plans.items()}


def test_context_parallel_plans_run_as_predicted(launched):
    plans = {}
    for name, pins in PINS.items():
        p = launched[name][0]
        assert p.cp == pins["cp"] and "cp_executor" not in p.search, (name, p.search)
        assert p.stages[0].mesh_axis_names == ("dp", "cp", "tp")
        # 2 layers x 2 micro-batches x (K, V), the gather again where the attention is recomputed
        again = 2 if pins["recompute"] != "none" else 1
        fsdp = {"all_gather": 20, "reduce_scatter": 5} if pins.get("zero_stage") == 3 else {}
        # a tp stage runs op by op as solved (issue 20): the solution's collectives beside
        solved = solved_counts(p) if pins["tp"] > 1 else {}
        assert (p.stages[0].op_layouts is not None) == (pins["tp"] > 1) and "tp_executor" not in p.search
        assert p.predicted.collectives["all_gather"] == 8 * again + fsdp.get("all_gather", 0) + \
            solved.get("all_gather", 0), (name, p.predicted)
        assert p.predicted.collectives["reduce_scatter"] == 8 + fsdp.get("reduce_scatter", 0) + \
            solved.get("reduce_scatter", 0), (name, p.predicted)
        plans[name] = p
    for name, pins in BERT_PINS.items():
        p = launched[name][0]
        assert p.cp == pins["cp"] and "cp_executor" not in p.search, (name, p.search)
        # the loss's token count, once per micro-batch, beside the gradient all-reduce
        assert p.predicted.collectives["all_reduce"] >= 2 + 1, (name, p.predicted)
        plans[name] = p
    for name, p in plans.items():
        assert_ran_as_planned(name, launched[name][1], p, _one_process(BERT if name in BERT_PINS else REF))


def test_cp_x_tp_runs_op_by_op_as_solved(launched):
    """Context x tensor parallelism run by the executor (issue 20): the program exported at a
    rank's tokens, positions read when it runs, the attention op the cp attention over its
    tp-local heads (`runtime.context_parallel.ProgramContext`). cp2 x tp2 on 4 gloo processes,
    the zoo GPT (alone; full recomputation under ZeRO-3, FSDP over the cp ranks) and Llama
    (full recomputation, ZeRO-1): every stage carries its layouts, no fallback recorded,
    losses equal one process within 1e-4 (2e-6: wrong positions move the Llama's ~1e-5), every
    step's counted collectives the plan's (the exchange and the solution's, no dry run)."""
    for name, (ref, _pins) in SOLVED_PINS.items():
        p, rows = launched[name]
        assert (p.cp, p.tp) == (2, 2) and p.stages[0].op_layouts is not None, name
        assert "tp_executor" not in p.search and "cp_executor" not in p.search, (name, p.search)
        assert_ran_as_planned(name, rows, p, _one_process(ref))
        assert [r["loss"] for r in rows if "step" in r] == pytest.approx(_one_process(ref), rel=2e-6), name


HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
            "&num_attention_heads=4&seq_len=16&vocab_size=128")
HF_PINS = {
    "hf_cp4": dict(cp=4, dp=1, tp=1, recompute="none"),
}


def test_hugging_face_llama_runs_context_parallel_as_one_process(launched):
    """A Hugging Face Llama (`hf:llama`, grouped-query attention) under context parallelism:
    its tokens' positions reach its rotary embedding as `position_ids` (each rank's chunks where
    they are in the sequence), its targets are shifted in the batch (the model shifts nothing,
    so each rank's chunks carry theirs), its SDPA calls (`enable_gqa`, no mask: transformers
    reads no packed sequences off the chunks' position jumps) run as the cp attention. cp4 on 4
    gloo processes (its cp2 x dp2 and cp2 x tp2: `MATRIX_LAYOUTS`): losses equal one process's
    within 1e-4 (and 2e-6: below what wrong positions move them), every step's counted
    collectives the plan's."""
    pytest.importorskip("transformers")
    plans, rows = {}, {}
    for name, pins in HF_PINS.items():
        p, rows[name] = launched[name]
        assert p.cp == pins["cp"] and "cp_executor" not in p.search, (name, p.search)
        plans[name] = p
    ref = _one_process(HF_LLAMA)
    for name, p in plans.items():
        assert_ran_as_planned(name, rows[name], p, ref)
        # at its initial weights (std 0.02) this model's loss moves by only ~2e-5 when every
        # rank's chunks are placed at positions 0.. (measured): 1e-4 would not see wrong
        # positions; run right, the losses agree to ~1e-7 in fp32
        assert [r["loss"] for r in rows[name] if "step" in r] == pytest.approx(ref, rel=2e-6), name


# GPT-2 without attention dropout (its default 0.1 leaves cp out: the cp attention takes none);
# its fused Conv1D QKV held chunk-interleaved by the executor
HF_GPT2 = ("hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=128&seq_len=16"
           "&attn_pdrop=0&resid_pdrop=0&embd_pdrop=0")


def test_hugging_face_gpt2_runs_cp_x_tp_op_by_op(launched):
    """A Hugging Face GPT-2 (its positions as `position_ids`, fused Conv1D QKV) under cp2 x tp2
    with selective recomputation, run op by op as solved (issue 20): losses equal one
    process's within 2e-6, every step's counted collectives the plan's."""
    pytest.importorskip("transformers")
    p, rows = launched["hf_gpt2_cp2xtp2"]
    assert (p.cp, p.tp) == (2, 2) and p.stages[0].op_layouts is not None and "tp_executor" not in p.search
    ref = _one_process(HF_GPT2)
    assert_ran_as_planned("hf_gpt2_cp2xtp2", rows, p, ref)
    assert [r["loss"] for r in rows if "step" in r] == pytest.approx(ref, rel=2e-6)


# Hugging Face causal LMs wrapped by a user (tests/hf_architectures.py): their own positions'
# arange, the labels shifted inside the model (`capture.own_positions`)
OWN_PINS = {
    "own_mistral_cp2xtp2": ("tests.hf_architectures:mistral", dict(cp=2, dp=1, tp=2, recompute="none")),
    "own_bigcode_cp4": ("tests.hf_architectures:bigcode", dict(cp=4, dp=1, tp=1, recompute="none")),
    # Falcon builds an explicit mask from its positions under tracing: found causal, run as such
    "own_falcon_cp2xtp2": ("tests.hf_architectures:falcon", dict(cp=2, dp=1, tp=2, recompute="none")),
}


def test_models_that_make_their_own_positions_run_context_parallel_as_one_process(launched):
    """Hugging Face causal LMs as a user wraps them (`tests.hf_architectures`: transformers'
    own forward, which makes its positions with `torch.arange` and shifts its labels inside):
    the capture finds the positions' arange (of the sequence's length at two lengths) and the
    shift (`capture.own_positions`), so the plan says cp is executed; the runtime runs the
    model's program traced at a rank's tokens, that arange made the op that reads the rank's
    positions, the labels shifted on the whole sequence before the split. Mistral (rotary,
    grouped KV heads) under cp2 x tp2 op by op as solved, GPTBigCode (learned position
    embeddings, multi-query attention) under cp4 (Mistral's cp2 x dp2 and GPT-NeoX's cp4:
    `MATRIX_LAYOUTS`), Falcon (an explicit mask `k_pos <= q_pos` built from its
    positions, found to be the causal one and run as causal cp attention) under cp2 x tp2, on
    4 gloo processes: losses equal one process within
    1e-4 (and 2e-6: positions placed at 0 on every rank move them by ~1e-5, a label shift on
    the rank's chunks far more), every step's counted collectives the plan's."""
    pytest.importorskip("transformers")
    for name, (ref, pins) in OWN_PINS.items():
        p, rows = launched[name]
        assert p.cp == pins["cp"] and "cp_executor" not in p.search, (name, p.search)
        assert (p.stages[0].op_layouts is not None) == (pins["tp"] > 1) and "tp_executor" not in p.search
        assert_ran_as_planned(name, rows, p, _one_process(ref))
        assert [r["loss"] for r in rows if "step" in r] == pytest.approx(_one_process(ref), rel=2e-6), name


PP_PINS = {
    "pp2xcp2_gpipe_full": (REF, dict(pp=2, cp=2, dp=1, tp=1, recompute="full", schedule="gpipe")),
    "gpt_pp2xcp2_selective": ("gpt-tiny", dict(pp=2, cp=2, dp=1, tp=1, recompute="selective", schedule="1f1b")),
    # interleaved 1F1B: each rank 2 chunks of a 6-block GPT, each chunk's positions its rank's
    "gpt6_pp2xcp2_interleaved": ("tests.plans:gpt_tiny6", dict(pp=2, cp=2, dp=1, tp=1, recompute="none", zero_stage=0,
                                                               schedule="interleaved_1f1b", virtual_stages=2)),
    # a Hugging Face Llama cut into traced chunks: rotary tables and position ids cross the cut
    "hf_pp2xcp2_1f1b": (HF_LLAMA, dict(pp=2, cp=2, dp=1, tp=1, recompute="none", schedule="1f1b", zero_stage=0)),
}
BLOCKS = {"tests.plans:gpt_tiny6": 6}      # attention layers of the models above (else 2)

# Layouts whose path a layout above runs: out of the suite's 4-process job to keep the suite in
# its time budget (session 34), run by `python benchmarks/layout_matrix.py --context-parallel`
# ({name: (model, constraints)}; global batch 8, fp32, as above).
MATRIX_LAYOUTS = {
    # Hugging Face Llama's positions as `position_ids`: hf_cp4; cp x dp with the gather re-run
    # in a full recomputation: cp2xdp2_full
    "hf_cp2xdp2_full": (HF_LLAMA, dict(cp=2, dp=2, tp=1, pp=1, recompute="full", num_microbatches=2)),
    # cp x tp op by op on a rotary model with grouped KV heads: own_mistral_cp2xtp2, cp2xtp2_full_zero1
    "hf_cp2xtp2": (HF_LLAMA, dict(cp=2, dp=1, tp=2, pp=1, recompute="none", num_microbatches=2)),
    # a model's own positions' arange feeding rotary tables: own_mistral_cp2xtp2; cp x dp with
    # full recomputation: cp2xdp2_full
    "own_mistral_cp2xdp2_full": ("tests.hf_architectures:mistral",
                                 dict(cp=2, dp=2, tp=1, pp=1, recompute="full", num_microbatches=2)),
    "own_neox_cp4": ("tests.hf_architectures:neox", dict(cp=4, dp=1, tp=1, pp=1, recompute="none",
                                                         num_microbatches=2)),
    # the zoo Llama's chunks at a rank's tokens: pp2xcp2_gpipe_full; 1F1B with cp:
    # gpt_pp2xcp2_selective, hf_pp2xcp2_1f1b
    "pp2xcp2_1f1b": (REF, dict(pp=2, cp=2, dp=1, tp=1, recompute="none", schedule="1f1b", num_microbatches=2)),
}


def test_context_parallel_runs_in_pipeline_stages(launched):
    """Context parallelism inside pipeline stages (issue 13): the traced chunks are cut on a
    rank's tokens, their positions an op that reads the rank's when a chunk runs
    (`models.positions.traced_positions`), their fused attention and loss (aten ops) taken over
    as in the model's eager forward. pp2 x cp2 on 4 gloo processes: the zoo Llama under GPipe
    with full recomputation (the gather re-run; its 1F1B: `MATRIX_LAYOUTS`), the zoo GPT (positions read
    in its first chunk only, a tied embedding across the stages) under 1F1B with selective
    recomputation (the traced attention op re-run as the cp attention, gather included), a
    6-block GPT under interleaved 1F1B (2 chunks a rank) and a Hugging Face Llama under 1F1B:
    losses equal one process within 1e-4, every step's counted collectives (after the
    pipeline's first: torch.pipelining's shape handshake) the plan's."""
    plans, rows = {}, {}
    for name, (ref, pins) in PP_PINS.items():
        if ref.startswith("hf:"):
            pytest.importorskip("transformers")
        p, rows[name] = launched[name]
        assert (p.cp, p.pp) == (2, 2) and "cp_executor" not in p.search, (name, p.search)
        assert all(s.mesh_axis_names == ("dp", "cp", "tp") for s in p.stages)
        # per attention layer: 2 micro-batches x (K, V), again where the attention is recomputed
        again = 2 if pins["recompute"] != "none" else 1
        assert p.predicted.collectives["all_gather"] == 4 * BLOCKS.get(ref, 2) * again, (name, p.predicted)
        plans[name] = p
    for name, p in plans.items():
        ref = _one_process(PP_PINS[name][0])
        assert_ran_as_planned(name, rows[name], p, ref, first=1)
        # every rank's chunks placed at positions 0.. (the trace's arange baked in) moves the
        # Llama's losses by ~1.3e-5 (measured, rel.): 1e-4 would not see it; run right they
        # agree to ~1e-7
        assert [r["loss"] for r in rows[name] if "step" in r] == pytest.approx(ref, rel=2e-6), name


def test_context_parallel_runs_in_tensor_parallel_pipeline_stages(tmp_path):
    """cp in pipeline stages with tp (issue 13), run op by op as solved (issue 20: the
    executor's chunks cut from the program of a rank's tokens, each chunk's attention op the
    cp attention over its tp rank's heads): pp2 x cp2 x tp2 on 8 gloo processes, the zoo
    Llama under 1F1B with selective recomputation (the attention re-run, its gather included)
    and the zoo GPT under GPipe with full recomputation and ZeRO-3; and dp2 x cp2 x tp2 (the
    GPT, full recomputation). pp2 x cp2 x tp2 was refused while it hung: each stage's ranks
    alone flattened the size-1 dp axis with cp into a new process group, which is collective
    over the world (`runtime.meshes.StageMesh.flattens`). Losses equal one process within
    2e-6, every step's counted collectives (after a pipeline's first) the plan's (K and V
    gathered per layer and micro-batch, again in the recomputation, beside the solution's)."""
    p = shared_plan(REF, 8, global_batch_size=8, dtype="fp32",
                    constraints=Constraints(num_microbatches=2, pp=2, cp=2, tp=2, dp=1, recompute="selective"))
    assert (p.pp, p.cp, p.tp) == (2, 2, 2) and "cp_executor" not in p.search
    # run op by op as solved (issue 20): the exchange beside the solution's collectives
    assert all(s.op_layouts is not None for s in p.stages) and "tp_executor" not in p.search
    assert p.predicted.collectives["all_gather"] == 16 + solved_counts(p)["all_gather"]
    plans = {"pp2xcp2xtp2": (REF, p)}
    for name, pins in (("gpt_pp2xcp2xtp2_zero3", dict(pp=2, dp=1, recompute="full", schedule="gpipe", zero_stage=3)),
                       ("gpt_dp2xcp2xtp2_full", dict(pp=1, dp=2, recompute="full"))):
        q = shared_plan("gpt-tiny", 8, global_batch_size=8, dtype="fp32",
                        constraints=Constraints(num_microbatches=2, cp=2, tp=2, **pins))
        assert all(s.op_layouts is not None for s in q.stages) and "tp_executor" not in q.search, name
        plans[name] = ("gpt-tiny", q)
    rows = _run_in_one_job(tmp_path, {name: q for name, (_, q) in plans.items()}, 8)
    for name, (ref, q) in plans.items():
        assert_ran_as_planned(name, rows[name], q, _one_process(ref), first=1 if q.pp > 1 else 0)
        assert [r["loss"] for r in rows[name] if "step" in r] == pytest.approx(_one_process(ref), rel=2e-6), name


def test_a_rank_outside_a_dp_x_cp_x_tp_stage_makes_its_flattened_groups_as_its_ranks_do(monkeypatch):
    """A pipeline of dp2 x cp2 x tp2 stages (Llama 3 8B at 131072 tokens on 64 H100 plans dp2 cp4
    tp4 pp2): every rank makes each stage's flattened dp x cp gradient-sync groups (group
    creation is collective over the world), and the ranks of the other stage failed to build
    (torch's layout-based DeviceMesh: a rank outside a mesh cannot slice two of its three axes,
    "...it needs to contain the local rank"). On the fake process group of `autopar verify`:
    a rank outside the stage now makes the same groups, in the same order, as one inside it."""
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as dm
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.meshes import StageMesh

    made: list[list[int]] = []
    real = dm.new_group
    monkeypatch.setattr(dm, "new_group", lambda *a, **k: made.append(list(k["ranks"])) or real(*a, **k))
    names = ("dp", "cp", "tp")
    devices = tuple(range(8, 16))                  # the second stage of a 16-rank world
    seen = {}
    for rank in (0, 9):                            # outside the stage; inside it
        assert not dist.is_initialized()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=16)
        try:
            mesh = DeviceMesh("cpu", torch.tensor(devices).view(2, 2, 2), mesh_dim_names=names)
            sm = StageMesh(devices, mesh, names, names)
            assert sm.flattens(("dp", "cp"))
            made.clear()
            sub = sm.submesh(("dp", "cp"), member=rank in devices)
            seen[rank] = list(made)
            if rank in devices:
                assert sub is not None and sub.size() == 4 and rank in sub.mesh.tolist()
            else:
                assert sub is None
        finally:
            dist.destroy_process_group()
    assert seen[0] == seen[9] == [[8, 10, 12, 14], [9, 11, 13, 15]]
