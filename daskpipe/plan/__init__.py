"""The control plane: pre-partitioning into blocks and the pool-based pipeline MILP."""

from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan, PlanError

__all__ = ["ModelPlan", "Partition", "Pipeline", "Plan", "PlanError", "PlannerOptions", "make_plan"]
