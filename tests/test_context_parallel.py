"""Context parallelism in the plan (issue 13): a "cp" mesh axis splitting every sequence, costed
and searched with dp, tp and pp; Llama 3 8B at 128K tokens on 8 and 64 H100 plans it."""

import contextlib
import json
from collections import Counter

import pytest
import torch
import torch.nn as nn

from autopar import ClusterSpec, Constraints, PlanError
from autopar.capture import capture
from autopar.models.configs import LlamaConfig
from autopar.models.init import meta_initialisers_skipped
from autopar.models.llama import Llama
from autopar.models.registry import ModelBundle, TokenBatch, TokenInputs
from autopar.planner import ProviderCache, plan
from autopar.schema.plan import PLAN_FORMAT_VERSION, Plan
from tests.captured import planned

SEQ = 131072


@pytest.fixture(scope="module")
def llama3_8b_128k():
    """Llama 3 8B (the zoo's llama3-8b) at a 131072-token sequence, on meta, and its capture."""
    cfg = LlamaConfig(vocab_size=128256, seq_len=SEQ, hidden=4096, layers=32, heads=32, kv_heads=8,
                      ffn_hidden=14336, rope_theta=500000.0)
    with torch.device("meta"), meta_initialisers_skipped():
        model = Llama(cfg)
    b = ModelBundle("llama3-8b-128k", model, TokenInputs(SEQ)(1), TokenBatch(cfg.vocab_size, SEQ))
    return b, capture(b.model, b.example_inputs, name=b.name)


def test_llama3_8b_at_128k_tokens_on_8_and_64_h100_plans_context_parallelism(llama3_8b_128k):
    """One node of 8 H100: without context parallelism only Megatron-SP on tp 8 with full
    recomputation fits (with SP off nothing fits: the least needs more than the usable memory);
    the free search takes cp > 1, faster, fitting, runnable by `autopar run` (every cp layout it
    searches, pipelined or not, with tp or not, is one the runtime executes). On 64 H100 too."""
    b, g = llama3_8b_128k
    one = ClusterSpec.load("dgx-h100", num_nodes=1)
    # the per-layer costs shared by the four plans (`ProviderCache`, as a sweep shares them: the
    # same plans, 30 -> 18 CPU s)
    pc = ProviderCache()
    with pytest.raises(PlanError, match="no plan fits in memory") as e:
        plan(b, one, global_batch_size=8, constraints=Constraints(cp=1, sequence_parallel=False), graph=g, providers=pc)
    assert e.value.min_memory_bytes > one.device.memory_bytes * 0.9
    p1 = plan(b, one, global_batch_size=8, constraints=Constraints(cp=1), graph=g, providers=pc)
    assert p1.tp == 8 and p1.sequence_parallel and p1.stages[0].recompute == "full"
    p = plan(b, one, global_batch_size=8, graph=g, providers=pc)
    # (since session 33 dp2 x cp4 under ZeRO-3 reducing every micro-batch, 0.7% faster than cp8 at ZeRO-1)
    assert p.cp > 1 and p.pp == 1 and "cp_executor" not in p.search
    assert p.predicted.peak_memory_bytes <= p.predicted.usable_memory_bytes
    assert p.predicted.iteration_time_s < p1.predicted.iteration_time_s
    # cp in pipeline stages is searched, with tp too (`tests/test_runtime_context_parallel.py`
    # runs pp2 x cp2 x tp2): no cp layout is left out as one the runtime does not execute
    assert "not executed by the runtime" not in p.search.get("skipped", "")
    assert p.stages[0].mesh_axis_names == ("dp", "cp", "tp") and p.stages[0].mesh_shape == (p.dp, p.cp, p.tp)
    # every layer's K and V gathered per micro-batch (again in its recomputation), their
    # gradients reduce-scattered
    m, L = p.num_microbatches, 32
    gathers = 4 if p.stages[0].recompute in ("full", "attention") else 2
    assert p.predicted.collectives["all_gather"] >= m * L * gathers
    assert p.predicted.collectives["reduce_scatter"] >= m * L * 2
    s = p.summary()
    assert f"cp={p.cp}" in s and f"context parallelism over {p.cp} ranks" in s
    many = plan(b, ClusterSpec.load("dgx-h100", num_nodes=8), global_batch_size=16, graph=g, providers=pc)
    assert many.cp > 1 and many.predicted.peak_memory_bytes <= many.predicted.usable_memory_bytes


