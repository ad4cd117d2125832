"""The package as a cluster user installs it: a wheel built without warnings, installed into an
environment that already has its own torch, which it keeps; ``datastates-ckpt --help`` runs there
without importing torch.  Offline: the wheel is built without build isolation, the venv gets tiny
stand-in ``torch`` 2.8.0, numpy, numba and tqdm distributions (whose import raises: a test sees any
import) and our wheel with ``--no-deps``.  The wheel carries the launch scripts, presets and
Megatron-LM patches, ``datastates-ckpt where`` finds them installed, and without numba the CLI says
so in one line (issue 35)."""

import base64
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_TORCH = "2.8.0"
STAND_INS = {"numpy": "1.26.4", "numba": "0.60.0", "tqdm": "4.66.0"}  # the rest of our requirements


def _run(*argv, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=180, env=env, **kw)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _warnings(text: str) -> list[str]:
    # "byte-compiling is disabled" follows PYTHONDONTWRITEBYTECODE in the environment, not the package
    return [
        line
        for line in text.splitlines()
        if ("warn" in line.lower() or "deprecat" in line.lower()) and "byte-compiling is disabled" not in line
    ]


def _fake_torch_wheel(out: Path, project: str = "torch", version: str = FAKE_TORCH) -> Path:
    """A minimal ``project`` wheel: importing it raises, so a test sees any import of it."""
    dist = f"{project}-{version}.dist-info"
    files = {
        f"{project}/__init__.py": f'raise ImportError("stand-in {project} from test_packaging: must not be imported")\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_packaging\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path = out / f"{project}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Our wheel, built from a copy of the sources (the checkout gets no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)

    shutil.copytree(
        ROOT / "datastates_megatron", src / "datastates_megatron", ignore=shutil.ignore_patterns("__pycache__")
    )
    r = _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-v",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp / "dist",
        src,
    )
    assert not _warnings(r.stdout + r.stderr), _warnings(r.stdout + r.stderr)
    (whl,) = (tmp / "dist").glob("datastates_megatron-*.whl")
    return whl


def test_wheel_metadata_license_and_unpinned_torch(wheel):
    from datastates_megatron.megatron.megatron_lm import versions

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for row in versions.TESTED:
            assert f"datastates_megatron/megatron/megatron_lm/patches/{row.patch}" in names, names
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_text = z.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Author: datastates-megatron developers" in meta
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert "torch>=2.6" in requires and not any(r.startswith("torch==") for r in requires)
    assert not any(r.split(";")[0].strip().startswith("apex") for r in requires), requires
    assert any(r.startswith("megatron-core") and "<0.21" in r and ">=0.16" in r for r in requires), requires
    assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text


def _names(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_wheel_carries_launch_scripts_and_presets(wheel):
    names = _names(wheel)
    for script in ("gpu_multinode.sbatch", "gpu_per_task.sbatch", "cpu_demo.sbatch", "lib.sh", "README.md"):
        assert f"datastates_megatron/launch/{script}" in names, names
    presets = fnmatch.filter(names, "datastates_megatron/configs/*.env")
    assert {os.path.basename(p) for p in presets} == {
        p.name for p in (ROOT / "datastates_megatron/configs").glob("*.env")
    }
    assert "datastates_megatron/configs/gpt-7b-8gpu.env" in presets


def test_wheel_carries_the_megatron_lm_patches(wheel):
    """Every Megatron-LM patch of the repository ships as package data (under a ``patches``
    directory of the package), so ``apply_patches`` works from a plain install."""
    found = [*ROOT.glob("patches/*.patch"), *ROOT.glob("datastates_megatron/**/patches/*.patch")]
    patches = sorted(p.name for p in found)
    shipped = sorted(os.path.basename(n) for n in fnmatch.filter(_names(wheel), "datastates_megatron/*patches/*.patch"))
    assert patches and shipped == patches, (patches, shipped)


def test_wheel_metadata_has_version_urls_and_the_export_extra(wheel):
    from datastates_megatron import __version__

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert f"\nVersion: {__version__}\n" in meta and wheel.name.startswith(f"datastates_megatron-{__version__}-")
    urls = dict(line.split(": ", 1)[1].split(", ", 1) for line in meta.splitlines() if line.startswith("Project-URL:"))
    assert {"Paper", "DataStates-LLM"} <= set(urls) and all(u.startswith("https://") for u in urls.values())
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("psutil") and 'extra == "megatron"' in r for r in requires), requires


