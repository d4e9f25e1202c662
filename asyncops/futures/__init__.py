"""asyncops.futures."""
