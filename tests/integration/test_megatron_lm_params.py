"""Every parameter of the routed Megatron-LM functions is accounted for, in every tested tree.

For each tree of ``MEGATRON_LM_DIRS`` and ``MEGATRON_LM_PRISTINE_DIRS`` (read with :mod:`ast`, no
import): its version is a row of the table; each parameter of ``save_checkpoint`` /
``load_checkpoint`` is one the glue takes (:mod:`datastates_megatron.megatron.megatron_lm.call_params` says what
it does with it), so a new parameter in a Megatron-LM release fails here instead of being dropped;
and a patched tree's call of the glue passes every one of them. (The runtime hook passes every
parameter the glue takes: tests/integration/test_runtime_hook.py records what arrives.)
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from datastates_megatron.megatron.megatron_lm import call_params, checkpointing as megatron_lm, versions
from tests.integration.megatron_lm_source import ROUTED, parameters, patch_call

TREES = sorted(
    {
        d
        for var in ("MEGATRON_LM_DIRS", "MEGATRON_LM_DIR", "MEGATRON_LM_PRISTINE_DIRS")
        for d in os.environ.get(var, "").split(os.pathsep)
        if d
    }
)
TABLES = {"save_checkpoint": call_params.SAVE, "load_checkpoint": call_params.LOAD}
pytestmark = pytest.mark.skipif(not TREES, reason="no Megatron-LM tree (MEGATRON_LM_DIRS, MEGATRON_LM_PRISTINE_DIRS)")


def _id(d: str) -> str:
    return f"{Path(d).parent.name}/{Path(d).name}"


@pytest.mark.parametrize("tree", TREES, ids=_id)
def test_the_tree_is_a_tested_version(tree):
    version = versions.read_version(Path(tree, "megatron/core/package_info.py"))
    row = versions.tested(version)
    assert row is not None and row.source == Path(tree).name, (version, tree)


@pytest.mark.parametrize("name", ROUTED)
@pytest.mark.parametrize("tree", TREES, ids=_id)
def test_every_parameter_of_the_routed_function_reaches_the_glue(tree, name):
    theirs = parameters(Path(tree), name)
    unhandled = [p for p in theirs if p not in TABLES[name]]
    assert not unhandled, f"{tree}: {name} has parameters datastates_megatron does not handle: {unhandled}"
    glue = inspect.signature(getattr(megatron_lm, name)).parameters
    assert all(p in glue for p in theirs)
    # what is positional in the glue is positional, in the same order, in Megatron's function
    head = [p for p, v in glue.items() if v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert theirs[: len(head)] == head, (theirs, head)
    call = patch_call(Path(tree), name)
    if call is None:
        return  # an unpatched tree: the runtime hook routes it
    positional, keywords = call
    assert positional + keywords == theirs, f"{tree}: the patch's call of megatron_lm.{name} drops or reorders"
    assert len(positional) == len(set(positional)) and len(keywords) == len(set(keywords))
