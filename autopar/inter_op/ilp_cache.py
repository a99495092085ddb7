"""Per-layer intra-op solutions on disk (issue 19), beside the capture cache.

The search solves the intra-op ILP once per (layer signature, micro-batch, tp degree, layout
variant): about a hundred CP-SAT solves for GPT-3 175B on 1536 GPUs, 1.5 s of the command on a
2-core machine, and the same again every time the same model is planned for a cluster of the
same device type (another node count, batch, constraint; a capacity sweep). An entry is keyed by
everything the solve reads: the layer's ops and the tensors they read (names, shapes, dtypes,
FLOPs; `capture.cache.encode`), the parameters they use, the tp mesh (its links' latency and
bandwidth and the device profile: compute is costed), the dtype, every option passed to
`solve_graph` (pins of tied parameters, time limit, layout variant, batch and token dims), and
the code that solves (a hash of `autopar/intra_op`, `cost_models` and this package's
provider). A changed model, profile or solver gets another key, never a stale entry.

Entries are JSON files under `<capture cache directory>/ilp/`, written to a temporary file and
renamed into place; one that does not read back is ignored (warned) and solved again. A cached
solution is the one the solver returned when it was stored: under load CP-SAT's time limit can
return another layout of equal cost, so the cache also makes repeated plans identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from autopar.capture.cache import CacheWarning, _Unencodable, encode
from autopar.capture.graph import OpGraph
from autopar.intra_op.solution import ShardingSolution

FORMAT = 1       # the entry's JSON layout (`ShardingSolution.to_dict`); bump when it changes

_CODE: Optional[str] = None


def solver_version() -> str:
    """A hash of the code a solve runs: autopar's version, `autopar/intra_op/**`, `cost_models/*`,
    the provider and the graph classes."""
    global _CODE
    if _CODE is None:
        from autopar import __version__

        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256(__version__.encode())
        files = sorted((root / "intra_op").rglob("*.py")) + sorted((root.parent / "cost_models").glob("*.py"))
        files += [root / "inter_op" / "ilp_provider.py", root / "inter_op" / "stage_cost.py",
                  root / "inter_op" / "layers.py", root / "capture" / "graph.py", root / "schema" / "software.py",
                  root / "schema" / "cluster.py", Path(__file__)]
        for p in files:
            if p.exists():
                h.update(str(p.relative_to(root.parent)).encode())
                h.update(p.read_bytes())
        _CODE = h.hexdigest()[:16]
    return _CODE


def graph_digest(g: OpGraph) -> Optional[str]:
    """A hash of everything `g` (a layer's subgraph) holds that a cost or solve reads: its ops
    and tensors (`capture.cache.encode`) and the parameters they use; None when it holds an
    argument the encoding does not store (what reads it is not cached)."""
    used = {p for n in g.nodes for p in (n.params or ())}
    try:
        enc = encode(replace(g, params={k: v for k, v in g.params.items() if k in used}))
    except _Unencodable:
        return None
    for k in ("name", "capture_method", "capture_time_s"):
        enc.pop(k, None)
    return hashlib.sha256(json.dumps(enc, sort_keys=True, default=str).encode()).hexdigest()


def solve_key(g: OpGraph, nodes: list[str], mesh: Any, dtype: str, options: dict[str, Any],
              digest: Optional[str] = None) -> Optional[str]:
    """The entry's key for solving `nodes` of `g` on `mesh` (a LogicalMesh) with `options` (the
    other arguments of `solve_graph`, JSON-able); None when the graph holds an argument the
    encoding does not store (that solve is not cached). `digest`: `graph_digest(g)`, when the
    caller has it."""
    digest = digest or graph_digest(g)
    if digest is None:
        return None
    blob = json.dumps({"format": FORMAT, "code": solver_version(), "graph": digest, "nodes": list(nodes),
                       "mesh": mesh.model_dump(mode="json"), "dtype": dtype, "options": options},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class _JsonStore:
    """Entries `<directory>/<sub>/<key>.json` holding {"format": N, <field>: value}: read back
    with `decode`, written atomically with `encode`; an unreadable entry is warned about and
    treated as absent, a directory that cannot be written costs only the cache (warned)."""

    sub, field, format, what, redo = "", "", 0, "", ""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory) / self.sub
        self.hits = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def decode(self, data: Any) -> Any:
        raise NotImplementedError

    def encode(self, value: Any) -> Any:
        raise NotImplementedError

    def get(self, key: str) -> Optional[Any]:
        """The stored value, or None (none stored, or unreadable: warned)."""
        p = self.path(key)
        try:
            data = json.loads(p.read_text())
            if data.get("format") != self.format:
                raise ValueError(f"format {data.get('format')!r}, not {self.format}")
            value = self.decode(data[self.field])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"autopar: {self.what} cache entry {p} unreadable ({e}); {self.redo}",
                          CacheWarning, stacklevel=3)
            return None
        self.hits += 1
        return value

    def put(self, key: str, value: Any) -> None:
        """Store `value` (atomically)."""
        p = self.path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{self.sub}-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                # one string: `json.dumps` runs the C encoder, `json.dump` streams through the Python one
                f.write(json.dumps({"format": self.format, self.field: self.encode(value)}, separators=(",", ":")))
            os.replace(tmp, p)
        except OSError as e:
            warnings.warn(f"autopar: could not write the {self.what} cache {p}: {e}", CacheWarning,
                          stacklevel=3)


class IlpCache(_JsonStore):
    """Solutions under `directory` (a capture cache directory's `ilp/`)."""

    sub, field, format, what, redo = "ilp", "solution", FORMAT, "intra-op solution", "solving again"

    def decode(self, data: Any) -> ShardingSolution:
        return ShardingSolution.from_dict(data)

    def encode(self, value: ShardingSolution) -> Any:
        return value.to_dict()


COST_FORMAT = 7   # a LayerCost entry's JSON layout (`LayerCost.to_dict`); bump when it changes


class CostCache(_JsonStore):
    """A layer's whole cost (`stage_cost.LayerCost`: times, collectives, placements, activation
    memory by recomputation policy, the executor's variant) under `directory`'s `layer_costs/`,
    keyed like the solutions (`cost_key`): a warm plan reads them instead of re-deriving the
    activation memory of every layer, micro-batch and tp degree from the graph."""

    sub, field, format, what, redo = "layer_costs", "cost", COST_FORMAT, "layer cost", "costing again"

    def decode(self, data: Any) -> Any:
        from autopar.inter_op.stage_cost import LayerCost

        return LayerCost.from_dict(data)

    def encode(self, value: Any) -> Any:
        return value.to_dict()


def cost_key(digest: Optional[str], what: dict[str, Any]) -> Optional[str]:
    """A layer cost's key: its subgraph's `graph_digest` and `what` else it reads (the layer's
    names, micro-batch, tp, the device and links, dtype, software, options), with the code."""
    if digest is None:
        return None
    blob = json.dumps({"format": COST_FORMAT, "code": solver_version(), "graph": digest, **what},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
