"""What a save prefix on object storage holds, from one listing: committed checkpoints (their
manifest reads back), damaged ones (a manifest that does not), our leftovers, and what is not ours.

The object-storage counterpart of :func:`..tiers.tier.survey`, with the same rules: a checkpoint exists
only when its manifest exists and reads back; ``iter_NNNNNNN/`` keys without one are our leftovers
when every name is one we write (:mod:`..names`), else not ours (never deleted).  Manifests are
cached by key and tag, so retention's survey at every commit reads only the new one.

Thread-safety: a :class:`ManifestCache` may be shared by the commit and deleter threads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from ..format.manifest import Manifest
from ..fs.safe_io import MANIFEST_MAX_BYTES
from ..names import MANIFEST_NAME, iteration_of
from ..names import is_ours_in_iteration
from .base import ObjectInfo, ObjectMissingError, Storage

__all__ = ["ObjectSurvey", "ManifestCache", "survey_objects", "survey_committed", "manifest_key", "iter_prefix"]

log = logging.getLogger(__name__)


def iter_prefix(iteration: int) -> str:
    return f"iter_{iteration:07d}/"


def manifest_key(iteration: int) -> str:
    return iter_prefix(iteration) + MANIFEST_NAME


@dataclasses.dataclass(frozen=True)
class ObjectSurvey:
    url: str
    objects: dict[int, dict[str, ObjectInfo]]  # iteration -> {name: info} under iter_NNNNNNN/
    committed: dict[int, Manifest]
    damaged: dict[int, CheckpointError]
    others: tuple[str, ...]  # keys at the root (tracker, lock, foreign objects)

    @property
    def iterations(self) -> tuple[int, ...]:
        return tuple(sorted(self.objects))

    @property
    def order(self) -> list[int]:
        """Committed iterations, oldest commit first (as :attr:`..tiers.tier.Survey.order`)."""
        return sorted(self.committed, key=lambda it: (self.committed[it].commit_seq, it))

    @property
    def newest(self) -> int | None:
        return max(self.committed, key=lambda it: (self.committed[it].commit_seq, it), default=None)

    def latest(self) -> int:
        """The latest committed iteration; a damaged manifest of a higher iteration raises (it may
        hide a newer commit), an older one is logged and skipped."""
        newest = self.newest
        blocking = {it: e for it, e in self.damaged.items() if newest is None or it > newest}
        for it, err in self.damaged.items():
            if it not in blocking:
                log.warning("%s%s: skipped (older than iteration %s): %s", self.url, iter_prefix(it), newest, err)
        if blocking:
            first = blocking[min(blocking)]
            raise type(first)(f"{first} (pass an explicit iteration to load another checkpoint)") from None
        if newest is None:
            raise NoCheckpointError(f"{self.url}: no committed checkpoint (no iter_*/{MANIFEST_NAME})")
        return newest

    def leftovers(self) -> list[int]:
        """Iterations without a manifest whose every object is a name we write."""
        return [
            it
            for it, names in sorted(self.objects.items())
            if it not in self.committed and it not in self.damaged and all(is_ours_in_iteration(n) for n in names)
        ]

    def strays(self, iteration: int) -> list[str]:
        """Names under committed ``iteration`` that we write and its manifest does not name."""
        from ..names import INDEX_NAME

        named = {MANIFEST_NAME, INDEX_NAME, *self.committed[iteration].file_names()}
        return [n for n in self.objects.get(iteration, {}) if n not in named and is_ours_in_iteration(n)]

    def foreign(self) -> dict[int, list[str]]:
        """Iterations holding objects we did not write and no manifest of ours."""
        return {
            it: [n for n in names if not is_ours_in_iteration(n)]
            for it, names in sorted(self.objects.items())
            if it not in self.committed and it not in self.damaged and not all(map(is_ours_in_iteration, names))
        }


class ManifestCache:
    """Parsed manifests by ``(key, tag)``: an unchanged manifest is not read again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, tuple[str, Manifest]] = {}

    def remember(self, key: str, etag: str, manifest: Manifest) -> None:
        with self._lock:
            self._by_key[key] = (etag, manifest)

    def read(self, storage: Storage, info: ObjectInfo) -> Manifest:
        with self._lock:
            got = self._by_key.get(info.key)
        if got is not None and got[0] == info.etag:
            return got[1]
        raw = storage.read_capped(info.key, MANIFEST_MAX_BYTES, "manifest", info.size)  # sized by the listing
        m = Manifest.from_json(raw, storage.url(info.key))
        self.remember(info.key, info.etag, m)
        return m

    def keep_only(self, keys: set[str]) -> None:
        with self._lock:
            for k in [k for k in self._by_key if k not in keys]:
                del self._by_key[k]


def survey_objects(storage: Storage, cache: ManifestCache | None = None) -> ObjectSurvey:
    """One listing of ``storage``'s root, every manifest validated (O(objects) per call)."""
    cache = cache or ManifestCache()
    objects: dict[int, dict[str, ObjectInfo]] = {}
    others = []
    for info in storage.list():
        head, sep, name = info.key.partition("/")
        it = iteration_of(head) if sep else None
        if it is None or "/" in name:
            others.append(info.key)
            continue
        objects.setdefault(it, {})[name] = info
    committed, damaged = {}, {}
    for it, names in objects.items():
        info = names.get(MANIFEST_NAME)
        if info is None:
            continue
        try:
            m = cache.read(storage, info)
        except ObjectMissingError:  # deleted since the listing (our retention, an operator)
            continue
        except CheckpointError as e:
            damaged[it] = type(e)(str(e))
            continue
        if m.iteration != it:
            damaged[it] = CorruptCheckpointError(f"{storage.url(info.key)}: manifest is for iteration {m.iteration}")
            continue
        committed[it] = m
    cache.keep_only({manifest_key(it) for it in committed})
    return ObjectSurvey(storage.url() + "/", objects, committed, damaged, tuple(others))


def survey_committed(storage: Storage, cache: ManifestCache) -> ObjectSurvey:
    """What retention needs at each commit, without listing every rank object: the ``iter_*``
    prefixes (one delimited listing), a HEAD of each one's manifest (read only when its tag is new).
    ``objects`` then holds each iteration's manifest alone; list an iteration's objects
    (:meth:`.base.Storage.list`) before deleting or cleaning it."""
    objects: dict[int, dict[str, ObjectInfo]] = {}
    committed, damaged = {}, {}
    for name in storage.list_dirs():
        it = iteration_of(name)
        if it is None:
            continue
        info = storage.head(manifest_key(it))
        objects[it] = {} if info is None else {MANIFEST_NAME: info}
        if info is None:
            continue
        try:
            m = cache.read(storage, info)
        except ObjectMissingError:
            continue
        except CheckpointError as e:
            damaged[it] = type(e)(str(e))
            continue
        committed[it] = m
    cache.keep_only({manifest_key(it) for it in committed})
    return ObjectSurvey(storage.url() + "/", objects, committed, damaged, ())
