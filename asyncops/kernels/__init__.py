"""asyncops.kernels."""
