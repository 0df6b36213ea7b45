"""The codec: rounding contract, ops' declarations, roles, the convert planner, fidelity against bitsandbytes."""
