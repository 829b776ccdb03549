"""Compute kernels. Each Triton kernel sits beside the torch reference it is tested against."""
