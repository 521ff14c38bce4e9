"""fxkfac.passes: GraphModule -> GraphModule transforms for K-FAC and pipelining."""
