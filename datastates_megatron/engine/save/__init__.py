"""Taking a snapshot: the host cache, device copies and the snapshot engine's threads."""
