"""The search: the one `plan()` entry point and every candidate it weighs (placements by CP-SAT and first-fit,
strategies, streaming, block sizes, fusing, schedules), under one `Budget`. Imports planner.problem and planner.plan."""
