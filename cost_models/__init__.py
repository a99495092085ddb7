"""Cost models shared by the ILP, the DP and the plan's predictions: compute, communication and
memory, and the profiler that measures a machine. Knows devices, links and op descriptions,
not the planner. What the software does (the attention kernel, element-wise fusion:
`SoftwareSpec`) comes in as an argument (`attention_kernel`, `fusion`), never from the device
profile, which describes hardware only.

- `cost_models.compute`: `op_time`, `op_backward_time`, `gemm_efficiency`, `backward_factor`,
  `attention_time`, `op_list_time` / `graph_compute_time` (training time of captured ops at a
  batch, with sharding and recomputation), `optimizer_step_time`, `grad_accumulation_time`.
- `cost_models.fusion`: element-wise chains priced as one kernel each, for software that fuses
  them (`SoftwareSpec.pointwise_fusion`: torch.compile, Megatron's fused bias-GELU).
- `cost_models.communication`: `collective_time` (alpha-beta), `link_collective_time` (measured
  tables first), `axis_collective_time` (a group of ranks on a cluster: in-node, rail, rail rings
  or hierarchical), `logical_mesh`, `mesh_axis_collective_time`.
- `cost_models.memory`: `model_state_bytes` (precision x ZeRO, the textbook split),
  `runtime_phases` (what autopar's runtime holds in each phase of a step: flat sync buffers,
  fp32 master gradients, FSDP's unsharded gradients, AdamW's temporaries), `activation_memory`
  (graph liveness, recompute none/selective/full, autocast by device type, the backward's
  transient), `inflight_microbatches`, `peak_memory`, `korthikanti_layer_bytes`.
- `cost_models.schedules`: the torch.pipelining schedule a plan runs (`torch_schedule`) and the
  what each rank holds at its peak moments, from torch's own action lists and runners: chunk
  micro-batches in flight, sends still referenced, gradients made (`held_moments`).
- `cost_models.profiler`: `profile_machine` (writes a profile YAML).
"""
