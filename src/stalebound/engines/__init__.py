"""stalebound.engines."""
