"""One model written several ways gets one plan and one prediction (issue 20).

    python benchmarks/equivalent_models.py [--only SUBSTRING] [--no-free]

The same GPT written three ways, planned with `autopar.plan` (bf16, the bundled `dgx-a100-80g`
profile):

* `zoo`: autopar's GPT: one fused qkv `nn.Linear` whose output is viewed head-major (Megatron's
  own layout), a tied `nn.Linear` head;
* `nanogpt`: `tests.user_models.NanoGPT`: a fused qkv `nn.Linear` whose output is split into
  [q; k; v] blocks, the head computed as `x @ wte.weight.t()`;
* `separate`: `tests.user_models.SeparateGPT`: separate q, k and v projections, an
  `nn.Linear` head tied to the embedding;

and Hugging Face's GPT-2 (`hf:gpt2`, Conv1D projections, dropout off so that the models are
the same, vocabulary padded to 50304) against the zoo's GPT-2 small. Hugging Face's GPT-2 is
not op for op the zoo's: its `gelu_new` runs as eight elementwise kernels in eager mode (pow,
tanh, four muls, two adds) where the zoo's GELU is one: a real cost of running it eagerly
(`autopar run`), which the default software's prediction includes. Under software that fuses
element-wise chains (`torch-compile-2025`: torch.compile, `SoftwareSpec.pointwise_fusion`)
the eight run as one kernel, and the two GPT-2s are predicted alike. Each pinned to Megatron's layout for the case and
planned freely; the table gives each prediction and its difference from the zoo model's
(target: within 3%). 22B on 8 A100 is Megatron's t=8, micro-batch 4, full recomputation;
39.1B on 512 A100 its t=8, p=2, micro-batch 1 (Narayanan et al. 2021). Takes several minutes on
2 cores (the free searches of 39.1B are the longest).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.models.gpt import GPT, GPTConfig  # noqa: E402
from autopar.planner import plan  # noqa: E402
from tests.user_models import NanoGPT, SeparateGPT  # noqa: E402

V, S = 51200, 2048


def _tokens(seq: int) -> tuple:
    x = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return (x, x)


def _gpt(kind: str, h: int, layers: int, heads: int) -> tuple[Any, tuple]:
    """(model on meta, example inputs) of the GPT of this size written as `kind`."""
    with torch.device("meta"):
        if kind == "zoo":
            return GPT(GPTConfig(vocab_size=V, seq_len=S, hidden=h, layers=layers, heads=heads)), _tokens(S)
        cls = NanoGPT if kind == "nanogpt" else SeparateGPT
        return cls(layers, V, S, h, heads), _tokens(S)


# GPT-2 small with its vocabulary padded to a multiple of 64 (50304, as nanoGPT pads it), so
# that tensor parallelism can split it
GPT2_VOCAB = 50304


def _zoo_gpt2() -> tuple[Any, tuple]:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=GPT2_VOCAB, seq_len=1024, hidden=768, layers=12, heads=12)), _tokens(1024)


def _hf_gpt2() -> str:
    return f"hf:gpt2?vocab_size={GPT2_VOCAB}&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0"


# the software of the fused GPT-2 rows: torch.compile fuses element-wise chains (`gelu_new`'s
# eight ops run as one kernel, as the zoo's GELU is one), `SoftwareSpec.pointwise_fusion`
FUSED = "torch-compile-2025"

CASES: list[tuple[str, str, int, int, Any, list[tuple[str, Callable[[], Any]]], Optional[str]]] = [
    # (case, cluster, nodes, global batch, Megatron's layout, [(way, model factory)], software;
    # None: the default, what `autopar run` executes)
    ("22B (h=6144, l=48)", "dgx-a100-80g", 1, 4,
     autopar.Constraints(tp=8, pp=1, dp=1, microbatch_size=4, recompute="full", sequence_parallel=False),
     [(k, lambda k=k: _gpt(k, 6144, 48, 64)) for k in ("zoo", "nanogpt", "separate")], None),
    ("39.1B (h=8192, l=48)", "dgx-a100-80g", 64, 1536,
     autopar.Constraints(tp=8, pp=2, dp=32, microbatch_size=1, sequence_parallel=False),
     [(k, lambda k=k: _gpt(k, 8192, 48, 64)) for k in ("zoo", "nanogpt", "separate")], None),
    ("GPT-2 small (124M)", "dgx-a100-80g", 1, 64,
     autopar.Constraints(tp=4, pp=1, dp=2, sequence_parallel=False),
     [("zoo", _zoo_gpt2), ("hf", _hf_gpt2)], None),
    (f"GPT-2 small (124M), {FUSED}", "dgx-a100-80g", 1, 64,
     autopar.Constraints(tp=4, pp=1, dp=2, sequence_parallel=False),
     [("zoo", _zoo_gpt2), ("hf", _hf_gpt2)], FUSED),
]


def _plan(model: Any, cluster: autopar.ClusterSpec, gbs: int, cons: Optional[autopar.Constraints],
          software: Optional[str] = None) -> Any:
    if isinstance(model, tuple):
        return plan(model[0], cluster, model[1], global_batch_size=gbs, dtype="bf16", constraints=cons,
                    software=software)
    return plan(model, cluster, global_batch_size=gbs, dtype="bf16", constraints=cons, software=software)


def _layout(p: Any) -> str:
    out = f"dp{p.dp} tp{p.tp} pp{p.pp}, mb {p.microbatch_size}"
    if p.pp > 1:
        out += f", {p.schedule}" + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
    rc = p.stages[0].recompute
    return out + (f", {rc} recompute" if rc != "none" else "") + (f", ZeRO-{p.zero_stage}" if p.zero_stage else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="the cases whose name contains this")
    ap.add_argument("--no-free", action="store_true", help="only the pinned layouts")
    a = ap.parse_args()
    rows = []
    misses = 0
    for case, cl_name, nodes, gbs, pinned, ways, software in CASES:
        if a.only not in case:
            continue
        cluster = autopar.ClusterSpec.load(cl_name, num_nodes=nodes)
        ref: dict[str, float] = {}
        for way, make in ways:
            model = make()
            for mode, cons in (("pinned", pinned), ("free", None)):
                if mode == "free" and a.no_free:
                    continue
                t0 = time.perf_counter()
                try:
                    p = _plan(model, cluster, gbs, cons, software)
                except autopar.PlanError as e:
                    rows.append((case, way, mode, "no plan", "", str(e)[:80], time.perf_counter() - t0))
                    misses += 1
                    continue
                t = p.predicted.iteration_time_s
                ref.setdefault(mode, t)
                diff = (t - ref[mode]) / ref[mode]
                misses += abs(diff) > 0.03
                rows.append((case, way, mode, f"{t:.3f}", f"{diff:+.1%}", _layout(p), time.perf_counter() - t0))
                print(f"{case} {way} {mode}: {t:.3f} s ({diff:+.1%}) {_layout(p)}", file=sys.stderr, flush=True)
    print("| case | written as | layout | predicted s | vs zoo | plan | search s |")
    print("|---|---|---|---|---|---|---|")
    for case, way, mode, t, diff, lay, s in rows:
        print(f"| {case} | {way} | {mode} | {t} | {diff} | {lay} | {s:.0f} |")
    print(f"\n{len(rows)} plans; {misses} off the zoo model's prediction by more than 3% (or no plan)")


if __name__ == "__main__":
    main()
