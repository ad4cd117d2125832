"""A tier is a boundary: the manager, the promotion and replication use a :class:`Tier` through its
methods, never its committer, lock, pool or other private parts, and never link themselves in by
setting its attributes (they subscribe with ``Tier.on_commit``).  Checked on the source (AST)."""

import ast
import pathlib

import pytest

import datastates_megatron.engine as engine

ENGINE = pathlib.Path(engine.__file__).parent
USERS = ("manager.py", "tiers/promotion.py", "tiers/replication.py")
# what a tier's user once reached for: its committer, and the links it set on the tier
FORBIDDEN = {"committer", "after_commit", "take_recycled", "guard"}
LINKS = {"promotion", "replication"}


def _tier_privates() -> set[str]:
    """Every ``_name`` the Tier class defines: its private attributes and methods."""
    tree = ast.parse((ENGINE / "tiers" / "tier.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tier")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_"):
                names.add(node.attr)
    return names - {"__init__"}


def _reach_ins(source: str, privates: set[str]) -> list[str]:
    """``line: expression`` of each access to a tier's parts through another object (``x.tier._y``,
    ``tier.committer``; a module's own ``self._y`` is its business) and each link set on one."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        own = isinstance(node.value, ast.Name) and node.value.id == "self"
        if own:
            continue
        stored = isinstance(node.ctx, ast.Store)
        if node.attr in privates or node.attr in FORBIDDEN or (stored and node.attr in LINKS):
            out.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {text}" for line, _, text in sorted(out)]


def test_the_check_sees_a_reach_in():
    privates = _tier_privates()
    assert {"_committer", "_dirlock", "_recycle", "_deleter"} <= privates
    source = (
        "tier._committer.drain(1)\n"
        "self.persistent._dirlock.check()\n"
        "self.local.committer.submit(t)\n"
        "src.promotion = self\n"
        "self._lock = None\n"  # a module's own attribute: allowed
    )
    assert _reach_ins(source, privates) == [
        "1: tier._committer",
        "2: self.persistent._dirlock",
        "3: self.local.committer",
        "4: src.promotion",
    ]


@pytest.mark.parametrize("module", USERS)
def test_tier_users_use_its_methods_only(module):
    found = _reach_ins((ENGINE / module).read_text(), _tier_privates())
    assert found == [], f"{module} reaches into a Tier: {found}"
