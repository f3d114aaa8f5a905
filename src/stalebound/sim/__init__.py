"""stalebound.sim."""
