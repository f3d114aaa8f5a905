"""stalebound.distributed."""
