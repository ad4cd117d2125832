"""Cross-rank agreement: start-up and load collectives, and the commit's c10d store channel."""
