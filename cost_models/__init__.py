"""Cost models shared by the ILP, the DP and the plan's predictions: compute, communication and
memory, and the profilers that measure a machine. Knows devices, links and op descriptions,
not the planner."""
