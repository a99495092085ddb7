"""Predicted vs tracked peak memory (`autopar verify`, fake tensors, no processes) of the
memory model's over-prediction cases (README, "Memory ... under ZeRO-3"): per rank kind the
error (predicted - tracked) / tracked and both peaks by category.

    python benchmarks/verify_memory_cases.py [CASE ...]      # default: every case

Cases (fp32, global batch 8, the ILP's layouts on the CPU profile unless said):
  z3none   gpt-tiny dp2 x tp2 ZeRO-3, no recomputation, 2 micro-batches
  z1full   gpt-tiny dp2 x tp2 ZeRO-1, full recomputation, 2 micro-batches
  gptpp    gpt-tiny pp2 x dp2 x tp2 ZeRO-3, 1F1B, 2 micro-batches
  nanogpt  nanoGPT (tests.user_models) pp2 x dp2 x tp2 ZeRO-3, GPipe, 2 micro-batches
  llama    tiny HF Llama pp2 x dp2 x tp2 ZeRO-3, interleaved 1F1B (v 2), 2 micro-batches
  gptan    gptpp by the analytic rules (`intra_op="analytic"`: DTensor propagation)
  nanoan   nanogpt by the analytic rules
  widenano nanoGPT over 4096 tokens (tests.user_models:wide_nanogpt) pp2 x dp2 ZeRO-3, 1F1B, 4 micro-batches
  widenano1  the same with 1 micro-batch
  mixtral  tiny HF Mixtral dp2 x ep2 x pp2 ZeRO-1, norm_act, 1F1B, 4 micro-batches, bf16 on
           the H100 profile, global batch 32 (tests/test_moe.py's)

About 4 minutes in all on 2 loaded cores (Mixtral's 1.5).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
            "&num_attention_heads=4&seq_len=16&vocab_size=128")
NANOGPT = "tests.user_models:nanogpt"
WIDE_NANOGPT = "tests.user_models:wide_nanogpt"
MIXTRAL = ("hf:mixtral?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_local_experts=4"
           "&num_hidden_layers=4&num_attention_heads=4&seq_len=256&vocab_size=128")
CASES = ("z3none", "z1full", "gptpp", "nanogpt", "llama", "gptan", "nanoan", "widenano", "widenano1", "mixtral")


def case(name: str):
    """(model reference, plan) of case `name`."""
    import autopar
    from autopar.planner import plan
    from autopar.schema import ClusterSpec, Constraints

    def cpu(n: int):
        return ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})

    def tiny(ref: str, n: int, intra_op: str = "ilp", **cons):
        return ref, plan(ref, cpu(n), global_batch_size=8, dtype="fp32", intra_op=intra_op, cache=False,
                         constraints=Constraints(**cons))

    pipe = dict(dp=2, tp=2, pp=2, zero_stage=3, num_microbatches=2)
    if name == "z3none":
        return tiny("gpt-tiny", 4, dp=2, tp=2, pp=1, zero_stage=3, num_microbatches=2, sequence_parallel=False,
                    recompute="none")
    if name == "z1full":
        return tiny("gpt-tiny", 4, dp=2, tp=2, pp=1, zero_stage=1, num_microbatches=2, sequence_parallel=False,
                    recompute="full")
    if name == "gptpp":
        return tiny("gpt-tiny", 8, **pipe, sequence_parallel=False, schedule="1f1b")
    if name == "nanogpt":
        return tiny(NANOGPT, 8, **pipe, schedule="gpipe")
    if name == "llama":
        return tiny(HF_LLAMA, 8, **pipe, schedule="interleaved_1f1b", virtual_stages=2)
    if name == "gptan":
        return tiny("gpt-tiny", 8, "analytic", **pipe, schedule="1f1b")
    if name == "nanoan":
        return tiny(NANOGPT, 8, "analytic", **pipe, schedule="gpipe")
    if name in ("widenano", "widenano1"):
        return tiny(WIDE_NANOGPT, 4, dp=2, tp=1, pp=2, zero_stage=3, schedule="1f1b",
                    num_microbatches=4 if name == "widenano" else 1)
    if name == "mixtral":
        cluster = ClusterSpec.load("dgx-h100", num_nodes=1).model_copy(update={"devices_per_node": 4})
        return MIXTRAL, autopar.plan(MIXTRAL, cluster, global_batch_size=32, cache=False,
                                     constraints=Constraints(dp=2, tp=1, pp=2, ep=2, recompute="norm_act",
                                                             zero_stage=1, schedule="1f1b", num_microbatches=4))
    raise SystemExit(f"unknown case {name!r}; one of {', '.join(CASES)}")


def main(names: list[str]) -> None:
    from autopar.runtime.verify import verify

    for name in names or CASES:
        t0 = time.time()
        ref, p = case(name)
        for rc in verify(p, ref, jobs=1).ranks:
            print(f"{name:8s} rank {rc.rank} stages {rc.stages}: {rc.memory_error:+.2%} "
                  f"(predicted {rc.predicted_peak_bytes:.0f} B, tracked {rc.tracked_peak_bytes:.0f} B)", flush=True)
            print(f"{'':8s}   tracked   {rc.tracked_categories}", flush=True)
            print(f"{'':8s}   predicted {rc.predicted_categories}", flush=True)
        print(f"{name:8s} {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
