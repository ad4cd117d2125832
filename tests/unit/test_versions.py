"""The table of tested Megatron-LM versions, and everything that must agree with it: the README's
compatibility matrix, the ``[megatron]`` extra, the packaged patches, the trees CI unpacks, the torch
CI installs, and the glue's parameters (:mod:`datastates_megatron.megatron.megatron_lm.call_params`)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from datastates_megatron.megatron.megatron_lm import call_params, checkpointing as megatron_lm, patching, versions

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_matrix_is_the_table():
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- compatibility matrix: [^>]*-->\n(.*?)<!-- end of compatibility matrix -->", readme, re.S)
    assert m, "README.md has no compatibility matrix between its markers"
    assert m.group(1) == versions.matrix_markdown()


def test_the_megatron_extra_bounds_megatron_core_to_the_tested_series():
    extra = re.search(r"^megatron = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert versions.megatron_core_bound() in extra, extra
    assert versions.megatron_core_bound() == "megatron-core>=0.16,<0.21"


def test_every_row_has_its_patch_and_is_unpacked_by_ci_and_the_test_command():
    ci, test_sh = (REPO / ".ci" / "run").read_text(), (REPO / "scripts" / "test.sh").read_text()
    for row in versions.TESTED:
        assert patching.patch_path(row.patch).is_file(), row.patch
        arg = row.source.removeprefix("core_v")  # scripts/megatron_lm_tree.sh takes 0.16.1 or main-DATE
        for name, text in ((".ci/run", ci), ("scripts/test.sh", test_sh)):
            assert f"megatron_lm_tree.sh {arg} " in text, f"{name} does not unpack {row.source}"
            assert f"megatron_lm_tree.sh --no-patch {arg} " in text, f"{name} does not unpack an unpatched {row.source}"


def test_every_row_is_a_shipped_tarball_with_a_checksum():
    sums = REPO.parent / "shared" / "megatron-lm" / "SHA256SUMS"
    if not sums.is_file():
        pytest.skip(f"{sums} is not here")
    text = sums.read_text()
    for row in versions.TESTED:
        assert f" megatron-lm-{row.source}.tar.gz\n" in text, row.source


def test_the_table_names_the_torch_ci_installs():
    pinned = re.search(r'"torch==([0-9.]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert pinned and {row.torch for row in versions.TESTED} == {pinned.group(1)}


def test_a_tested_version_resolves_to_its_row():
    for row in versions.TESTED:
        assert versions.resolve(row.version, allow=False) is row


def test_an_untested_version_is_refused_naming_the_tested_ones(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(versions.UntestedVersionError) as e:
        versions.resolve("0.16.0")
    msg = str(e.value)
    assert msg.startswith("Megatron-LM 0.16.0 is not tested; tested versions: 0.16.1 (core_v0.16.1), ")
    assert "(to use the core_v0.16.1 patch anyway: DSM_ALLOW_UNTESTED_MEGATRON=1)" in msg
    with pytest.raises(versions.UntestedVersionError) as e:
        versions.resolve("0.12.0", allow=True)  # no patch of that series exists: no override offered
    assert "anyway" not in str(e.value) and "0.20.0 (main-2026-08-22)" in str(e.value)


def test_the_override_gives_an_untested_release_its_series_patch(monkeypatch):
    assert versions.resolve("0.16.0", allow=True).source == "core_v0.16.1"
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert versions.resolve("0.19.0").source == "core_v0.19.0"
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(versions.UntestedVersionError):
        versions.resolve("0.19.0")


def test_read_version(tmp_path):
    info = tmp_path / "package_info.py"
    info.write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ''\n__version__ = '0.20.0+d98e8a6'\n")
    assert versions.read_version(info) == "0.20.0"
    info.write_text("__version__ = '0.20.0'\n")
    with pytest.raises(ValueError, match="no MAJOR/MINOR/PATCH"):
        versions.read_version(info)


@pytest.mark.parametrize(
    "glue, table",
    [(megatron_lm.save_checkpoint, call_params.SAVE), (megatron_lm.load_checkpoint, call_params.LOAD)],
    ids=["save", "load"],
)
def test_the_glue_takes_every_parameter_the_table_accounts_for(glue, table):
    """The glue has no ``**kwargs``: a parameter it is given is one of these, each with a fate."""
    params = inspect.signature(glue).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert {n for n in params if n != "args"} == set(table)
