"""Strategies that solve the sharding ILP: MILP backends, LP relaxation and rounding, the Lagrangian
under a memory budget."""
