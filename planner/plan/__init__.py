"""The plan: the refresh window a placement is made in, a window's solution, and the `Plan` assembled from
solutions (programs, timings, metrics). Imports only planner.problem."""
