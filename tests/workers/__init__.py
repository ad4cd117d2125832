"""Worker programs the tests launch as ranks or subprocesses (``python -m tests.workers.<name>``)."""
