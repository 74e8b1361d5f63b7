"""Samplers: each turns one source (NVML, the allocator, the canary) into sample records."""
