"""stalebound.tasks."""
