"""NVRx's in-process restart (``--inprocess-restart``) on gloo CPU ranks: two adaptations.

nvidia-resiliency-ext's ``inprocess.Wrapper`` (Megatron-LM's ``--inprocess-restart``) assumes CUDA
and NCCL in two places; with :func:`install`, in this process only and without editing NVRx:

* ``inprocess.finalize.ThreadedFinalize`` runs its function in a plain thread, joined within its
  timeout (NVRx refuses to run it without an initialised CUDA device, which a CPU rank never has);
* ``inprocess.abort.AbortTorchDistributed`` first shuts down this process's gloo connections (each
  TCP socket to a peer that is not a connection to one of the job's c10d stores), then destroys the
  process groups as NVRx does.  NVRx aborts NCCL communicators, which releases a collective blocked
  on a peer that will never join; ``ProcessGroupGloo.abort()`` and ``destroy_process_group`` release
  nothing while a collective waits in a socket read, so a healthy rank waited in
  ``finish_grad_sync`` for a faulty peer until NVRx's hard timeout killed it.  A socket shut down
  ends that read at once, on this rank and on the peer (``Connection closed by peer``): the blocked
  collective raises, and the wrapper's restart goes on.

The store connections kept are those to or from ``MASTER_PORT`` and the ports above it that
Megatron-LM (``+1``: the store of ``init_process_group``) and the wrapper (``+2``) use.  Anything else
this process holds over TCP is cut on an abort: meant for CPU test runs, where nothing else is.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

__all__ = ["STORE_PORTS_ABOVE_MASTER", "gloo_connections", "install", "shut_down_gloo_connections"]

log = logging.getLogger(__name__)

STORE_PORTS_ABOVE_MASTER = 2  # MASTER_PORT + 1 (Megatron-LM's store), + 2 (the wrapper's store)


def _store_ports() -> set[int]:
    master = int(os.environ.get("MASTER_PORT", "0"))
    return {master + k for k in range(STORE_PORTS_ABOVE_MASTER + 1)} if master else set()


def gloo_connections() -> list[int]:
    """File descriptors of this process's established TCP connections that are not store ones."""
    import psutil

    stores = _store_ports()
    fds = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or c.fd < 0 or not c.raddr:
            continue
        if c.laddr.port in stores or c.raddr.port in stores:
            continue
        fds.append(c.fd)
    return fds


def shut_down_gloo_connections() -> int:
    """Shut down (both ways) every gloo connection of this process; returns how many.  The
    descriptors stay open (gloo owns and closes them); only their traffic ends."""
    count = 0
    for fd in gloo_connections():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed since it was listed
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            s.close()  # our duplicate only
    return count


def install() -> bool:
    """Adapt NVRx's ``ThreadedFinalize`` and ``AbortTorchDistributed`` to CPU ranks (see the module
    docstring); idempotent.  False when nvidia-resiliency-ext is not installed
    (``pip install 'datastates-megatron[resiliency]'``): nothing to adapt."""
    try:
        from nvidia_resiliency_ext.inprocess import abort, exception, finalize
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("nvidia_resiliency_ext"):
            raise
        return False
    if getattr(finalize.ThreadedFinalize, "_dsm_cpu", False):
        return True

    def finalize_call(self, state):
        thread = threading.Thread(
            target=self.fn, args=self.args, kwargs=self.kwargs, name=f"ThreadedFinalize-{state.rank}", daemon=True
        )
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise exception.TimeoutError
        return state

    original_abort = abort.AbortTorchDistributed.__call__

    def abort_call(self, state):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            cut = shut_down_gloo_connections()
            log.warning("rank %s: in-process restart: %d gloo connections shut down", state.rank, cut)
        return original_abort(self, state)

    finalize.ThreadedFinalize.__call__ = finalize_call
    finalize.ThreadedFinalize._dsm_cpu = True
    abort.AbortTorchDistributed.__call__ = abort_call
    return True
