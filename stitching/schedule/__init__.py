"""Schedule stage: iteration domain, kernel kind, passes and value placement.

TF-free.  Public API::

    check(spec) -> Decision            falsy = one kernel can do it; else .reason
    build_schedule(spec) -> Schedule   or ScheduleError(reason)
    Schedule.describe() -> str         first line is a one-line summary
"""
from .domain import Axis, DimClass, Domain, Refusal, analyze
from .passes import KernelKind, Placement
from .schedule import (Decision, Edge, Pass, ScalarStage, Schedule, ScheduleError,
                       build_schedule, check)

from ..plan import cost as _cost

# The planner's cost model asks this stage what it would build for a candidate
# (plan/cost.py: use_scheduler): planning comes first in the pipeline and owns the hook.
_cost.use_scheduler(build_schedule)

__all__ = ["check", "build_schedule", "Schedule", "ScheduleError", "Decision",
           "KernelKind", "Placement", "Pass", "ScalarStage", "Edge", "Domain", "Axis",
           "DimClass", "analyze", "Refusal"]
