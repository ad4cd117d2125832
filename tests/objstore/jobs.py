"""A job of WORLD ranks (threads standing for them) promoting local checkpoints to S3: the object
storage tests' one way to make a committed checkpoint in a bucket."""

from __future__ import annotations

import torch.distributed as dist

from datastates_megatron.engine.errors import CommitError
from datastates_megatron.engine.tiers.promotion import Promotion
from datastates_megatron.engine.storage import open_storage
from datastates_megatron.engine.storage.object_tier import ObjectTier
from datastates_megatron.engine.dist.store_channel import StoreChannel
from datastates_megatron.engine.tiers.tier import Tier

TOKEN, WORLD = "00000000000000dd", 2


def storage(bucket: str, prefix: str = "job/save", **options):
    return open_storage(f"s3://{bucket}/{prefix}", **{"part_bytes": 5 << 20, "concurrency": 2, **options})


class Job:
    """WORLD ranks (threads standing for them, one in-process c10d store): each a local tier over a
    committed local checkpoint directory, a promotion, and the persistent tier on S3."""

    def __init__(self, bucket: str, local: str, keep_last: int = 0, **storage_options) -> None:
        """``storage_options``: :class:`...storage.s3.S3Storage`'s (timeouts, retry policy)."""
        self.storages = [storage(bucket, **storage_options) for _ in range(WORLD)]
        self.dst = [
            ObjectTier(st, rank=r, token=TOKEN, writes=list(range(WORLD)) if r == 0 else [], keep_last=keep_last)
            for r, st in enumerate(self.storages)
        ]
        found = self.dst[0].survey()
        self.dst[0].refuse_foreign(found)
        self.dst[0].acquire()
        self.dst[0].clean(found)
        store = dist.HashStore()
        for r, tier in enumerate(self.dst):
            tier.open(StoreChannel(store, r, WORLD, "persistent", 30.0), WORLD, {"dp": WORLD}, 30.0)
        self.src = [Tier("local", local, rank=r, token=TOKEN, writes=[]) for r in range(WORLD)]
        self.links = [Promotion(s, d, interval=1) for s, d in zip(self.src, self.dst)]

    def promote(self, iteration: int) -> list:
        for link in self.links:
            link.schedule(iteration, 1, {"note": "x"})
        out = []
        for tier in self.dst:
            tier.drain(60)
            try:
                out.append([c.iteration for c in tier.poll()])
            except CommitError as e:
                out.append(e)
        self.dst[0].drain_deletions(60)
        return out

    def close(self) -> None:
        for link in self.links:
            link.close()
        for tier in self.dst:
            tier.close()
        self.dst[0].release()
        for st in self.storages:
            st.close()
