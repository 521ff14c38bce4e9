"""fxkfac.planner: pure-Python planning of K-FAC work into pipeline bubbles (no torch)."""
