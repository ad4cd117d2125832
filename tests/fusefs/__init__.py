"""A real fault filesystem for the tests: a FUSE passthrough (own process) that stalls or fails
chosen calls per path and operation.  :class:`.control.FaultFS` steers it; the ``fault_fs`` fixture
(tests/conftest.py) mounts one under ``tmp_path``."""
