"""``datastates-ckpt ls``, ``inspect`` and ``verify`` of a checkpoint on object storage (``s3://``, ``msc://``):
the same documents as for a directory (:mod:`.cli`), read through :mod:`.engine.storage`.

``ls`` lists the prefix once and reads each manifest (never a rank object).  ``inspect`` and
``verify`` fetch the rank objects as the store holds them, by ranged GETs, into a temporary
directory (``TMPDIR``: room for the ranks shown; ``--rank N`` takes one) and run the directory's
command there, so that both report the same problems the same way; the document names the
checkpoint by URL.
"""

from __future__ import annotations

import os
import tempfile
import time

from ..engine.errors import CheckpointError, NoCheckpointError
from ..engine.fs.safe_io import TRACKER_MAX_BYTES
from ..engine.names import TRACKER_NAME, iteration_of
from ..engine.storage import ObjectMissingError, open_storage
from .ls_rows import checkpoint_row, ls_document

__all__ = ["list_object_checkpoints", "verify_object_checkpoint", "inspect_object_checkpoint", "split_checkpoint_url"]


def split_checkpoint_url(url: str) -> tuple[str, int]:
    """``(save URL, iteration)`` of ``s3://bucket/prefix/iter_NNNNNNN``."""
    head, _, last = url.rstrip("/").rpartition("/")
    it = iteration_of(last)
    if it is None or "://" not in head:
        raise NoCheckpointError(f"{url}: not a checkpoint URL (SAVE_URL/iter_NNNNNNN)")
    return head, it


def list_object_checkpoints(save_url: str) -> dict:
    """The ``ls --json`` document of the save location ``save_url``."""
    from ..engine.storage.survey import survey_objects

    with open_storage(save_url) as st:
        found = survey_objects(st)
        now = time.time()
        foreign = found.foreign()
        rows = []
        for it in found.iterations:
            objs = found.objects[it]
            rows.append(
                checkpoint_row(
                    it,
                    st.url(f"iter_{it:07d}"),
                    size=sum(o.size for o in objs.values()),
                    files=len(objs),
                    created=None,
                    now=now,
                    manifest=found.committed.get(it),
                    error=found.damaged.get(it),
                    foreign=("torch_dist" if ".metadata" in objs else "unknown") if it in foreign else None,
                )
            )
        tracker_readable = True
        try:  # size-capped before it is fetched, as on POSIX
            tracker_text = st.read_capped(TRACKER_NAME, TRACKER_MAX_BYTES, "tracker").decode("utf-8", "replace").strip()
        except ObjectMissingError:
            tracker_text = None
        except CheckpointError as e:
            tracker_readable = False
            tracker_text = f"<unreadable: {str(e).replace(st.url(TRACKER_NAME) + ': ', '')}>"
    return ls_document(save_url, rows, found, tracker_text, tracker_readable)


def verify_object_checkpoint(url: str, verify_dir, **options) -> dict:
    """The ``verify --json`` document of the checkpoint at ``url`` (``SAVE_URL/iter_NNNNNNN``);
    ``verify_dir(path, **options)``: the directory verification (:func:`.cli.verify_checkpoint`)."""
    from ..engine.storage.survey import iter_prefix

    def check(st, m, d: str) -> dict:
        doc = verify_dir(d, **options)
        named = {r.file for r in m.ranks}
        doc["unreferenced_files"] = sorted(
            o.key.rpartition("/")[2]
            for o in st.list(iter_prefix(m.iteration))
            if o.key.endswith(".dsck") and o.key.rpartition("/")[2] not in named
        )
        return doc

    doc = _with_fetched(url, options.get("rank"), check)
    doc["checkpoint"] = url
    return doc


def inspect_object_checkpoint(url: str, inspect_dir, rank: int | None, list_tensors: bool) -> dict:
    """The ``inspect --json`` document of the checkpoint at ``url``; ``inspect_dir``:
    :func:`.cli.inspect_checkpoint`."""
    doc = _with_fetched(url, rank, lambda st, m, d: inspect_dir(d, rank, list_tensors))
    doc["checkpoint"] = url
    return doc


def _with_fetched(url: str, rank: int | None, use):
    """``use(storage, manifest, directory)`` on a temporary copy of the checkpoint at ``url``: its
    manifest and the rank objects (``rank``'s only, when given) as the store holds them."""
    from ..engine.names import MANIFEST_NAME
    from ..engine.storage.fetch import fetch_rank, read_manifest

    save_url, it = split_checkpoint_url(url)
    with open_storage(save_url) as st, tempfile.TemporaryDirectory(prefix="dsm-ckpt-") as tmp:
        try:
            m, raw = read_manifest(st, it)
        except ObjectMissingError as e:
            raise NoCheckpointError(f"{url}: no {MANIFEST_NAME}: not a committed checkpoint") from e
        d = os.path.join(tmp, f"iter_{it:07d}")
        os.mkdir(d)
        with open(os.path.join(d, MANIFEST_NAME), "wb") as f:
            f.write(raw)
        for rec in m.ranks if rank is None else [r for r in m.ranks if r.rank == rank]:
            try:
                fetch_rank(st, m, rec.rank, d, verify=False)  # as the store holds it: the check says what is wrong
            except CheckpointError:
                pass  # missing: the check reports it
        return use(st, m, d)
