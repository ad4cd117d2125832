"""A tier and what it owns: commit, retention and its deleter, foreign refusal, the run id, promotion and replication."""
