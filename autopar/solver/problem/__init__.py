"""The problem: the choice graph (every node's strategies, priced) and the sharding ILP built on it."""
