"""stalebound.obs."""
