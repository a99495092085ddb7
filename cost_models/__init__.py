"""Cost models shared by the ILP, the DP and the plan's predictions: compute, communication and
memory, and the profiler that measures a machine. Knows devices, links and op descriptions,
not the planner.

- `cost_models.compute`: `op_time`, `op_backward_time`, `gemm_efficiency`, `backward_factor`,
  `attention_time`, `op_list_time` / `graph_compute_time` (training time of captured ops at a
  batch, with sharding and recomputation), `optimizer_step_time`, `grad_accumulation_time`.
- `cost_models.communication`: `collective_time` (alpha-beta), `link_collective_time` (measured
  tables first), `axis_collective_time` (a group of ranks on a cluster: in-node, rail, rail rings
  or hierarchical), `logical_mesh`, `mesh_axis_collective_time`.
- `cost_models.memory`: `model_state_bytes` (precision x ZeRO), `activation_memory` (graph
  liveness, recompute none/selective/full), `inflight_microbatches`, `peak_memory`,
  `korthikanti_layer_bytes`.
- `cost_models.profiler`: `profile_machine` (writes a profile YAML).
"""
