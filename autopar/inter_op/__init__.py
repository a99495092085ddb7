"""Inter-operator parallelism (Alpa §5): layers, the stage-slicing DP and the joint plan search.

- `layers`: the model's layers (repeated blocks, or FLOP-balanced clusters of ops, Alpa eq. 6);
- `stage_cost`: per-layer costs on a tensor-parallel mesh (analytic Megatron rules, or the
  intra-op ILP), memory of a stage under a schedule;
- `dp`: Alpa's DP over layer ranges x sub-meshes, with brute force for checking;
- `search`: the joint search over dp/tp/pp, micro-batching, schedule, recomputation and ZeRO.
"""

from autopar.inter_op.dp import DPResult, brute_force, stage_dp
from autopar.inter_op.layers import Layer, build_layers

__all__ = ["Layer", "build_layers", "DPResult", "stage_dp", "brute_force"]
