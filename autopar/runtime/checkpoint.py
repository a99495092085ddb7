"""Checkpoints with torch.distributed.checkpoint (DCP), atomic and resharding.

Layout: `DIR/step_00000012/` (a DCP checkpoint: `.metadata` + shards). A save writes
`DIR/.tmp-step_00000012/` and rank 0 renames it once every rank has finished, so a directory
named `step_*` is always complete; leftovers of an interrupted save (`.tmp-*`) are ignored and
removed. Keys are layout-independent: `model.<canonical FQN>` for parameters and
`optim.<canonical FQN>.<state>` for the optimizer state, each the full logical tensor (a DTensor
where the layout shards it), so a plan with another layout resumes from it (DCP reshards).
ZeRO-1/2's flat optimizer shards are gathered and stored per parameter under the same keys. A
fused weight the executor holds chunk-interleaved (Megatron's QKV rows) is stored in the model's
own row order (`runtime.interleaved`), and put back in its layout on load.

A parameter tied across pipeline stages of different layouts (the embedding whole on a tp-1
stage, vocabulary-sharded on a tp-2 one) is saved by one holder only: DCP refuses a key that one
rank saves whole and another sharded. `ParallelModel.checkpoint_skip` names the copies a rank
leaves out of a save (its parameter and optimizer keys); a load still fills every copy.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from autopar.runtime.tied_grads import all_gather_flat
from autopar.schema.errors import PlanError

_STEP = re.compile(r"^step_(\d+)$")


def latest(ckpt_dir: str | Path) -> Optional[tuple[int, Path]]:
    """(step, path) of the newest complete checkpoint in `ckpt_dir`, or None."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return None
    best = None
    for p in d.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and (p / ".metadata").exists():
            k = int(m.group(1))
            if best is None or k > best[0]:
                best = (k, p)
    return best


def _ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero Adam(W) state for parameters that have none yet, so DCP can load into it."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _zero12_per_param(pm, named, skip: frozenset[str] = frozenset()) -> dict:
    """ZeRO-1/2 keeps the optimizer state as flat dp shards; a checkpoint stores it per
    parameter (`optim.<fqn>.<state>`, the same keys as unsharded layouts) so any layout resumes
    from it. Gathers the flat state over dp (a collective, run whatever `skip` holds); parameters
    named in `skip` get no key. The tensors are fresh buffers; after a load,
    `_zero12_scatter_back` copies them into the flat shard."""
    from torch.distributed.tensor import DTensor

    out: dict = {}
    st = pm.optimizer.state.get(pm.flat_shard, {})
    S, D = pm.shard_size, pm.dp_size
    flats = [(f"optim.{{}}.{k}", v) for k, v in st.items()]
    if pm.low is not None:   # mixed precision: the flat shard is the fp32 master of the weights
        flats.append(("model.{}", pm.flat_shard.data))
    for key, v in flats:
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 1 and v.numel() == S:
            full = torch.empty(S * D, dtype=v.dtype, device=v.device)
            all_gather_flat(full, v.contiguous(), group=pm.dp_group)
            off = 0
            for n, p in named:
                loc = pm._local(p.data)
                seg = full[off:off + loc.numel()].view(loc.shape).clone()
                off += loc.numel()
                if n in skip:
                    continue
                if isinstance(p.data, DTensor):
                    seg = DTensor.from_local(seg, p.data.device_mesh, p.data.placements, run_check=False,
                                             shape=p.data.shape, stride=p.data.stride())
                out[key.format(n)] = seg
        else:
            for n, _ in named:
                if n not in skip:
                    out[key.format(n)] = v.clone()
    return out


