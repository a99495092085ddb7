"""A program's grouped GEMMs named as the capture a solution was solved on names them.

A library picks its grouped-GEMM kernel by dtype: Hugging Face's experts
(`transformers.integrations.moe._grouped_mm`) call `torch.nn.functional.grouped_mm`
(`aten._grouped_mm`) on bf16 weights and their own `transformers::grouped_mm_fallback` on fp32
ones under torch.export. The planner captures the model once, in fp32, so a bf16 plan's solution
names `grouped_mm_fallback`, `grouped_mm_fallback_1`, ... while the program the runtime traces
in the run's dtype (`execute.meta_program(param_dtype=...)`, which must be traced so: the
model's casts to its weights' dtype) holds `_grouped_mm`, `_grouped_mm_1`, .... The capture
records every spelling as the one op `grouped_mm` (`capture.graph.GROUPED_GEMM_OPS`), with the
same tensor inputs, and the solution runs each replicated or as the expert block's exchange:
the program's grouped GEMMs take the solution's names, in order, so it runs the kernel of its
dtype as solved.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx

from autopar.capture.graph import GROUPED_GEMM_OPS

_SUFFIX = re.compile(r"_(\d+)$")


def _base(name: str) -> tuple[str, str, int]:
    """(wrapper prefix, op name without torch.export's counter, the counter) of a program
    node's OpGraph name ("<wrapper>__<node>" inside a wrapped subgraph)."""
    prefix, _, node = name.rpartition("__")
    m = _SUFFIX.search(node)
    if m and node[:m.start()] in GROUPED_GEMM_OPS:
        return prefix, node[:m.start()], int(m.group(1))
    return prefix, node, 0


def _is_grouped(n: torch.fx.Node) -> bool:
    """A call of a grouped GEMM of any spelling (torch's, Hugging Face's fallback, the zoo's)."""
    parts = str(n.target).split(".")
    return (parts[1] if len(parts) >= 3 else parts[0]) in GROUPED_GEMM_OPS


def grouped_gemms_named_as_solved(program: Any, solution: Any, calls: dict[str, torch.fx.Node]) -> None:
    """Rename `program`'s grouped GEMMs that `solution` does not name to the grouped GEMMs the
    solution names and the program lacks, in order within each (wrapped) graph, where both hold
    as many; leave the program alone otherwise. `calls`: the program's call nodes by OpGraph
    name (`execute._program_calls`). Idempotent."""
    want: dict[str, list[tuple[int, str]]] = {}
    for name in solution.op_choices:
        prefix, base, k = _base(name)
        if base in GROUPED_GEMM_OPS and name not in calls:
            want.setdefault(prefix, []).append((k, name))
    if not want:
        return
    have: dict[str, list[torch.fx.Node]] = {}
    for name, n in calls.items():
        if _is_grouped(n) and name not in solution.op_choices:
            have.setdefault(name.rpartition("__")[0], []).append(n)
    touched: set[torch.fx.Graph] = set()
    for prefix, names in want.items():
        nodes = have.get(prefix, [])
        if len(nodes) != len(names):
            continue
        for n, (_, full) in zip(nodes, sorted(names)):
            _rename(n, full.rpartition("__")[2])
            touched.add(n.graph)
    for g in touched:
        g.lint()
        if g.owning_module is not None:
            g.owning_module.recompile()


def _rename(n: torch.fx.Node, name: str) -> None:
    """Give `n` the name `name` in its graph (as `execute.positions_named_as_captured` does)."""
    ns = n.graph._graph_namespace
    ns._used_names.discard(n.name)
    n.name = name
    ns._obj_to_name[n] = name
    ns._used_names.add(name)
