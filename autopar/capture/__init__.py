"""Graph capture: a PyTorch model into an OpGraph (one node per ATen op with shapes and costs)."""

from autopar.capture.export import capture, default_loss, find_layers
from autopar.capture.graph import OpGraph, OpNode, ParamInfo, Ref, SymDim, TensorMeta

__all__ = ["OpGraph", "OpNode", "ParamInfo", "Ref", "SymDim", "TensorMeta", "capture",
           "default_loss", "find_layers"]