def solved_counts(p) -> Counter:
    """The collectives a plan's stages run op by op as solved, per step (their `op_layouts`'
    per-micro-batch counts, every phase, times the micro-batches), as `planner.assemble` adds
    them to `predicted.collectives`."""
    out: Counter = Counter()
    for s in p.stages:
        for phase in ("forward", "backward", "grad_sync", "recompute"):
            out.update({k: p.num_microbatches * v for k, v in s.op_layouts.collectives.get(phase, {}).items()})
    return out


def test_a_cp_plan_round_trips_and_short_sequences_search_as_before(tmp_path):
    """A cp plan of a small Llama: its mesh (dp, cp, tp), placements per axis, format 11, the
    exchange's collectives; JSON round trip. A 16-token model's free search tries no cp (the
    same candidates as with cp pinned to 1); a mesh axis of an unknown kind is refused."""
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    p = planned("llama-tiny", cl, global_batch_size=8, dtype="fp32",
                constraints=Constraints(cp=2, dp=2, tp=1, pp=1, num_microbatches=2, recompute="none"))
    assert p.format_version == PLAN_FORMAT_VERSION >= 11 and (p.dp, p.cp, p.tp) == (2, 2, 1)
    st = p.stages[0]
    assert st.mesh_axis_names == ("dp", "cp", "tp") and all(len(pl) == 3 for pl in st.placements.values())
    # 2 layers x 2 micro-batches x (K, V); per micro-batch the loss's token count all-reduced
    # over cp; one gradient all-reduce over dp x cp
    assert p.predicted.collectives == {"all_gather": 8, "reduce_scatter": 8, "all_reduce": 2 + 1}
    assert Plan.from_json(p.to_json()) == p
    free = planned("llama-tiny", cl, global_batch_size=8, dtype="fp32", constraints=Constraints(num_microbatches=2))
    one = planned("llama-tiny", cl, global_batch_size=8, dtype="fp32",
                  constraints=Constraints(num_microbatches=2, cp=1))
    assert free.cp == 1 and free.search["candidates"] == one.search["candidates"]
    # with pipeline stages: executed (`inter_op.context_parallel.unexecuted_parts`), the
    # exchange per stage and micro-batch (each stage's layer: K and V gathered, their gradients
    # reduce-scattered), the loss's count on the last stage
    pp2 = planned("llama-tiny", cl, global_batch_size=8, dtype="fp32",
                  constraints=Constraints(cp=2, pp=2, tp=1, num_microbatches=2, recompute="none"))
    assert pp2.cp == 2 and pp2.pp == 2 and "cp_executor" not in pp2.search and "cp_executor" not in p.search
    assert pp2.predicted.collectives == {"all_gather": 8, "reduce_scatter": 8, "all_reduce": 2 + 2,
                                         "send_recv": 4}
    # with tensor parallelism too: planned and executed op by op as solved (issue 20: every
    # stage carries its layouts, no DTensor propagation), the exchange as without tp beside the
    # solution's collectives
    cl8 = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 8})
    tp2 = planned("llama-tiny", cl8, global_batch_size=8, dtype="fp32",
                  constraints=Constraints(cp=2, pp=2, tp=2, dp=1, num_microbatches=2, recompute="none"))
    assert "cp_executor" not in tp2.search and "tp_executor" not in tp2.search
    assert all(s.op_layouts is not None for s in tp2.stages)
    assert {k: tp2.predicted.collectives[k] for k in ("all_gather", "reduce_scatter", "send_recv")} == {
        "all_gather": 8 + solved_counts(tp2)["all_gather"], "reduce_scatter": 8 + solved_counts(tp2)["reduce_scatter"],
        "send_recv": 4}
    d = json.loads(p.to_json())
    d["stages"][0]["mesh_axis_names"] = ["dp", "sp", "tp"]
    with pytest.raises(PlanError, match="'sp' is not a mesh axis kind; one of dp, cp, tp"):
        Plan.from_json(json.dumps(d))


