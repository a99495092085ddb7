"""Pipeline stages whose neighbours have other tensor-parallel degrees (Alpa's free sub-mesh per
stage: e.g. stage 0 on 1 device, stage 1 on 2 devices with tp 2).

At a stage boundary the activation is a plain tensor, replicated over the sending stage's tp
ranks (a chunk run as solved redistributes what it sends to replicated,
`intra_op.pipeline_chunks.ProgramChunk.handover`), and so is the input gradient a
tp stage hands back (the gradient of a Replicate input is all-reduced before it leaves the
stage). So any
rank of a stage can stand for the whole stage. Within one data-parallel replica, stage s holds
T_s ranks (`ranks[s]`, in tp order); every rank of a stage runs the same torch.pipelining
schedule in lockstep, and

* rank k of stage s receives from rank k mod T_p of its neighbour p (`recv_peer`), in either
  direction (activation from s - 1, gradient from s + 1);
* rank c of stage s therefore sends to every rank k of the neighbour with k mod T_s == c
  (`send_peers`): with T_p <= T_s one rank or none, with T_p > T_s T_p / T_s of them.

Each rank receives each transfer exactly once; with equal tp degrees it is torch's own
rank-to-rank pipeline. `FanoutPipelineStage` is torch's `PipelineStage` with that peer mapping:
every point-to-point op the schedule, its warm-up vote and the metadata exchange issue goes
through `recv_peer` / `send_peers`, so every send has exactly one matching receive.

Receive buffers, just in time (`JustInTimeStage`, the base of every stage the runtime builds).
torch's `PipelineStage` allocates, when its schedule first runs, a receive buffer for every
micro-batch: the activation it receives (`_setup_forward_recv_info`) and the gradient of its
output (`_create_grad_recv_info`), m of each per chunk, kept for the whole step and between
steps. At scale that is prohibitive (GPT-3 175B as NVIDIA ran it, PP 8 with 12 chunks per GPU
and 64 micro-batches: 64 x 12 x 2 buffers of 12.5 MB per GPU, about 19 GB). Megatron-LM makes
each receive tensor when it posts the receive (`p2p_communication._communicate`) and drops it
when the schedule is done with it, so a rank holds buffers for the micro-batches in flight
only. `JustInTimeStage` does the same inside torch's classes: the per-micro-batch `_RecvInfo`s
are built on the meta device (no memory); `get_fwd_recv_ops` / `get_bwd_recv_ops` (called by
every torch schedule when it posts the receive) give the micro-batch's entries real buffers;
`backward_one_chunk` drops both once the chunk's backward ran (and, on the last stage,
detaches the micro-batch's loss, which the schedule keeps to the step's end: its graph would
hold the received input). The activation buffer is the chunk's input, which its forward keeps
(`fwd_cache`, autograd) until that backward anyway; the gradient buffer is read by that
backward only. What is alive at each moment follows the
schedule's own order (`cost_models.schedules.held_moments`: `RECV_INPUTS`, `RECV_GRADS`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.pipelining import PipelineStage


def recv_peer(ranks: Sequence[Sequence[int]], stage: int, peer_stage: int, tp_index: int) -> int:
    """The global rank of `peer_stage` that sends to tp rank `tp_index` of `stage`."""
    peers = ranks[peer_stage]
    return peers[tp_index % len(peers)]


def send_peers(ranks: Sequence[Sequence[int]], stage: int, peer_stage: int, tp_index: int) -> list[int]:
    """The global ranks of `peer_stage` that tp rank `tp_index` of `stage` sends to (the inverse
    of `recv_peer`)."""
    mine = len(ranks[stage])
    return [r for k, r in enumerate(ranks[peer_stage]) if k % mine == tp_index]


def replica_ranks(devices: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str]) -> list[list[int]]:
    """A stage's global ranks split by data-parallel replica: `out[d]` are the ranks of dp index
    d (row-major over the "dp" axes, as the dp sub-mesh numbers them) in tp order (row-major
    over the other axes)."""
    dp_axes = [i for i, a in enumerate(axis_names) if a == "dp"]
    tp_axes = [i for i, a in enumerate(axis_names) if a != "dp"]
    D = 1
    for i in dp_axes:
        D *= mesh_shape[i]
    with unset_fake_temporarily():   # rank arithmetic, real under `autopar verify`'s fake tensors too
        grid = torch.tensor(list(devices)).view(*mesh_shape)
        return grid.permute(*dp_axes, *tp_axes).reshape(D, -1).tolist()


class JustInTimeStage(PipelineStage):
    """torch's `PipelineStage` with its receive buffers made when the schedule posts the receive
    and dropped after the micro-batch's backward (see the module docstring)."""

    @contextlib.contextmanager
    def _on_meta(self) -> Iterator[None]:
        """torch's buffer setup runs with the stage's device set to meta: the `_RecvInfo`s get
        placeholders (shape, dtype, no storage) that `_allocate` replaces when needed."""
        device = self.device
        self.device = torch.device("meta")
        try:
            yield
        finally:
            self.device = device

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        with self._on_meta():
            super()._setup_forward_recv_info(num_microbatches, has_backward)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        with self._on_meta():
            return super()._create_grad_recv_info(act_send_info)

    def _allocate(self, infos: Sequence[Any]) -> None:
        from autopar.runtime.memory_tracking import pipeline_receives

        with pipeline_receives():
            for info in infos:
                if not info.is_root_arg and info.buffer is not None and info.buffer.is_meta:
                    info.buffer = torch.empty_strided(info.buffer.shape, info.buffer.stride(),
                                                      dtype=info.buffer.dtype, device=self.device)

    @staticmethod
    def _release(infos: Sequence[Any]) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is not None and not info.buffer.is_meta:
                b = info.buffer
                info.buffer = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        # a plain tensor, or verify's fake one (its step must hold what the run holds), not a DTensor
        if self.is_last and (type(out) is torch.Tensor or isinstance(out, FakeTensor)):
            # the loss: the schedule holds what this returns until the next forward returns,
            # and the loss function's copy to the step's end; the stage's forward cache holds
            # the chunk's own output until the micro-batch's backward. A loss that is a view,
            # or one whose storage is larger than its value (CPU's mse_loss keeps its
            # unreduced fp32 loss there), is handed on as its copy, which the backward detaches
            # (`backward_one_chunk`): its storage is then held through the backward alone
            from autopar.runtime.pipeline import compact_loss

            out = compact_loss(out)
        if not self.has_backward:       # no backward will come for it (forward-only schedules)
            self._release(self.args_recv_info.get(fwd_chunk_id, ()))
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)
        if full_backward:   # a split backward (zero-bubble) reads them again for its weights
            self._release_chunk(bwd_chunk_id)
            # the schedule keeps the loss to the step's end (`_internal_losses`); its graph's
            # nodes, though their saved tensors are freed, hold the leaf they end at: the
            # received input (AccumulateGrad keeps its variable). Detached, the graph goes.
            if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and not loss._is_view():
                loss.detach_()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._release_chunk(bwd_chunk_id)

    def _release_chunk(self, mb: int) -> None:
        self._release(self.args_recv_info.get(mb, ()))
        self._release(self.grad_recv_info.get(mb, ()))


