"""File formats of autopar (pydantic v2). Imports nothing else of autopar, so a plan file can be
read anywhere."""

from autopar.schema.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autopar.schema.constraints import Constraints
from autopar.schema.errors import PlanError
from autopar.schema.mesh import LogicalMesh
from autopar.schema.plan import PLAN_FORMAT_VERSION, ModelInfo, Plan, Prediction, StagePlan, StagePrediction, load_plan
from autopar.schema.software import SoftwareSpec

__all__ = ["PlanError", "DeviceSpec", "LinkSpec", "ClusterSpec", "LogicalMesh", "Constraints",
           "Plan", "StagePlan", "StagePrediction", "Prediction", "ModelInfo",
           "PLAN_FORMAT_VERSION", "load_plan", "SoftwareSpec"]
