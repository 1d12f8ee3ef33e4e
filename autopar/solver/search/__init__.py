"""The search for a solution of the sharding ILP: MILP backends, LP relaxation and rounding, the
Lagrangian under a memory budget, the leanest layout. (A *strategy* elsewhere is one op's sharding
choice, ``rules.registry.Strategy``; this folder solves for the choice of every op.)"""