class FanoutPipelineStage(JustInTimeStage):
    """A `PipelineStage` whose neighbour stages may hold another number of (tp) ranks; see the
    module docstring. `ranks[s]` are the global ranks of stage s in this rank's data-parallel
    replica (tp order); `group` is a process group holding all of them (the point-to-point ops
    of one batch must share a group)."""

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int,
                 device: torch.device, *, ranks: Sequence[Sequence[int]],
                 group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        size = dist.get_world_size(group)
        # torch refuses a group larger than the number of stages (it assumes one rank per
        # stage); ours holds every tp rank. Pass a count that satisfies the check, then restore
        # it: nothing else in the constructor depends on it.
        super().__init__(submodule, stage_index, max(num_stages, size), device, group=group, **kwargs)
        self.num_stages = num_stages
        self.ranks = [list(r) for r in ranks]
        self.global_rank = dist.get_rank()
        self.tp_index = self.ranks[stage_index].index(self.global_rank)
        self.stage_index_to_group_rank = {}   # peers come from `ranks`, never from this mapping

    # -- peers ---------------------------------------------------------------------------
    def _resolve_peer_global_rank(self, stage_idx: int) -> int:
        """The rank this stage receives from in `stage_idx` (torch calls this for every recv)."""
        return recv_peer(self.ranks, self.stage_index, stage_idx, self.tp_index)

    def send_peers(self, stage_idx: int) -> list[int]:
        return send_peers(self.ranks, self.stage_index, stage_idx, self.tp_index)

    def _is_same_rank(self, other_stage: int) -> bool:
        return False  # stages of different device sets never share a rank

    def _fan_out(self, ops: list[dist.P2POp], peer_stage: int) -> list[dist.P2POp]:
        """torch's send ops (one per tensor, to its single peer) re-addressed to `send_peers`."""
        return [dist.P2POp(dist.isend, op.tensor, r, self.group) for op in ops for r in self.send_peers(peer_stage)]

    # -- schedule ops ----------------------------------------------------------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_fwd_send_ops(fwd_chunk_id), self.stage_index + 1)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_bwd_send_ops(bwd_chunk_id), self.stage_index - 1)

    # -- start-up: warm-up vote and (dynamic mode) metadata exchange -----------------------
    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        for r in self.send_peers(dst_stage):
            dist.send_object_list([meta], dst=r, group=self.group, device=self.device, use_batch=True)

    def _recv_tensor(self, stage_idx: int) -> torch.Tensor:
        t = torch.zeros(1, dtype=torch.int32, device=self.device)
        dist.recv(t, src=self._resolve_peer_global_rank(stage_idx), group=self.group)
        return t

    def _send_tensor(self, t: torch.Tensor, stage_idx: int) -> None:
        for r in self.send_peers(stage_idx):
            dist.send(t, dst=r, group=self.group)

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        """torch's forward vote (1 = static metadata everywhere), with the fan-out peers."""
        from torch.distributed.pipelining.stage import InferenceMode

        vote = torch.tensor([0 if InferenceMode.needs_dynamic(self._user_meta, has_backward) else 1],
                            dtype=torch.int32, device=self.device)
        acc = vote if self.is_first else self._recv_tensor(self.stage_index - 1) * vote
        if not self.is_last:
            self._send_tensor(acc, self.stage_index + 1)
        return acc

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        """torch's backward half of the vote: the last stage's product travels back."""
        if self.is_last:
            if received_result is None:
                raise RuntimeError("the pipeline warm-up vote reached the last stage without a result")
            result = received_result
        else:
            result = self._recv_tensor(self.stage_index + 1)
        if not self.is_first:
            self._send_tensor(result, self.stage_index - 1)
        return result