def _zero12_scatter_back(pm, state: dict) -> None:
    """After a load: the per-parameter optimizer state back into this rank's flat shard."""
    st = pm.optimizer.state[pm.flat_shard]
    named = pm.local_named_parameters()
    lo = pm.dp_rank * pm.shard_size
    for k, v in st.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 1 and v.numel() == pm.shard_size:
            full = torch.cat([pm._local(state[f"optim.{n}.{k}"]).reshape(-1) for n, _ in named])
            seg = full[lo:lo + pm.shard_size]
            v.zero_()
            v[:seg.numel()].copy_(seg)
        else:
            v.copy_(state[f"optim.{named[0][0]}.{k}"])


def _save_skip(pm, for_load: bool) -> frozenset[str]:
    """Canonical names this rank leaves out of a save (tied copies another holder saves in its
    layout, `ParallelModel.checkpoint_skip`); none when loading: every copy is filled."""
    if for_load:
        return frozenset()
    return frozenset(pm.checkpoint_skip)


def state_dict(pm, *, for_load: bool = False) -> dict:
    """The DCP state of a ParallelModel (tensors alias the live ones, so a load is in place).
    For a save, the parameters in `pm.checkpoint_skip` are left out (model and optimizer keys)."""
    skip = _save_skip(pm, for_load)
    if (pm.zero12 or pm.zero3) and getattr(pm, "expert_groups", None) is not None:
        raise PlanError(f"checkpoints of expert-parallel plans under ZeRO-{pm.plan.zero_stage} are not supported yet "
                        f"(the experts' own shards over the ranks holding them); run without --checkpoint-dir, or "
                        f"re-plan with zero_stage 0")
    state: dict = {"step": torch.tensor(pm.steps_done, dtype=torch.int64)}
    named = pm.local_named_parameters()
    # a parameter's fp32 master where it has one (ZeRO 0 all, ZeRO-3 those FSDP leaves out:
    # 0-D ones), else itself
    own = dict(zip(map(id, pm.masters.params), pm.masters.masters)) if pm.masters is not None else {}
    masters = [own.get(id(p), p) for _, p in named]
    for (n, _p), m in zip(named, masters):
        # mixed precision saves the fp32 masters (ZeRO-1/2: gathered below), so a resume, in
        # any layout or precision, continues from the exact weights
        if n not in skip and not (pm.zero12 and pm.low is not None):
            state[f"model.{n}"] = _whole(pm, n, m.data)
    if for_load:
        _ensure_optimizer_state(pm.optimizer)
    if pm.zero12:
        state.update(_zero12_per_param(pm, named, skip))
    else:
        names = {id(m): n for (n, _), m in zip(named, masters)}
        ls = getattr(pm, "local_shards", None)     # an optimizer over the DTensors' local shards
        for p, st in pm.optimizer.state.items():
            n = names.get(id(ls.source_of.get(id(p), p) if ls is not None else p))
            if n is None or n in skip:
                continue
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    # stored in the parameter's layout, so a checkpoint reshards
                    state[f"optim.{n}.{k}"] = ls.dtensor_state(p, v) if ls is not None else _whole(pm, n, v)
    return state


def _whole(pm, n: str, t: torch.Tensor) -> torch.Tensor:
    """`t` (parameter `n`'s value or optimizer state), as the whole tensor DCP stores: an
    expert-parallel rank's slice of stacked expert weights becomes the DTensor of the stack
    (`runtime.experts.ExpertGroups.global_view`; scalar state such as AdamW's step stays)."""
    eg = getattr(pm, "expert_groups", None)
    if eg is None or n not in eg.names or t.dim() == 0:
        return t
    return eg.global_view(t)


