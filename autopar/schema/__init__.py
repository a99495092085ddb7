"""File formats of autopar (pydantic v2). Imports nothing else of autopar, so a plan file can be
read anywhere."""

from autopar.schema.errors import PlanError
from autopar.schema.cluster import DeviceSpec, LinkSpec, ClusterSpec
from autopar.schema.mesh import LogicalMesh
from autopar.schema.constraints import Constraints
from autopar.schema.plan import (Plan, StagePlan, StagePrediction, Prediction, ModelInfo,
                                 PLAN_FORMAT_VERSION, load_plan)

__all__ = ["PlanError", "DeviceSpec", "LinkSpec", "ClusterSpec", "LogicalMesh", "Constraints",
           "Plan", "StagePlan", "StagePrediction", "Prediction", "ModelInfo",
           "PLAN_FORMAT_VERSION", "load_plan"]
