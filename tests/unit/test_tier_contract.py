"""The tier contract (issue 42, item 3), checked on the source (AST) and on the classes:

- the contract is written down, numbered, and names every public method a tier has;
- the committer is given a spec and callbacks, never the tier (``commit.py`` neither imports nor
  holds ``Tier``), and the global-index summary travels on the save's ticket;
- behaviour follows flags, never a tier's name compared with a string;
- one place makes a rank file's name;
- the object tier is a tier (no ``objects`` seam beside it)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import os
import re

import numpy as np

import datastates_megatron.engine as engine
from datastates_megatron.engine.names import rank_file_name
from datastates_megatron.engine.storage.object_tier import ObjectTier
from datastates_megatron.engine.tiers import tier as tier_module
from datastates_megatron.engine.tiers.commit import Ticket
from datastates_megatron.engine.tiers.replica_strategy import replica_policy
from datastates_megatron.engine.tiers.retention import KeepPolicy
from datastates_megatron.engine.tiers.tier import Tier

ENGINE = pathlib.Path(engine.__file__).parent


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ENGINE)): ast.parse(p.read_text(encoding="utf-8")) for p in ENGINE.rglob("*.py")}


def _where(rel: str, node: ast.AST) -> str:
    return f"{rel}:{node.lineno}: {ast.unparse(node)}"


# ------------------------------------------------------------------ the contract, written down
def _contract_steps(doc: str) -> list[str]:
    """The numbered steps of a docstring (``1. ...``), in order."""
    return re.findall(r"^\s*(\d+)\. ", doc, flags=re.M)


def test_the_contract_is_numbered_and_names_every_public_method():
    doc = tier_module.__doc__
    steps = _contract_steps(doc)
    assert steps and steps == [str(i) for i in range(1, len(steps) + 1)], steps
    public = {
        name
        for cls in (Tier, ObjectTier)
        for name, _ in inspect.getmembers(cls)
        if not name.startswith("_") and name in cls.__dict__
    }
    public -= {"is_writer"}  # plain data: what ``writes`` says
    missing = sorted(n for n in public if f"``{n}" not in doc)
    assert not missing, f"tiers/tier.py's contract does not name {missing}"


def test_the_architecture_document_carries_the_contract():
    text = (ENGINE.parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.partition("## The tier contract")[2]
    assert section, "docs/architecture.md has no '## The tier contract' section"
    assert len(_contract_steps(section.partition("\n## ")[0])) == len(_contract_steps(tier_module.__doc__))


# ------------------------------------------------------------------ the committer is given a spec
def test_the_committer_neither_imports_nor_holds_the_tier():
    tree = _sources()["tiers/commit.py"]
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("tier"):
            bad.append(_where("tiers/commit.py", node))
        elif isinstance(node, ast.Name) and node.id in ("Tier", "ObjectTier"):
            bad.append(_where("tiers/commit.py", node))
        elif isinstance(node, ast.Attribute) and node.attr in ("tier", "objects"):
            bad.append(_where("tiers/commit.py", node))
    assert not bad, bad


def test_the_summary_travels_on_the_ticket_not_on_the_tier():
    """Nothing under engine/ sets a ``summary`` attribute (the manager once wrote ``tier.summary``
    for the committer to read); the ticket carries it."""
    bad = [
        _where(rel, node)
        for rel, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "summary" and isinstance(node.ctx, ast.Store)
    ]
    assert not bad, bad
    assert "summary" in {f.name for f in Ticket.__dataclass_fields__.values()}
    assert not hasattr(Tier("persistent", "/nonexistent", rank=0, token="t", writes=[]), "summary")


def test_no_seam_beside_the_tier():
    """``getattr(tier, "objects")``: the object tier is a :class:`Tier`, whose methods it overrides."""
    assert issubclass(ObjectTier, Tier)
    bad = [
        _where(rel, node)
        for rel, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "objects"
    ]
    assert not bad, bad


# ------------------------------------------------------------------ flags, not names
def _name_comparisons(tree: ast.Module) -> list[ast.Compare]:
    """``x.name == "..."`` (or ``!=``, ``in (...)``): a behaviour switched on a name."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
        literal = any(
            isinstance(s, ast.Constant)
            and isinstance(s.value, str)
            or isinstance(s, ast.Tuple | ast.List | ast.Set)
            and any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts)
            for s in sides
        )
        if named and literal:
            out.append(node)
    return out


