"""Filesystem primitives: safe opens that never follow a link, page cache, mapped files, the directory lock, iteration directories."""
