"""The RL system: coordinator, rollouts, weight publication, backends, batch packing."""
