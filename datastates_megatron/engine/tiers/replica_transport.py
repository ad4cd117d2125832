"""Replication's transport: how a replica's bytes move between two members of a clique --
point-to-point on the clique's own gloo group, a fixed header of ints, the manifest's bytes, then
the file streamed in chunks (sent from its mapping, received into one buffer: bounded host memory)
-- and the receiving end (:class:`ReplicaReceiver`: a temp name, verified, then committed by the
replica store's tier).  Who sends to whom is :mod:`.replica_strategy`'s; when, :mod:`.replication`'s."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.file_format import FileReceipt, RankFile
from ..format.manifest import Manifest
from ..fs.durable import fsync_dir
from ..fs.safe_io import create_temp, make_dir
from ..names import PROMOTING_SUFFIX, iter_dir
from .retention import unlink_ours
from .tier import Tier, survey

__all__ = ["PairTransport", "ReplicaReceiver", "HDR", "CHUNK"]

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # one receive buffer of this size (sends go from the file's mapping): replication's memory
HDR = ("ok", "iteration", "seq", "token", "file_bytes", "manifest_bytes")


class PairTransport:
    """Point-to-point exchanges of one rank on its clique's ``group`` (one thread at a time)."""

    def __init__(self, group) -> None:
        self.group = group
        self._recv_buf = torch.empty(CHUNK, dtype=torch.uint8)

    def p2p(self, out: torch.Tensor | None, dst: int, into: torch.Tensor | None, src: int) -> None:
        import torch.distributed as dist

        req = dist.isend(out, dst, group=self.group) if out is not None else None
        if into is not None:
            dist.recv(into, src, group=self.group)
        if req is not None:
            req.wait()

    def swap_ints(self, mine: dict, dst: int, src: int) -> dict:
        out = torch.tensor([mine[f] for f in HDR], dtype=torch.int64)
        into = torch.empty(len(HDR), dtype=torch.int64)
        self.p2p(out, dst, into, src)
        return dict(zip(HDR, into.tolist()))

    def swap_bytes(self, mine: bytes, theirs: int, dst: int, src: int) -> bytes:
        out = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else None
        into = torch.empty(theirs, dtype=torch.uint8) if theirs else None
        self.p2p(out, dst, into, src)
        return into.numpy().tobytes() if into is not None else b""

    def swap_file(self, out_file, out_bytes: int, receiver, in_bytes: int, dst: int, src: int) -> None:
        """Stream both files in chunks of ``CHUNK`` (sent from the mapping, received into one buffer:
        bounded host memory)."""
        done_out = done_in = 0
        while done_out < out_bytes or done_in < in_bytes:
            n_out, n_in = min(CHUNK, out_bytes - done_out), min(CHUNK, in_bytes - done_in)
            out = into = None
            if n_out:  # straight from the file's (copy-on-write) mapping: no copy into a buffer
                out = torch.from_numpy(out_file.span(done_out, done_out + n_out))
            if n_in:
                into = self._recv_buf[:n_in]
            self.p2p(out, dst, into, src)
            if n_in:
                receiver.write(into.numpy(), done_in)
            done_out += n_out
            done_in += n_in

    def send_ints(self, hdr: dict, dst: int) -> None:
        self.p2p(torch.tensor([hdr[f] for f in HDR], dtype=torch.int64), dst, None, dst)


class ReplicaReceiver:
    """One incoming replica: written to a temp name, verified, then committed by its manifest."""

    def __init__(self, store: Tier, src: int, hdr: dict, body: bytes, rank: int) -> None:
        self.store, self.src, self.hdr, self.rank = store, src, hdr, rank
        self.error: str | None = None if hdr["ok"] else f"rank {src} had no file to send"
        self.fd = None
        self.manifest = self.record = None
        if self.error is None:
            try:
                self.manifest = Manifest.from_json(body, f"<manifest sent by rank {src}>")
                self.record = self.manifest.record(src)
                if self.record is None or self.record.file_bytes != hdr["file_bytes"]:
                    raise CorruptCheckpointError(f"rank {src}'s manifest does not describe the file it sends")
                d = iter_dir(store.root, self.manifest.iteration)
                make_dir(d)
                self.path = os.path.join(d, self.record.file)
                self.tmp = self.path + PROMOTING_SUFFIX
                self.fd = create_temp(self.tmp)
            except (CheckpointError, OSError) as e:
                self.error = str(e)

    def write(self, data: np.ndarray, offset: int) -> None:
        if self.fd is None:
            return
        try:
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            self.error = f"writing {self.tmp}: {e}"
            self._drop()

    def abort(self) -> None:
        """The transfer broke off: close and remove the temp file (ours, created ``O_EXCL``)."""
        self._drop()
        if getattr(self, "tmp", None):
            unlink_ours(self.tmp)

    def _drop(self) -> None:
        """Stop writing (the rest of the transfer is still received, to stay in step)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def commit(self) -> bool:
        """Verify and commit the replica (through the store's :meth:`.tier.Tier.write_manifest`);
        then the store applies its retention (:meth:`.tier.Tier.retain`), keeping this one."""
        if self.error is None:
            try:
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = None
                self._verify()
                os.replace(self.tmp, self.path)
                fsync_dir(os.path.dirname(self.path))
                # ordered in this store by arrival (= the source's commit order), not by the source
                # node's commit count, which restarts on a replaced node
                newest = max((m.commit_seq for m in survey(self.store.root).committed.values()), default=-1)
                m = dataclasses.replace(self.manifest, ranks=(self.record,), tier="local", commit_seq=newest + 1)
                self.store.write_manifest(m)
            except (CheckpointError, OSError) as e:
                self.error = str(e)
        if self.error is not None:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            if getattr(self, "tmp", None):
                unlink_ours(self.tmp)  # ours (created O_EXCL above); a planted link is left alone
            log.error("rank %d: replica of rank %d not committed: %s", self.rank, self.src, self.error)
            return False
        self.store.retain({self.manifest.iteration})
        return True

    def _verify(self) -> None:
        with RankFile(self.tmp) as rf:
            got = FileReceipt.of(rf.header, rf.verify_all(), 0, self.tmp)
        r = self.record
        if (got.file_bytes, got.n_tensors, got.index_xxh64, got.header_xxh64, got.data_bytes) != (
            r.file_bytes,
            r.n_tensors,
            r.index_xxh64,
            r.header_xxh64,
            r.data_bytes,
        ):
            raise CorruptCheckpointError(f"{self.tmp}: received file does not match rank {self.src}'s manifest record")