def test_cp_constraints_are_checked():
    """cp must be a power of two whose 2 cp chunks divide the sequence; a model whose attention
    is not one fused op (nanoGPT's eager softmax attention) cannot take it."""
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    with pytest.raises(PlanError, match="cp=3: pick a power of two"):
        planned("llama-tiny", ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 3}),
                global_batch_size=6, constraints=Constraints(cp=3))
    with pytest.raises(PlanError, match="no fused attention op"):
        planned("tests.user_models:eager_gpt", cl, global_batch_size=8, constraints=Constraints(cp=2))
    # dp x tp x pp holds the devices left over cp: the message names both counts
    with pytest.raises(PlanError, match=r"^dp=4 does not divide 2, the cluster's 4 devices over cp=2$"):
        planned("llama-tiny", cl, global_batch_size=8, constraints=Constraints(cp=2, dp=4))


class _FeatureAttention(nn.Module):
    """Causal fused attention over float features (batch, sequence, hidden) and the positions of
    `token_positions`: its sequence is no input's dim 1 of token ids."""

    def __init__(self, h: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.pos = nn.Embedding(16, h)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from autopar.models.positions import token_positions

        b, s, h = x.shape
        x = x + self.pos(token_positions(s, x.device))
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.mse_loss(self.out(o.transpose(1, 2).reshape(b, s, h)), y)


def test_cp_needs_the_sequence_of_token_ids_the_runtime_splits():
    """The runtime splits the sequence of the plan's tokens per sample (dim 1 of a first input
    of token ids): a model fed float features has 1 and its cp plan would be refused at the
    first step ("the sequence (1 tokens)"); the search neither plans a pinned cp for it nor
    tries one, and says why."""
    with torch.device("meta"):
        model = _FeatureAttention()
    x = torch.zeros(1, 16, 32, device="meta")
    b = ModelBundle("features", model, (x, x.clone()))
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    with pytest.raises(PlanError, match="cp=2: the model's first input is not a \\(batch, sequence\\) tensor of "
                                        "token ids of the attention's 16 tokens") as e:
        plan(b, cl, global_batch_size=4, dtype="fp32", constraints=Constraints(cp=2))
    assert e.value.constraint == "cp"
    p = plan(b, cl, global_batch_size=4, dtype="fp32")
    assert p.cp == 1 and "first input is not a (batch, sequence) tensor" in p.search["skipped"]


@pytest.mark.parametrize("ref,pins", [("llama-tiny", dict(cp=2, dp=1, tp=2, pp=1)),
                                      ("llama-tiny", dict(cp=4, dp=1, tp=1, pp=1, zero_stage=3)),
                                      ("llama-tiny", dict(cp=2, dp=1, tp=2, pp=2)),
                                      ("tests.hf_architectures:mistral", dict(cp=4, dp=1, tp=1, pp=1, zero_stage=3))])
def test_verify_steps_a_cp_plan(ref, pins):
    """`autopar verify` builds and steps every kind of rank of a cp2 x tp2 plan (run op by op
    as solved, in one stage and in pp2 chunks) and of a cp4 ZeRO-3 one (FSDP shards over the
    cp ranks) on a fake process group: shards as planned, the counted collectives (the
    exchange's included; the tp group's the solved layouts') the plan's, the tracked peak
    within its tolerance of the prediction. A Hugging Face Mistral wrapped by a user (its own
    positions: run as its traced program, `capture.own_positions`) under cp4 ZeRO-3 too, whose
    positions op reads nothing on fake tensors (its fake kernel runs)."""
    from autopar.runtime.verify import verify

    if ref.startswith("tests.hf_"):
        pytest.importorskip("transformers")
    n = pins["cp"] * pins["dp"] * pins["tp"] * pins["pp"]
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": n})
    p = planned(ref, cl, global_batch_size=8, dtype="fp32",
                constraints=Constraints(num_microbatches=2, recompute="full", **pins))
    r = verify(p, ref, jobs=1)
    assert r.ok, r.failures
    assert r.collectives_match is True
    assert all(rc.shard_mismatches == [] and rc.params_checked > 0 for rc in r.ranks)


def test_a_model_that_makes_its_own_positions_is_refused_under_cp():
    """Under context parallelism a rank's tokens are chunks from inside the sequence: a model
    that does not take their positions from `token_positions` (here a plain MLP, whose forward
    never asks) is refused after its first forward, not run with every chunk placed at 0."""
    import torch.nn as nn

    from autopar.runtime.context_parallel import ContextParallel

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    ContextParallel(None, 0, 2, 16).install(model)
    with pytest.raises(PlanError, match="must take its token positions from autopar.models.positions"):
        model(torch.zeros(1, 8, 8))


@pytest.mark.parametrize("gbs,late", [(8, False), (64, False), (8, True)])
def test_lazy_group_costing_covers_cp_groups(llama3_8b_128k, gbs, late, monkeypatch):
    """`Search._ordered(cps)` walks the cp > 1 groups with cp = 1's (a 128K sequence: both
    first, `context_degrees`): the search evaluates the same candidates in the same order,
    counts the same and picks the same plan as with every group costed up front
    (`candidates(cps)`). `late`: the sequence taken as short, cp > 1 walked only after
    nothing fits at cp = 1 (8 H100, no SP: `_run`'s second walk)."""
    from autopar.inter_op import context_parallel
    from autopar.inter_op.layers import build_layers
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import AnalyticProvider

    b, g = llama3_8b_128k
    layers = build_layers(g, b.model)
    cl = ClusterSpec.load("dgx-h100", num_nodes=1)

    def run(s: Search) -> tuple[list, object]:
        seen = []
        evaluate = s.evaluate

        def record(cand, tb, bar=float("inf")):
            seen.append(cand.key())
            return evaluate(cand, tb, bar)
        monkeypatch.setattr(s, "evaluate", record)
        return seen, s.run()

    def search() -> Search:
        return Search(g, layers, cl, gbs, "bf16", Constraints(), AnalyticProvider(g, layers, cl, "bf16"))

    if late:
        monkeypatch.setattr(context_parallel, "LONG_SEQUENCE", 10 * SEQ)
    lazy = search()
    first, then = lazy.context_degrees()
    assert (first, bool(then)) == ((1,), True) if late else len(first) > 1
    order, res = run(lazy)
    eager = search()
    monkeypatch.setattr(eager, "_ordered", lambda cps=(1,): iter(eager.candidates(cps)))
    order_all, res_all = run(eager)
    at = ("dp", "tp", "pp", "mb", "schedule", "v", "zero", "sp", "ep", "cp").index("cp")   # `Candidate.key`
    assert order == order_all and any(k[at] > 1 for k in order)
    assert lazy.considered == eager.considered and lazy.evaluated == eager.evaluated
    assert (res.best.key(), res.best.iteration_s) == (res_all.best.key(), res_all.best.iteration_s)
    assert lazy.skipped == eager.skipped
    if late:
        # the cp = 1 walk first (nothing it evaluates fits), then the cp > 1 one
        cps = [k[at] for k in order]
        assert res.best.cp > 1 and cps == sorted(cps, key=lambda c: c > 1) and cps[0] == 1


def _cp_attention(q, k, v, cp: int, is_causal: bool = True, saved: list | None = None, layers: int = 1):
    """Every rank of `cp` run in this process: its tokens of q, k, v ((batch, heads, seq, dim))
    attend through the runtime's cp mode over K and V "all-gathered" (every rank's local tensors
    concatenated in rank order: autograd's backward then sums each rank's gradient into every
    rank's tensor, what the reduce-scatter does). Returns the output in sequence order;
    `saved` collects what each rank's attention saves for its backward, per layer call."""
    from unittest import mock

    import torch.nn.functional as F

    from autopar.runtime import context_parallel as rcp

    s = q.shape[2]
    ranks = [rcp.ContextParallel(None, r, cp, s) for r in range(cp)]

    def local(x, c):
        return c.local_tokens(x.transpose(1, 2)).transpose(1, 2).contiguous()

    ks, vs = [local(k, c) for c in ranks], [local(v, c) for c in ranks]
    every = {id(t): ks for t in ks} | {id(t): vs for t in vs}

    def gather(x, gather_dim, group):
        return torch.cat(every[id(x)], dim=gather_dim)

    outs = []
    with mock.patch.object(rcp, "all_gather_single_autograd", gather):
        for c in ranks:
            with c.active(), rcp._CPAttention(c):
                for _ in range(layers):
                    got: list = []
                    with torch.autograd.graph.saved_tensors_hooks(lambda t, got=got: got.append(t) or t, lambda t: t):
                        o = F.scaled_dot_product_attention(local(q, c), ks[c.rank], vs[c.rank], is_causal=is_causal)
                    if saved is not None:
                        saved.append((c.rank, got))
            outs.append(o)
    where = torch.cat([c.positions for c in ranks]).argsort()
    return torch.cat(outs, dim=2)[:, :, where]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("is_causal", [True, False])
def test_cp_attention_equals_one_process_attention(cp, is_causal):
    """The runtime's cp attention (causal: each rank's two query chunks against the keys up to
    their ends, bottom-right causal; unmasked: against all keys) gives one process's attention
    over the whole sequence, forward and gradients of q, k, v, in fp32 within 1e-5."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=g, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    dout = torch.randn(ref.shape, generator=g)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    out = _cp_attention(q, k, v, cp, is_causal)
    got = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_cp_attention_saves_no_mask_of_the_rank_queries_by_the_sequence():
    """Under cp, a causal attention saves for its backward no (S/cp) x S mask (nor anything of
    that many elements): only the rank's queries, the sequence-ordered K and V, its outputs and
    log-sum-exps, and on CPU the two bottom-right masks of its chunk calls, (S/2cp) x (i+1)S/2cp
    and (S/2cp) x (2cp-i)S/2cp, shared by every layer's call (the fused CUDA kernels take none).
    A call with a `CausalBias` (how the runtime asks for the bottom-right mask off CPU) passes
    through the cp mode as it is, and gives the same attention."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from autopar.runtime.context_parallel import ContextParallel, _CPAttention

    s, cp = 64, 4
    c = s // (2 * cp)
    q, k, v = (torch.randn(1, 1, s, 2, requires_grad=True) for _ in range(3))
    saved: list = []
    _cp_attention(q, k, v, cp, saved=saved, layers=2)
    for rank, got in saved:
        assert all(t.numel() < (s // cp) * s for t in got), [tuple(t.shape) for t in got]
        masks = sorted(tuple(t.shape) for t in got if t.dim() == 2)
        want = sorted({(c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)} - {(c, c)})
        assert masks == want
    for rank in range(cp):
        layer1, layer2 = [{t.untyped_storage().data_ptr() for t in got if t.dim() == 2}
                          for r, got in saved if r == rank]
        assert layer1 == layer2
    # off CPU the chunk calls pass a CausalBias: the mode runs them as they are
    qq, kk, vv = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 24, 4), torch.randn(1, 2, 24, 4)
    with _CPAttention(ContextParallel(None, 0, 2, 16)):
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal_lower_right(8, 24))
    mask = ContextParallel(None, 0, 2, 16).causal_mask(8, 24, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask))


