"""The offline export of a lazy checkpoint (datastates-ckpt export)."""
