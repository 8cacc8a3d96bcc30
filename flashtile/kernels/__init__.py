"""Triton kernels and their launchers. Nothing here knows about autograd or modules:
launchers take tensors (inputs and preallocated outputs) and scalars, and launch."""