def test_the_check_sees_a_name_switch():
    tree = ast.parse('a = tier.name == "local"\nb = "persistent" != self.tier.name\nc = t.name in ("x",)\nd = n == "x"')
    assert [ast.unparse(n) for n in _name_comparisons(tree)] == [
        "tier.name == 'local'",
        "'persistent' != self.tier.name",
        "t.name in ('x',)",
    ]


def test_no_behaviour_is_switched_on_a_tier_name():
    bad = [_where(rel, node) for rel, tree in _sources().items() for node in _name_comparisons(tree)]
    assert not bad, bad


# ------------------------------------------------------------------ one place names a rank file
MAKERS = {"rank_file_name", "rank_file_names", "rank_file_parts"}


def _name_makers(tree: ast.Module) -> list[tuple[ast.Call, str | None]]:
    """Each call of a rank file name maker, with the function it is made in."""
    out = []

    def visit(node: ast.AST, scope: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in MAKERS:
                    out.append((child, scope))
            visit(child, inner)

    visit(tree, None)
    return out


def test_one_place_makes_a_rank_file_name():
    """Outside ``names.py`` (the pattern), only :meth:`Ticket.file_name` makes one, and the
    records a ticket hands out (:meth:`Ticket.records`: a :class:`RankTable` of its token and
    sequence); the ranged index rebuilds, to read them, the names of a save it recorded."""
    bad = []
    for rel, tree in _sources().items():
        if rel == "names.py":
            continue
        for call, scope in _name_makers(tree):
            if rel in ("format/index_sections.py", "format/rank_table.py"):  # a save's names from its token and seq
                continue
            if not (rel == "tiers/commit.py" and scope == "file_name"):
                bad.append(_where(rel, call))
    assert not bad, bad


def test_no_token_fallback_is_left():
    """``ticket.token or token``: a ticket always carries its token."""
    bad = [
        _where(rel, node)
        for rel, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.BoolOp)
        and isinstance(node.op, ast.Or)
        and isinstance(node.values[0], ast.Attribute)
        and node.values[0].attr == "token"
    ]
    assert not bad, bad


def test_a_ticket_names_its_files():
    t = Ticket(3, 7, None, {}, 0.0, "00ab")
    assert t.file_name(5) == rank_file_name(5, "00ab", 7)
    table = t.records(2, np.zeros((3, 5), dtype=np.uint64))
    assert table.file_names() == [rank_file_name(r, "00ab", 7) for r in range(2, 5)]
    assert [r.file for r in table] == table.file_names() and table[1].rank == 3
    odd = Ticket(3, 7, None, {}, 0.0, "a%b")  # a format character in a token is not a format
    assert odd.records(0, np.zeros((1, 5), dtype=np.uint64)).file_names() == [rank_file_name(0, "a%b", 7)]


# ------------------------------------------------------------------ retention, a policy per tier
def test_the_keep_policy_keeps_the_newest_the_protected_and_the_multiples():
    order = [2, 4, 6, 8, 10, 12]  # oldest commit first
    assert KeepPolicy(2).deletions(order, set()) == [2, 4, 6, 8]
    assert KeepPolicy(2, keep_every=4).deletions(order, {6}) == [2]
    assert KeepPolicy(0).deletions(order, set()) == []  # keeps everything
    assert KeepPolicy(1).deletions([5, 3], set()) == [5]  # by commit order, not by iteration


def test_the_replica_stores_rule_is_a_policy():
    assert replica_policy(1) == KeepPolicy(2)  # never fewer than the newest two
    assert replica_policy(3) == KeepPolicy(3)
    assert replica_policy(0) == KeepPolicy(0)


