"""What every user of LazyCheckpointer runs: the shard walk, the checkpointer, resharding, options."""
