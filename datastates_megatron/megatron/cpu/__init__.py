"""Running Megatron-LM and megatron-core on CPU: the CUDA shim, the launcher, the training record tests compare."""
