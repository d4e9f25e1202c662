"""asyncops: asynchronous collectives for Pallas TPU kernels."""
