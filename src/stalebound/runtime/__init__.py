"""stalebound.runtime."""
