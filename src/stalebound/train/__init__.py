"""stalebound.train."""
