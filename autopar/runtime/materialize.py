"""Deterministic materialisation of meta-device models.

Every parameter is initialised from a generator seeded by (seed, canonical FQN) only, so any
layout - any stage cut, any sharding - starts from the same weights as one process:
normal(0, 0.02) for tensors of 2+ dims, ones for the weight of a normalisation layer, zeros for
biases and other 1-D parameters. Tied parameters get one value under their canonical FQN (their
first name in the full model). Buffers are zero-filled unless the module is a known kind.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn

from autopar.models.empty import buffer_value

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
          nn.InstanceNorm1d, nn.InstanceNorm2d)
if hasattr(nn, "RMSNorm"):
    _NORMS = _NORMS + (nn.RMSNorm,)


def param_seed(seed: int, fqn: str) -> int:
    return (zlib.crc32(f"{seed}:{fqn}".encode()) + seed * 7919) % (2**63)


def init_value(fqn: str, shape: tuple, dtype: torch.dtype, owner: nn.Module | None, seed: int) -> torch.Tensor:
    """The initial value of parameter `fqn` (on CPU, full shape)."""
    g = torch.Generator().manual_seed(param_seed(seed, fqn))
    name = fqn.rsplit(".", 1)[-1]
    if len(shape) >= 2:
        t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
    elif owner is not None and isinstance(owner, _NORMS) and name == "weight":
        t = torch.ones(shape, dtype=torch.float32)
    elif "norm" in fqn.lower() and name in ("weight", "scale"):
        t = torch.ones(shape, dtype=torch.float32)
    else:
        t = torch.zeros(shape, dtype=torch.float32)
    return t.to(dtype if dtype.is_floating_point else torch.float32)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases included) -> its canonical (first) name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
        out[n] = first[id(p)]
    return out


def materialize(module: nn.Module, *, seed: int, device: torch.device | str = "cpu",
                aliases: dict[str, str] | None = None, prefix: str = "",
                template: nn.Module | None = None, only: set[str] | None = None) -> None:
    """Replace every meta parameter/buffer of `module` by a real one on `device`, initialised
    deterministically from (seed, canonical FQN). Parameters shared inside `module`, or tied in the
    model (equal canonical names in `aliases`), are one parameter.
    `template`: the model `module`'s submodules were traced from (a traced pipeline chunk holds
    the tracer's stand-ins, not the model's classes): the owner a value depends on (a norm's
    weight) is looked up there under the same name. `only`: the canonical names of the
    parameters to make real (a pipeline rank's); the others stay on meta."""
    aliases = aliases or {}
    made: dict[int, nn.Parameter] = {}
    made_as: dict[str, nn.Parameter] = {}     # by canonical name
    for mod_name, mod in list(module.named_modules(remove_duplicate=False)):
        owner = mod
        if template is not None:
            try:
                owner = template.get_submodule(prefix + mod_name) if mod_name else template
            except AttributeError:
                owner = mod
        for pname, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            fqn = f"{prefix}{mod_name}.{pname}" if mod_name else f"{prefix}{pname}"
            key = aliases.get(fqn, fqn)
            if only is not None and key not in only:
                continue
            if id(p) in made or key in made_as:
                # shared in `module`, or tied in the model under another name (a traced chunk
                # holds a tied weight as two stand-ins): one parameter
                mod._parameters[pname] = made[id(p)] if id(p) in made else made_as[key]
                continue
            val = init_value(key, tuple(p.shape), p.dtype, owner, seed).to(device)
            newp = nn.Parameter(val, requires_grad=p.requires_grad)
            made[id(p)] = made_as[key] = newp
            mod._parameters[pname] = newp
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            if not b.is_meta:
                mod._buffers[bname] = b.to(device)
                continue
            tb = owner._buffers.get(bname) if owner is not mod else None
            known = buffer_value(tb if tb is not None else b)   # computed when the model was built
            if known is not None:
                val = known.to(device=device, dtype=b.dtype)
            elif "running_var" in bname:
                val = torch.ones(b.shape, dtype=b.dtype, device=device)
            else:
                val = torch.zeros(b.shape, dtype=b.dtype, device=device)
            mod._buffers[bname] = val
