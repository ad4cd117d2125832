"""``wait(persist=True)`` says when a promotion to the bucket failed: it raises
:class:`PromotionError` (a ``CheckpointError``) naming the iteration and the object, instead of
returning as if the checkpoint were in the bucket with the failure in the log only (finding of
issue #49).  The failure is the store's: a bucket policy refusing the rank objects' uploads (the
proxy of :mod:`.s3_proxy` answers 403), nothing mocked in the job."""

from __future__ import annotations

import pytest
import torch

from datastates_megatron.engine.errors import CheckpointError, PromotionError

from .test_s3_faults import _manager, _manifests, proxy  # noqa: F401 - the fixture


def test_wait_persist_raises_when_a_promotion_failed_and_the_next_one_still_commits(proxy, tmp_path):  # noqa: F811
    url = f"s3://{proxy.bucket}/run"
    w = torch.zeros(1 << 12)
    proxy.rules(refuse_write=["run/iter_0000001/"])
    mgr = _manager(url, str(tmp_path / "local"), persist_interval=1)
    try:
        mgr.register("w", w)
        w.fill_(1.0)
        assert mgr.save(1)
        with pytest.raises(PromotionError) as got:
            mgr.wait(persist=True)
        assert isinstance(got.value, CheckpointError)
        text = str(got.value)
        assert "iteration 1" in text and f"{url}/iter_0000001" in text and "AccessDenied" in text, text
        assert "\n" not in text
        proxy.rules()
        w.fill_(2.0)
        assert mgr.save(2)
        records = mgr.wait(persist=True)  # reported once: the next promotion commits and wait returns
        assert [(r.iteration, r.tier) for r in records if r.tier == "persistent"] == [(2, "persistent")]
    finally:
        mgr.close()
    assert _manifests(proxy.client, proxy.bucket) == [2]
