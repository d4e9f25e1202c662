"""asyncops.stateful."""
