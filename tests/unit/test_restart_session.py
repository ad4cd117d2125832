"""The glue's view of an in-process restart (megatron_lm/checkpointing.py): the checkpointer of an
attempt counts as ended once ``abort()`` marked it (Megatron's AbortCheckpoint, through the runtime
hook) or once the default process group it was made under is gone (a patched tree without the
hook), and the next attempt's first save or load then retires it.  And the fault injection's spec."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from datastates_megatron.megatron.cpu import fault_injection
from datastates_megatron.megatron.megatron_lm import checkpointing as glue


@pytest.fixture
def one_rank(tmp_path):
    """A world of one over a FileStore under tmp_path; ``restart()`` rebuilds it as NVRx does."""

    def start(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)

    def restart() -> None:
        dist.destroy_process_group()
        start("attempt-1")

    start("attempt-0")
    yield restart
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_session_ends_when_aborted(one_rank, monkeypatch):
    session = glue._Session(object(), [object()], object(), object())
    monkeypatch.setattr(glue, "_session", session)
    assert not session.ended()
    glue.abort()
    assert session.ended()


def test_a_session_ends_when_the_process_groups_are_rebuilt(one_rank):
    session = glue._Session(object(), [object()], object(), object())
    assert not session.ended()
    one_rank()
    assert session.ended()


def test_abort_without_a_checkpointer_does_nothing(monkeypatch):
    monkeypatch.setattr(glue, "_session", None)
    glue.abort()


@pytest.mark.parametrize("spec, want", [("raise:5", ("raise", 5)), ("hang:1", ("hang", 1))])
def test_fault_spec(spec, want):
    assert fault_injection.parse(spec) == want


@pytest.mark.parametrize("spec", ["raise", "raise:0", "boom:3", "hang:x", ""])
def test_a_bad_fault_spec_is_named(spec):
    with pytest.raises(ValueError, match="DSM_FAULT_AT"):
        fault_injection.parse(spec)


class _Ckpt:
    rank, world_size = 0, 2

    def __init__(self):
        self.forgotten = []

    def forget_ranks(self, ranks):
        self.forgotten.append(list(ranks))


def test_an_attempts_first_load_tells_the_ended_checkpointer_who_is_gone_then_retires_it(one_rank, monkeypatch):
    """In a world of one after a restart of a world of two: rank 1 is gone, and the aborted
    attempt's checkpointer hears it before it is retired."""
    ckpt = _Ckpt()
    session = glue._Session(ckpt, [object()], object(), object())
    monkeypatch.setattr(glue, "_session", session)
    glue.abort()
    retired = []
    monkeypatch.setattr(glue, "_retire", retired.append)
    monkeypatch.setattr(glue, "validate_lazy_ckpt_args", lambda args: (_ for _ in ()).throw(RuntimeError("built")))
    args = type("Args", (), {"inprocess_restart": True})()
    with pytest.raises(RuntimeError, match="built"):  # the new checkpointer is built after the retirement
        glue._session_for(args, [object()], object(), object())
    assert ckpt.forgotten == [[1]] and retired == [session]


def test_a_fault_while_finding_who_is_gone_leaves_the_ended_checkpointer_to_the_next_attempt(one_rank, monkeypatch):
    """A second fault in the gather that finds the ranks gone: the aborted attempt's checkpointer
    is not dropped (its threads, lock and arena would leak): the next attempt retires it."""
    session = glue._Session(_Ckpt(), [object()], object(), object())
    monkeypatch.setattr(glue, "_session", session)
    glue.abort()
    monkeypatch.setattr(glue, "_ranks_gone", lambda ended: (_ for _ in ()).throw(RuntimeError("second fault")))
    args = type("Args", (), {"inprocess_restart": True})()
    with pytest.raises(RuntimeError, match="second fault"):
        glue._session_for(args, [object()], object(), object())
    assert glue._session is session and session.ended()


def test_node_in_the_local_dir_is_the_launch_ranks_node(one_rank, monkeypatch):
    """A spare launched as rank 2 (one rank per node) that an in-process restart made rank 0 keeps
    its own machine's directory; without a restart the launch rank is the rank, as before."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        local_dir: str | None

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(glue, "_LAUNCH_RANK", "2")
    assert glue._on_this_machine(Config("/shm/node{node}")).local_dir == "/shm/node2"
    monkeypatch.setattr(glue, "_LAUNCH_RANK", "0")
    assert glue._on_this_machine(Config("/shm/node{node}")).local_dir == "/shm/node0"
    assert glue._on_this_machine(Config(None)).local_dir is None
