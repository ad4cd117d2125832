"""Megatron-LM glue: its save/load routed here, the --lazy-ckpt flags, the patch and the runtime hook, the torch_dist bridge."""
