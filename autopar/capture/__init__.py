"""Graph capture: a PyTorch model into an OpGraph (one node per ATen op with shapes and costs).

Importing this package imports neither torch nor networkx (`autopar --help` and `autopar models`
stay fast): `capture` loads the exporter on its first call, and the other names on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from autopar.capture.graph import OpGraph, OpNode, ParamInfo, Ref, SymDim, TensorMeta

if TYPE_CHECKING:
    from autopar.capture.export import LossFn

__all__ = ["OpGraph", "OpNode", "ParamInfo", "Ref", "SymDim", "TensorMeta", "capture",
           "default_loss", "find_layers"]


def capture(model: Any, example_inputs: Sequence[Any], *, loss_fn: Optional["LossFn"] = None,
            name: Optional[str] = None, batch_dim: bool = True, repeated: bool = True,
            cache: Any = None) -> OpGraph:
    """Capture `model(*example_inputs)` (plus its loss) as an OpGraph: `autopar.capture.export.capture`,
    imported on first use (it imports torch)."""
    from autopar.capture.export import capture as _capture

    return _capture(model, example_inputs, loss_fn=loss_fn, name=name, batch_dim=batch_dim,
                    repeated=repeated, cache=cache)


def __getattr__(name: str) -> Any:
    if name in ("default_loss", "find_layers"):
        from autopar.capture import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
