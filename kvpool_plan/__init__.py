"""`kvpool plan`: the pool at cluster scale, simulated with the pool's own code (issue 43)."""
