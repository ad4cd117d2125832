"""``wait(persist=True)`` says when a promotion to the bucket failed: it raises
:class:`PromotionError` (a ``CheckpointError``) naming the iteration and the object, instead of
returning as if the checkpoint were in the bucket with the failure in the log only (finding of
issue #49).  ``poll`` (what a training step's save runs) never raises it -- an outage of the store
does not stop training -- and a failure a newer committed promotion superseded is not raised.  The
failure is the store's: a bucket policy refusing the rank objects' uploads (the proxy of
:mod:`.s3_proxy` answers 403), nothing mocked in the job."""

from __future__ import annotations

import logging

import pytest
import torch

from datastates_megatron.engine.errors import CheckpointError, PromotionError

from .test_s3_faults import _manager, _manifests, proxy  # noqa: F401 - the fixture


def _promotion_done(mgr) -> list:
    """The newest save is committed locally (its promotion then scheduled), and the promotion has
    committed or failed; the records the wait returned."""
    out = mgr.wait(persist=False)
    mgr.persistent.drain(60)
    return out


def test_wait_persist_raises_a_failed_promotion_once_and_poll_never_does(proxy, tmp_path, caplog):  # noqa: F811
    url = f"s3://{proxy.bucket}/run"
    w = torch.zeros(1 << 12)
    proxy.rules(refuse_write=["run/iter_0000001/"])
    mgr = _manager(url, str(tmp_path / "local"), persist_interval=1)
    try:
        mgr.register("w", w)
        w.fill_(1.0)
        assert mgr.save(1)
        _promotion_done(mgr)
        assert mgr.poll() == []  # a training step's poll: never raises it
        with pytest.raises(PromotionError) as got:
            mgr.wait(persist=True)
        assert isinstance(got.value, CheckpointError) and got.value.iteration == 1
        text = str(got.value)
        assert "iteration 1" in text and f"{url}/iter_0000001" in text and "AccessDenied" in text, text
        assert "not promoted" in text and "\n" not in text
        proxy.rules()
        w.fill_(2.0)
        assert mgr.save(2)
        records = mgr.wait(persist=True)  # raised once: the next promotion commits and wait returns
        assert [r.iteration for r in records if r.tier == "persistent"] == [2]

        proxy.rules(refuse_write=["run/iter_0000003/"])
        seen = []
        with caplog.at_level(logging.ERROR, logger="datastates_megatron"):
            for it in (3, 4):
                w.fill_(float(it))
                assert mgr.save(it)
                seen += _promotion_done(mgr)  # 3's fails, then 4's commits
        assert "promoting iteration 3 from" in caplog.text and "AccessDenied" in caplog.text
        seen += mgr.wait(persist=True)  # 4 supersedes the failed 3: nothing to raise
        assert [r.iteration for r in seen if r.tier == "persistent"] == [4], seen
    finally:
        mgr.close()
    assert _manifests(proxy.client, proxy.bucket) == [2, 4]
