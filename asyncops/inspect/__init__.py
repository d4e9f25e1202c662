"""asyncops.inspect."""
