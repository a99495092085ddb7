"""Match a program traced for the rank's device to the solution solved on the planner's capture.

The planner captures a model on the meta device; the runtime exports the program the model
runs on the rank's device (`execute.meta_program`), so that a model branching on its device runs
the branch it takes there. The two traces name their ops alike where they trace alike, but a
model's code can trace into a different set of ops on another device without computing anything
else: `x.contiguous()` is an op where `x` is laid out otherwise and no op where it is contiguous
already, and which it is depends on the kernel before it (the meta device's attention writes its
output heads-major, CPU's and CUDA's kernels as the query is laid out; Hugging Face attention's
`.transpose(1, 2).contiguous()` is one op on meta and none on CPU). torch.export numbers the ops
of one kind in the order it traces them, so the names after such a difference differ too.
Hugging Face's mask code traces an `expand` nothing reads on meta and none for CUDA.

`match_names` aligns the device program's tensor ops with the solution's (`difflib` over each
op's kind and family, in program order: the solution keeps the capture's order) and renames the
program's ops to the capture's names. It accepts a difference only where it computes nothing:
a solution op that the device program lacks must be a view or a `contiguous`/`alias` (a layout
change the device does not need; its readers read its input, laid out as the solution lays out
its output, since those keep their input's placement), and the ops both have must agree in
kind, family and number of tensor inputs. Anything else is returned as a mismatch, and the
caller runs the meta program. An op only the device's program has that computes nothing (a
copy its kernels' layouts need) passes its input on as its maker's choice leaves it
(`pass_through`: the solution's collectives stay the ones that run); any other (a branch the
device takes) runs unplanned, by DTensor's propagation, and `unplanned_ops` names them for the
caller to say so (one holding a name the solution gives another op is renamed
`<kind>_device_<n>`).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import torch

__all__ = ["match_names", "pass_through", "unplanned_ops", "computes_nothing", "IDENTITY_WHERE_CONTIGUOUS"]

# ops that compute nothing where their input is already laid out as they return it (and views,
# which never compute): the ones a device's trace may leave out that the meta device's keeps
IDENTITY_WHERE_CONTIGUOUS = frozenset({"contiguous", "alias"})
# the copy torch.export makes of a tensor constant the forward builds from Python data (an index
# list, `torch.tensor(...)`), which a trace on the meta device may record without it
CONSTANT_COPIES = frozenset({"lift_fresh_copy"})


def computes_nothing(kind: str, family: str) -> bool:
    """Whether a solved op of `kind` (an export node name's op kind) and rule `family` may be
    absent from the device's program: a view, or a copy made only where a layout needs it."""
    return family == "view" or kind.rpartition("__")[2] in IDENTITY_WHERE_CONTIGUOUS

_NUMBERED = re.compile(r"_\d+$")


def _kind(name: str) -> str:
    """The op kind of an export node name (`mul_12` -> `mul`; a wrapper's inner op keeps its
    wrapper's prefix: `wrap_with_autocast__mul_3` -> `wrap_with_autocast__mul`)."""
    prefix, _, last = name.rpartition("__")
    kind = _NUMBERED.sub("", last)
    return f"{_NUMBERED.sub('', prefix)}__{kind}" if prefix else kind


def pass_through(program: Any, solution: Any, full: Any = None) -> list[str]:
    """Plan the device program's ops the solution has no choice for that compute nothing (a
    `contiguous`, `alias` or view the device's trace makes and the capture's did not: Hugging
    Face attention's `reshape(...).contiguous()` for CUDA) as passing their one tensor input on
    in the layout its maker's choice leaves it (and the copy of a constant the forward builds
    from Python data, `lift_fresh_copy`: Falcon's index lists, replicated, as every rank makes
    it): a choice added to `solution` (and to `full`, the
    whole program's, where `solution` is part of it), so that their readers read what the
    solution expects and the executor runs no redistribution that no solution counted. Returns
    the names so planned."""
    from autopar.intra_op import rules
    from autopar.intra_op.execute import _no_choice_needed, _op_name, _program_calls, _tensor_args
    from autopar.intra_op.solution import OpChoice

    full = solution if full is None else full
    calls = _program_calls(program.graph_module)
    name_of = {n: k for k, n in calls.items()}
    planned = []
    for name, n in calls.items():
        if _no_choice_needed(n) or name in full.op_choices:
            continue
        rule = rules.rule_for(_op_name(n))
        family = rule.family if rule else ""
        args = _tensor_args(n)
        if len(args) != 1:
            continue
        if _op_name(n).rpartition("__")[2] in CONSTANT_COPIES:
            # a tensor the forward makes from Python data, the same on every rank
            pl = _replicated(full)
            if pl is None:
                continue
        else:
            if not computes_nothing(_op_name(n), family):
                continue
            maker = full.op_choices.get(name_of.get(args[0], ""))
            if maker is None or not maker.output_placements:
                continue
            pl = tuple(maker.output_placements[0])
        choice = OpChoice("pass-through", [pl], 0.0, 0.0, [pl], family)
        full.op_choices[name] = choice
        if solution is not full:
            solution.op_choices[name] = choice
        planned.append(name)
    return planned


def _replicated(solution: Any) -> tuple[str, ...] | None:
    """Replicated over the solution's mesh (its layouts' length), or None for an empty one."""
    for ch in solution.op_choices.values():
        if ch.output_placements:
            return ("R",) * len(ch.output_placements[0])
    return None


def unplanned_ops(program: Any, solution: Any) -> list[str]:
    """The tensor ops of `program` the solution has no choice for (run by DTensor's propagation)."""
    from autopar.intra_op.execute import _no_choice_needed, _program_calls

    return [k for k, n in _program_calls(program.graph_module).items()
            if not _no_choice_needed(n) and k not in solution.op_choices]


def match_names(program: Any, solution: Any) -> list[str]:
    """Rename the call nodes of `program` (a torch.export program) to the names of the solution's
    ops they correspond to; returns what cannot be matched (empty: the program fits, or fitted
    already). The program is renamed in place: the names it takes are its capture's, the same for
    every solution of that capture."""
    from autopar.intra_op import rules
    from autopar.intra_op.execute import _no_choice_needed, _op_name, _program_calls, _tensor_args

    calls = {k: n for k, n in _program_calls(program.graph_module).items() if not _no_choice_needed(n)}
    names = list(calls)
    choices = solution.op_choices

    def family(n: torch.fx.Node) -> str:
        rule = rules.rule_for(_op_name(n))
        return rule.family if rule else "fallback"

    mine = [(_kind(k), family(n), len(_tensor_args(n))) for k, n in calls.items()]
    theirs = [(_kind(k), c.family, len(c.input_placements)) for k, c in choices.items()]
    wanted = list(choices)
    rename: dict[str, str] = {}
    bad: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            rename.update({names[i]: wanted[j] for i, j in zip(range(i1, i2), range(j1, j2))})
            continue
        # the solution's ops the program lacks: only layout changes the device does not need
        bad += [wanted[j] for j in range(j1, j2) if not computes_nothing(theirs[j][0], theirs[j][1])]
        # the program's ops without a counterpart run unplanned (`unplanned_ops`), as where the
        # names agree; matched around, they keep their own names unless the solution's ops take them
    if bad:
        return bad
    taken_by_solution = set(rename.values())
    for k, old in enumerate(o for o in names if o not in rename and o in taken_by_solution):
        prefix, _, _ = old.rpartition("__")
        rename[old] = f"{prefix + '__' if prefix else ''}{_kind(old).rpartition('__')[2]}_device_{k}"
    signature = _signature_names(program)
    moved = {old: new for old, new in rename.items() if old != new}
    if any(old in signature or new in signature for old, new in moved.items()):
        return sorted(old for old in moved if old in signature)
    if any(old.rpartition("__")[0] != new.rpartition("__")[0] for old, new in moved.items()):
        return sorted(old for old, new in moved.items() if old.rpartition("__")[0] != new.rpartition("__")[0])
    graphs = {calls[old].graph for old in moved}
    held = {n.name for g in graphs for n in g.nodes if n.name not in {calls[o].name for o in moved}}
    taken = [new for new in moved.values() if new.rpartition("__")[2] in held]
    if taken:
        return [f"{new} (its name is held by another op of the program)" for new in taken]
    for old, new in moved.items():
        node, name = calls[old], new.rpartition("__")[2]
        node.name = name
        ns = node.graph._graph_namespace
        ns._used_names.add(name)
        ns._obj_to_name[node] = name
    for g in graphs:
        g.owning_module.recompile()
    return []


def _signature_names(program: Any) -> set[str]:
    """Node names the exported program's signature refers to (its inputs' and outputs')."""
    sig = program.graph_signature
    out: set[str] = set()
    for spec in list(sig.input_specs) + list(sig.output_specs):
        name = getattr(spec.arg, "name", None)
        if name:
            out.add(name)
    return out
