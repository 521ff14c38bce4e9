"""The plan: the refresh window a stage group is placed in (built from the problem), a window's solution, and the
`Plan` made of solutions (programs, timings, metrics) with its views. Imports only planner.problem."""

from fxkfac.planner.plan.plan import Plan, PlanMetrics, SolverStats, ns_stage_lines, ns_summary, ns_tasks

__all__ = ["Plan", "PlanMetrics", "SolverStats", "ns_stage_lines", "ns_summary", "ns_tasks"]