def _model_order(pm, state: dict, for_load: bool) -> tuple[dict, list]:
    """`state` with the parameters the executor holds chunk-interleaved (`pm.interleaved`: a
    fused QKV weight in Megatron's layout) and their optimizer state in the model's own row
    order, contiguously sharded (`runtime.interleaved`), so the keys mean the same in every
    layout. For a save, the reordered copies; for a load, empty ones to load into and the
    (live tensor, copy, dim, chunks) to move back after (`_back_in_place`). Under ZeRO-3 the
    live tensor is FSDP's 2-D DTensor (its tp shard split again over dp): the copy is laid out
    (Replicate, Shard(dim)) on that mesh, each rank's tp shard gathered over dp for the
    exchange (one tensor at a time on a save)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.runtime.interleaved import to_canonical

    lays = getattr(pm, "interleaved", {}) or {}
    if not lays:
        return state, []
    out, fixups = dict(state), []
    for key, v in state.items():
        parts = key.split(".")
        fqn = ".".join(parts[1:] if parts[0] == "model" else parts[1:-1])
        if fqn not in lays or not isinstance(v, DTensor) or v.dim() == 0:
            continue
        dim, chunks = lays[fqn]
        mesh = v.device_mesh
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(dim)]      # FSDP's dp axis first
        tp_local = (v.redistribute(mesh, [Replicate()] * (mesh.ndim - 1) + [v.placements[-1]]).to_local()
                    if mesh.ndim > 1 else v.to_local())
        local = (torch.empty_like(tp_local) if for_load
                 else to_canonical(tp_local, dim, chunks, pm.tp_group))
        del tp_local
        out[key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=v.shape, stride=v.stride())
        fixups.append((v, out[key], dim, chunks))
    return out, fixups


def _back_in_place(pm, fixups: list) -> None:
    """After a load: each loaded model-order copy back into the interleaved live tensor."""
    from autopar.runtime.interleaved import from_canonical

    for live, copy, dim, chunks in fixups:
        tp_local = from_canonical(copy.to_local(), dim, chunks, pm.tp_group)
        if live.device_mesh.ndim > 1:
            # FSDP's shard of this tp shard: its dim-0 chunk of the dp coordinate
            dp = live.device_mesh.size(0)
            pieces = torch.chunk(tp_local, dp, dim=0)
            k = live.device_mesh.get_local_rank(0)
            tp_local = pieces[k] if k < len(pieces) else tp_local[:0]
        live.to_local().copy_(tp_local)


def save(pm, ckpt_dir: str | Path) -> Path:
    """Collective: save `pm` after `pm.steps_done` steps; returns the final directory."""
    import torch.distributed.checkpoint as dcp

    d = Path(ckpt_dir)
    name = f"step_{pm.steps_done:08d}"
    tmp, final = d / f".tmp-{name}", d / name
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(_model_order(pm, state_dict(pm), for_load=False)[0], checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(pm, path: str | Path) -> int:
    """Collective: load a checkpoint into `pm` (any layout for model.*/optim.*); returns its step."""
    import torch.distributed.checkpoint as dcp

    state = state_dict(pm, for_load=True)
    ordered, fixups = _model_order(pm, state, for_load=True)
    with torch.no_grad():
        dcp.load(ordered, checkpoint_id=str(path))
        _back_in_place(pm, fixups)
    pm.steps_done = int(state["step"])
    if pm.masters is not None:
        pm.masters.refresh()
    if pm.zero12:  # the loaded weights (fp32 masters under mixed precision) refresh the shard
        with torch.no_grad():
            _zero12_scatter_back(pm, state)
            named = pm.local_named_parameters()
            locs = [pm._local(state[f"model.{n}"] if pm.low is not None else p.data) for n, p in named]
            flat = torch.cat([t.reshape(-1) for t in locs])
            lo = pm.dp_rank * pm.shard_size
            seg = flat[lo:lo + pm.shard_size]
            pm.flat_shard.data.zero_()
            pm.flat_shard.data[:seg.numel()].copy_(seg)
            if pm.low is not None:   # the 2-byte parameters from the loaded masters
                for (_, p), t in zip(named, locs):
                    pm._local(p.data).copy_(t.view_as(pm._local(p.data)))
    return pm.steps_done


def cleanup_tmp(ckpt_dir: str | Path) -> None:
    d = Path(ckpt_dir)
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".tmp-step_"):
                shutil.rmtree(p, ignore_errors=True)