class _TokenMixer(nn.Module):
    """A causal fused-attention LM that reads `token_positions`, with one token-mixing op of
    `kind` between its attention and its loss: `cumsum` (a running sum over the sequence),
    `conv` (a convolution along it), `pool` (a mean over tokens), `shift` (the targets shifted
    inside the model), or `none`."""

    def __init__(self, kind: str, vocab: int = 64, seq: int = 16, h: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.emb, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.qkv, self.out, self.head = nn.Linear(h, 3 * h), nn.Linear(h, h), nn.Linear(h, vocab)
        self.conv = nn.Conv1d(h, h, 3, padding=1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from autopar.models.positions import token_positions

        b, s = idx.shape
        x = self.emb(idx) + self.pos(token_positions(s, idx.device))
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        if self.kind == "cumsum":
            x = x.cumsum(1) / torch.arange(1, s + 1, device=x.device).view(1, s, 1)
        elif self.kind == "conv":
            x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "pool":
            return F.cross_entropy(self.head(x.mean(1)), targets[:, 0])
        logits = self.head(x)
        if self.kind == "shift":
            logits, targets = logits[:, :-1], targets[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mixer(kind: str) -> ModelBundle:
    with torch.device("meta"):
        model = _TokenMixer(kind)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    return ModelBundle(f"mixer-{kind}", model, (ids, ids.clone()), TokenBatch(64, 16))


@pytest.mark.parametrize("kind,why", [
    ("cumsum", r"cumsum \(cumsum\) mixes tokens along the sequence"),
    ("conv", r"conv1d \(conv1d in conv\) mixes tokens along the sequence"),
    ("pool", r"\(mean\) mixes tokens along the sequence"),
    ("shift", r"\(slice\) mixes tokens along the sequence"),
])
def test_a_model_that_mixes_tokens_outside_attention_gets_no_cp_plan(kind, why):
    """An op other than the fused attention that mixes tokens along the sequence (a running
    sum, a convolution or pooling over tokens, targets shifted inside the model) would compute
    wrong on a rank's chunks: the free search records why it left cp out (`autopar show`
    prints it) and plans none; `Constraints(cp=2)` is a PlanError naming the op and the fix.
    The same model without it plans cp=2."""
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    b = _mixer(kind)
    with pytest.raises(PlanError, match="cp=2: .*" + why) as e:
        plan(b, cl, global_batch_size=4, dtype="fp32", constraints=Constraints(cp=2))
    assert e.value.constraint == "cp"
    p = plan(b, cl, global_batch_size=4, dtype="fp32")
    assert p.cp == 1 and "mixes tokens along the sequence" in p.search["skipped"]
    assert "mixes tokens along the sequence" in p.summary()
    ok = plan(_mixer("none"), cl, global_batch_size=4, dtype="fp32", constraints=Constraints(cp=2))
    assert ok.cp == 2


def test_a_model_that_makes_its_own_positions_takes_cp_where_they_follow_the_sequence():
    """nanoGPT makes its own `torch.arange` of positions (tests/user_models.py): the capture
    records that the forward never asked `token_positions` (`OpGraph.reads_positions`) and
    finds that arange, of the sequence's length at two lengths, as the positions
    (`OpGraph.own_positions`, `capture.own_positions`): a cp plan (run in
    tests/test_runtime_context_parallel.py). A model whose own aranges follow the sequence
    otherwise (positions 1 .. t) gets none: the free search plans no cp and says why; a pinned
    cp is a PlanError naming the op. Never a plan that `autopar run` refuses."""
    from autopar.capture import capture
    from autopar.models.registry import ModelBundle, build_model, token_batch
    from tests.test_own_positions import OwnPositions

    b = build_model("tests.user_models:nanogpt")
    g = capture(b.model, b.example_inputs)
    assert g.reads_positions is False and g.own_positions == ""
    assert capture(build_model("llama-tiny").model, build_model("llama-tiny").example_inputs).reads_positions
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    p = plan("tests.user_models:nanogpt", cl, global_batch_size=4, constraints=Constraints(cp=2), graph=g)
    assert p.cp == 2 and "cp_executor" not in p.search
    ids = torch.zeros(1, 16, dtype=torch.long)
    off = ModelBundle("off_by_one", OwnPositions(start=1), (ids, ids), token_batch(32, 16))
    with pytest.raises(PlanError, match="cp=2: the model does not take its token positions from "
                                        "autopar.models.positions.token_positions and its own cannot be set .*"
                                        "arange whose length follows the sequence"):
        plan(off, cl, global_batch_size=4, constraints=Constraints(cp=2))
    p = plan(off, cl, global_batch_size=4)
    assert p.cp == 1 and "arange whose length follows the sequence" in p.search["skipped"]


_HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
             "&num_attention_heads=4&seq_len=16&vocab_size=128")


def test_hugging_face_causal_lms_take_cp_and_others_say_why():
    """A Hugging Face causal LM by `hf:` reads its positions from `token_positions` (passed as
    `position_ids`) and takes next-token targets from the batch: a cp plan, whose rank's rotary
    embedding gets its chunks' positions in the whole sequence (run in
    tests/test_runtime_context_parallel.py). GPT-2 with its default attention dropout and BERT
    (dropout too) are refused with the reason; a transformers model given as it is (labels
    shifted inside it, its own positions) takes cp too (found at capture)."""
    pytest.importorskip("transformers")
    from autopar.models.hf import build_hf
    from autopar.models.positions import positions_set
    from autopar.runtime.context_parallel import chunk_positions

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    p = planned(_HF_LLAMA, cl, global_batch_size=4, dtype="fp32", constraints=Constraints(cp=2))
    assert p.cp == 2 and "cp_executor" not in p.search
    with pytest.raises(PlanError, match="cp=2: .*applies dropout to its attention weights"):
        planned("hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=128&seq_len=16", cl,
                global_batch_size=4, dtype="fp32", constraints=Constraints(cp=2))
    # the rank's positions reach the rotary embedding
    b = build_hf(_HF_LLAMA[3:], device="cpu")
    seen = []
    b.model.model.rotary_emb.register_forward_hook(
        lambda m, args, kw, out: seen.append(kw.get("position_ids", args[-1])), with_kwargs=True)
    pos = chunk_positions(1, 2, 16)
    ids, tgt = b.batch_fn(0, 2, 0)
    assert torch.equal(tgt[:, :-1], ids[:, 1:]) and (tgt[:, -1] == -100).all()
    with positions_set(pos):
        b.model(ids[:, pos], tgt[:, pos])
    assert torch.equal(seen[-1].reshape(-1), pos)
    # transformers' own forward, labels = ids (shifted inside: a pad and a slice along the
    # sequence), no position ids
    import transformers

    from autopar.capture import capture
    from autopar.inter_op.context_parallel import blockers
    from autopar.inter_op.layers import build_layers
    from autopar.models.hf import make_config, parse_ref

    name, over = parse_ref(_HF_LLAMA[3:])
    cfg = make_config(name, **over)[1]
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        raw = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    g = capture(raw, {"input_ids": ids, "labels": ids})
    # found: its positions' arange (made the rank's by the runtime) and its labels' shift (done
    # on the whole sequence before the split): a cp plan (`capture.own_positions`)
    assert g.reads_positions is False and g.own_positions == ""
    assert blockers(g, build_layers(g, raw)) == ""


def test_cp_gathers_the_kv_heads_the_plan_prices():
    """The zoo Llama's grouped-query attention runs inside the kernel (`enable_gqa`), so cp
    all-gathers K and V with their kv_heads (llama-tiny: 2 of 4 heads), not repeated to every
    query head: the bytes one rank all-gathers in a micro-batch's forward, counted where the
    collectives run (the runtime's counting mode, rank 0 of a fake 2-rank group), equal the cost
    model's exchange (`kv_bytes` of every layer at the plan's micro-batch), as many gathers as
    the plan predicts, and half of what K and V repeated to 4 heads would be."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.capture import capture
    from autopar.inter_op import context_parallel
    from autopar.inter_op.layers import build_layers
    from autopar.models.registry import build_model
    from autopar.runtime.context_parallel import ContextParallel
    from autopar.runtime.counting import _KIND, _NAMESPACES, CollectiveCounter

    class Bytes(CollectiveCounter):
        gathered = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func.namespace in _NAMESPACES and _KIND.get(func._opname) == "all_gather":
                self.gathered += out.numel() * out.element_size()
            return out

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    p = planned("llama-tiny", cl, global_batch_size=4, dtype="fp32",
                constraints=Constraints(cp=2, dp=1, tp=1, pp=1, num_microbatches=2, recompute="none"))
    b = build_model("llama-tiny")
    g = capture(b.model, b.example_inputs)
    layers = build_layers(g, b.model)
    mb = p.microbatch_size
    predicted = sum(context_parallel.kv_bytes(g, lay, mb, "fp32") for lay in layers)
    cfg = b.model.layers[0].attn
    assert (cfg.heads, cfg.kv_heads) == (4, 2)

    model = build_model("llama-tiny", device="cpu").model
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cp = ContextParallel(dist.group.WORLD, 0, 2, 16)
        cp.install(model)
        tokens, targets = (cp.local_tokens(x) for x in TokenBatch(128, 16)(0, mb))
        counter = Bytes()
        with cp.active(), counter:
            loss = model(tokens, targets)
        assert counter.gathered == predicted > 0
        assert counter.local_counts()["all_gather"] == p.predicted.collectives["all_gather"] // p.num_microbatches
        # K and V of every layer: (mb, kv_heads, 16, head_dim) each, fp32
        assert predicted == len(model.layers) * 2 * mb * cfg.kv_heads * 16 * cfg.head_dim * 4
        loss.backward()
    finally:
        dist.destroy_process_group()


def test_cp_x_tp_plans_carry_their_op_layouts():
    """Issue 20: a cp x tp stage runs op by op as solved (`search.op_by_op`), in one stage and
    in a pipeline: every stage carries its per-op layouts, `plan.search` records no
    `tp_executor` fallback, and the predicted collectives are cp's exchange
    (`inter_op.context_parallel.collectives`) beside the solution's. The plans validate
    (`validate_plan`, which `autopar run` and `autopar verify` call)."""
    from autopar.models.registry import build_model
    from autopar.runtime.engine import validate_plan

    model = build_model("llama-tiny").model
    for n, pins in ((4, dict(pp=1, recompute="selective")), (8, dict(pp=2, recompute="none"))):
        cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": n})
        p = planned("llama-tiny", cl, global_batch_size=8, dtype="fp32",
                    constraints=Constraints(cp=2, tp=2, dp=1, num_microbatches=2, **pins))
        assert (p.cp, p.tp, p.pp) == (2, 2, pins["pp"])
        assert all(s.op_layouts is not None for s in p.stages)
        assert "tp_executor" not in p.search and "cp_executor" not in p.search and "tp_counts_fallback" not in p.search
        validate_plan(p, model)
        # K and V gathered per layer and micro-batch (again under selective recomputation),
        # their gradients reduce-scattered; the solution's collectives beside them
        again = 2 if pins["recompute"] != "none" else 1
        solved = solved_counts(p)
        assert p.predicted.collectives["all_gather"] == 8 * again + solved["all_gather"]
        assert p.predicted.collectives["reduce_scatter"] == 8 + solved["reduce_scatter"]


def test_the_ranks_own_keys_and_values_stay_where_the_query_keeps_their_storage():
    """Under cp the attention saves the gathered K and V; the rank's own K and V are freed unless
    a saved tensor shares their storage: a fused qkv projection's output, of which the saved query
    is a view (the zoo GPT), keeps them; separate projections (Llama, a GPT written with separate
    q/k/v) do not (`kept_kv_bytes`; pinned against torch in tests/test_memory_harness.py `cp2`)."""
    from autopar.capture import capture
    from autopar.inter_op import context_parallel as cpm
    from autopar.inter_op.layers import build_layers
    from autopar.models import build_model

    for ref, kept in (("gpt-tiny", True), ("llama-tiny", False), ("tests.user_models:separate_gpt", False)):
        b = build_model(ref)
        g = capture(b.model, b.example_inputs)
        lay = next(lay for lay in build_layers(g) if cpm.attention_nodes(g, lay))
        kv = cpm.kv_bytes(g, lay, 4, "bf16")
        assert kv > 0 and cpm.kept_kv_bytes(g, lay, 4, "bf16") == (kv if kept else 0.0), ref


def test_a_gpu_plans_cp_rank_holds_no_causal_mask_under_verify():
    """`autopar verify` of a GPU plan runs CUDA's program on CPU fake tensors: CUDA's flash
    kernel takes cp's bottom-right causal mask without a tensor, so the rank holds none (CPU's
    (S / 2 cp) x S additive mask held 2 GiB more than predicted on Llama 3 8B at 131072 tokens
    on cp 8, 4 GiB on dp2 cp4 tp4 pp2); the CPU program (`autopar run` on gloo) still makes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.runtime.context_parallel import ContextParallel, _CPAttention
    from autopar.runtime.cuda_program import cuda_program

    for as_cuda in (True, False):
        cp = ContextParallel(None, 0, 2, 16)
        with FakeTensorMode():
            q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
            k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(2))
            with cuda_program() if as_cuda else contextlib.nullcontext():
                out = _CPAttention(cp)._causal_lower_right(q, k, v)
        assert out.shape == q.shape
        assert (len(cp._masks) == 0) is as_cuda