def test_one_retention_loop():
    """Deciding what to delete is the policy's (``retention.py``); applying it is the tier's. No
    other module calls ``select_deletions`` or deletes a checkpoint by its own rule (the replica
    receiver once re-implemented ``Tier._retain``)."""
    bad = []
    for rel, tree in _sources().items():
        if rel in ("tiers/retention.py",):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "select_deletions":
                    bad.append(_where(rel, node))
    assert not bad, bad
    receiver = next(
        n
        for n in _sources()["tiers/replica_transport.py"].body
        if isinstance(n, ast.ClassDef) and n.name == "ReplicaReceiver"
    )
    assert "_retain" not in {n.name for n in receiver.body if isinstance(n, ast.FunctionDef)}
    calls = {ast.unparse(n.func) for n in ast.walk(receiver) if isinstance(n, ast.Call)}
    assert "delete_checkpoint" not in calls and "self.store.retain" in calls, sorted(calls)


def test_a_replica_store_applies_its_policy(tmp_path):
    """A store written outside a committer (the replica receiver's path: ``write_manifest`` then
    ``retain``) keeps what its policy says, and the protected one."""
    from datastates_megatron.engine.format.manifest import Manifest, RankRecord
    from datastates_megatron.engine.names import iter_dir

    root = str(tmp_path / "store")
    store = Tier("replica", root, rank=1, token="t", writes=[0], retention=replica_policy(1))
    store.clean()
    for seq, it in enumerate((10, 20, 30, 40)):
        os.makedirs(iter_dir(root, it))
        rec = RankRecord(0, rank_file_name(0, "t", seq), 0, 0, 0, 0, 0)
        store.write_manifest(Manifest(it, 1, "t", (rec,), {}, {}, commit_seq=seq, tier="local"))
        store.retain({it})
    assert tier_module.survey(root).order == [30, 40]
    store.retain({10})  # gone already: nothing to keep
    store.retain({40})
    assert tier_module.survey(root).order == [30, 40]


def test_a_promoted_checkpoint_has_its_global_index(tmp_path):
    """The summary rides on the save's ticket, through the node-local commit and the promotion, to the
    persistent commit that writes the global index (once read from ``tier.summary`` at commit time)."""

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.format.global_index import read_index
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.engine.names import iter_dir
    from datastates_megatron.megatron.checkpointing.reshard import index_summary

    from .test_global_index import _meta, _tensors

    persistent, local = str(tmp_path / "save"), str(tmp_path / "local")
    opts = EngineOptions(cache_bytes=1 << 20, timeout_s=30)
    with CheckpointManager(persistent, opts, keep_last=0, local_root=local, summarize=index_summary) as mgr:
        tensors = _tensors(0)
        for name, meta in _meta(0).items():
            mgr.register(name, tensors[name], meta=meta)
        mgr.save(4)
        mgr.wait()
    d = iter_dir(persistent, 4)
    assert read_index(d, read_manifest(d)) is not None, os.listdir(d)


def test_the_object_tier_applies_its_policy_itself():
    """Every deleting step a :class:`Tier` has, the object tier overrides: none of the directory's
    would act on a URL as if it were a path."""
    for name in ("_delete_by_policy", "_retain", "_retain_after", "clean", "close", "release", "acquire", "discard"):
        assert name in ObjectTier.__dict__, name


# ------------------------------------------------------------------ one drain machinery
def test_the_queue_threads_share_one_outstanding_and_drain_machinery():
    """Issue 42: ``Deleter.drain`` repeated the committer's idle/drain machinery (a lock, a
    condition and a count or dict of its own). :class:`QueueThread` keeps the outstanding items and
    drains them; a subclass makes no condition of its own to wait for them."""
    bad = []
    for rel, tree in _sources().items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if "QueueThread" not in {ast.unparse(b) for b in cls.bases}:
                continue
            for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
                if ast.unparse(call.func).split(".")[-1] == "Condition":
                    bad.append(f"{rel}: {cls.name}: {ast.unparse(call)}")
    assert not bad, bad


def test_drain_waits_for_every_item_put_and_reports_a_timeout():
    import threading

    from datastates_megatron.engine.runtime.threads import QueueThread

    gate = threading.Event()

    class Held(QueueThread):
        def _handle(self, item) -> None:
            gate.wait(30)

    q = Held("dsm-test-drain", daemon=True)
    q.put("a")
    q.put("b", key=7)
    assert not q.drain(0.2) and q._outstanding_items() == ["a", "b"]
    gate.set()
    assert q.drain(30) and q._outstanding_items() == []
    assert q.close(30)