def test_install_keeps_the_environments_torch_and_cli_help_needs_no_torch(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", py]
    stand_ins = [_fake_torch_wheel(tmp_path)]
    stand_ins += [_fake_torch_wheel(tmp_path, n, v) for n, v in STAND_INS.items()]
    _run(*pip, "install", "--no-index", "--no-deps", *stand_ins)
    r = _run(*pip, "install", "--no-index", "--no-deps", wheel)
    assert not _warnings(r.stdout + r.stderr), r.stdout + r.stderr

    version = _run(py, "-c", "import importlib.metadata as m; print(m.version('torch'))").stdout.strip()
    assert version == FAKE_TORCH  # pip did not touch the environment's torch
    # the only unmet requirements are the ones --no-deps skipped: torch 2.8.0 satisfies ours
    check = subprocess.run([*map(str, pip), "check"], capture_output=True, text=True, timeout=120)
    assert "torch" not in check.stdout, check.stdout

    help_ = _run(venv / "bin" / "datastates-ckpt", "--help", cwd=tmp_path)
    assert "usage: datastates-ckpt" in help_.stdout and "Traceback" not in help_.stderr
    usage = subprocess.run(
        [str(venv / "bin" / "datastates-ckpt"), "verify"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert usage.returncode == 2 and "required" in usage.stderr and "Traceback" not in usage.stderr

    # the installed launch scripts and presets, where `where` says they are
    cli = venv / "bin" / "datastates-ckpt"
    launch = Path(_run(cli, "where", "launch", cwd=tmp_path).stdout.strip())
    configs = Path(_run(cli, "where", "configs", cwd=tmp_path).stdout.strip())
    assert launch.is_relative_to(venv) and (launch / "gpu_multinode.sbatch").is_file() and (launch / "lib.sh").is_file()
    assert (configs / "gpt-7b-8gpu.env").is_file()
    from datastates_megatron import __version__

    assert _run(cli, "--version", cwd=tmp_path).stdout.strip() == f"datastates-ckpt (datastates-megatron) {__version__}"

    _patch_from_the_installed_wheel(venv / "bin" / "datastates-ckpt", tmp_path)

    # without numba: one line naming it and the pip command (with the wheel's own requirement)
    _run(*pip, "uninstall", "-y", "numba")
    for argv in ([cli, "ls", tmp_path], [py, "-c", "from datastates_megatron import LazyCheckpointer"]):
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert "datastates-megatron needs numba, which is not installed" in r.stderr, r.stderr
        assert "pip install 'numba>=0.60'" in r.stderr, r.stderr


def _patch_from_the_installed_wheel(cli: Path, tmp_path: Path) -> None:
    """`datastates-ckpt patch` works from the wheel alone (no checkout, no torch): each tested
    version's patch is in it and applies to the three files it changes."""
    from datastates_megatron.megatron.megatron_lm import patching, versions

    untested = tmp_path / "mlm-0.12"
    (untested / "megatron" / "core").mkdir(parents=True)
    (untested / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 0\n")
    r = subprocess.run([str(cli), "patch", str(untested)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Megatron-LM 0.12.0 is not tested; tested versions: " in r.stderr, r.stderr
    trees = {Path(d).name: Path(d) for d in os.environ.get("MEGATRON_LM_PRISTINE_DIRS", "").split(os.pathsep) if d}
    for row in versions.TESTED:
        if row.source not in trees:
            continue  # no unpatched tree of it here (scripts/test.sh and .ci/run unpack every row)
        copy = tmp_path / row.source
        for rel in ("megatron/core/package_info.py", *patching.PATCHED_FILES):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(trees[row.source] / rel, copy / rel)
        r = subprocess.run([str(cli), "patch", str(copy)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith(f"applied: Megatron-LM {row.version} "), r.stdout + r.stderr
