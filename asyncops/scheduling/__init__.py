"""asyncops.scheduling."""
