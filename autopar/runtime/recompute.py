"""Recomputation of module-cut stages: `torch.utils.checkpoint` around each module the plan names
(`StagePlan.recompute_modules`: the planner found them from the captured ops; under "full" the
repeated block, under "attention" the module holding its attention core), or under "selective"
the attention core's ops (`StagePlan.recompute_ops`) recomputed alone in the modules holding
them (`runtime.selective`; a plan of format 8 or earlier checkpoints those modules whole); under
"norm_act" the norm modules and the experts modules' activations with their outputs discarded
(`runtime.discard`). No module is found here by its name. A stage run op by op as solved checkpoints its solved regions
instead (`intra_op.execute`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.nn as nn

from autopar.runtime.validate import get_submodule


def checkpoint_module(module: nn.Module) -> None:
    """Run `module`'s forward under torch's non-reentrant activation checkpoint: only its inputs
    are kept, what its ops save is re-made in the backward."""
    from torch.utils.checkpoint import checkpoint

    from autopar.runtime.selective import recomputation_context

    orig = module.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        # the re-run labelled as a recomputation for a tracked step (`memory_tracking.recomputing`)
        return checkpoint(orig, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), recomputation_context()),
                          **kwargs)

    module.forward = fwd  # instance attribute: hooks (fully_shard) still run around __call__


def apply_recompute(root: nn.Module, modules: list[str] | None, ops: list[str] | None = None) -> None:
    """Checkpoint each of `modules` (a stage's `recompute_modules`) inside `root`, or with `ops`
    (its `recompute_ops`) recompute just those ops in them (`selective.apply_selective`)."""
    if ops is not None:
        from autopar.runtime.selective import apply_selective

        apply_selective(root, modules, ops)
        return
    for fqn in modules or ():
        checkpoint_module(get_submodule(root, fqn))


def apply_stage_recompute(root: nn.Module, stage: Any) -> None:
    """The recomputation of `stage` (a `StagePlan`) in `root`, its module tree."""
    if stage.recompute == "norm_act":
        from autopar.runtime.discard import apply_discard

        apply_discard(root, stage.recompute_modules, stage.recompute_acts)
        return
    apply_recompute(root, stage.recompute_modules, stage.recompute_ops)
