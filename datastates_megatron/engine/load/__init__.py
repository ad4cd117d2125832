"""Restoring: the load plan, the verifying reader and the one resolve step of a restart."""
