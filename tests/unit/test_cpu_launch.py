"""cpu_launch's and run's pieces that need no Megatron-LM: the triton stand-in, the python3 tools on
PATH and the usage errors (the launcher itself runs in tests/integration/test_pretrain_gpt.py and
test_runtime_hook.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig

import pytest

from datastates_megatron.megatron.cpu import launch as cpu_launch
from datastates_megatron.megatron.megatron_lm import run, versions


def _stood_in(tmp_path, source: str):
    (tmp_path / "kernels.py").write_text(source)
    spec = cpu_launch._TritonFreeStub().find_spec("megatron.kernels", [str(tmp_path)])
    return None if spec is None else importlib.util.module_from_spec(spec)


@pytest.mark.parametrize(
    "top",
    [
        "import triton\n",
        "import triton.language as tl\n",
        "from triton import jit\n",
        "from triton.language import x\n",
    ],
)
def test_a_megatron_module_importing_triton_at_its_top_level_is_stood_in(tmp_path, top):
    mod = _stood_in(tmp_path, f"import torch\n{top}\n@triton.jit\ndef kernel(x):\n    pass\n")
    assert mod is not None and mod.__spec__.origin == str(tmp_path / "kernels.py")
    with pytest.raises(RuntimeError, match="megatron.kernels.kernel needs triton"):
        mod.kernel()


@pytest.mark.parametrize(
    "source",
    [
        "try:\n    import triton\nexcept ImportError:\n    triton = None\n",
        "def f():\n    import triton\n",
        "import tritonclient\n# import triton\n",
    ],
)
def test_a_module_that_guards_or_defers_its_triton_import_is_left_alone(tmp_path, source):
    assert _stood_in(tmp_path, source) is None


def test_modules_outside_megatron_are_left_alone(tmp_path):
    (tmp_path / "kernels.py").write_text("import triton\n")
    assert cpu_launch._TritonFreeStub().find_spec("kernels", [str(tmp_path)]) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton is installed")
def test_stub_triton_modules_installs_one_finder_and_leaves_triton_absent(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    cpu_launch.stub_triton_modules()
    cpu_launch.stub_triton_modules()
    assert sum(isinstance(f, cpu_launch._TritonFreeStub) for f in sys.meta_path) == 1
    assert importlib.util.find_spec("triton") is None  # torch's own probe still sees no triton


def test_python_tools_on_path_are_this_interpreter(monkeypatch):
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    tools = run._python_on_path()
    try:
        assert os.environ["PATH"].split(os.pathsep)[0] == tools
        config = subprocess.run(["python3-config", "--extension-suffix"], capture_output=True, text=True, check=True)
        assert config.stdout.strip() == sysconfig.get_config_var("EXT_SUFFIX")
        exe = subprocess.run(
            ["python3", "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True
        )
        assert exe.stdout.strip() == sys.prefix  # a venv's python keeps its site-packages
    finally:
        for name in os.listdir(tools):
            os.unlink(os.path.join(tools, name))
        os.rmdir(tools)


@pytest.mark.parametrize("main", [cpu_launch.main, run.main], ids=["cpu_launch", "run"])
def test_usage_errors_exit_2(tmp_path, capsys, main):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing.py")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a file" in err and f"-m {main.__module__} " in err


def _run_fake_megatron(tmp_path, package_info: str, save_signature: str, warned: str | None = None, **env) -> str:
    """Run a script through ``run`` over a stand-in Megatron-LM; returns its error line (exit 2).
    ``warned``: the untested version the override routes (warned about first), if any."""
    files = {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/package_info.py": package_info,
        "megatron/training/__init__.py": "",
        "megatron/training/checkpointing.py": f"def save_checkpoint({save_signature}):\n    pass\n"
        "def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True,\n"
        "                    checkpointing_context=None, skip_load_to_model_and_opt=False):\n    pass\n",
        "megatron/training/async_utils.py": "def maybe_finalize_async_save(blocking=False, terminate=False):\n    pass\n",
        "megatron/training/arguments.py": "def parse_args(extra_args_provider=None, ignore_unknown_args=False):\n    pass\n",
        "script.py": "open(__file__ + '.ran', 'w').close()\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(
        [sys.executable, "-m", "datastates_megatron.megatron.megatron_lm.run", str(tmp_path / "script.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), repo]), PYTHONWARNINGS="ignore", **env),
    )
    assert res.returncode == 2, res.stderr
    assert not (tmp_path / "script.py.ran").exists()
    *warnings, line = res.stderr.strip().splitlines()
    assert [w.split(" with ")[0] for w in warnings] == ([f"Megatron-LM {warned} is not tested"] if warned else [])
    return line


_FULL_SAVE = "iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far"


def test_a_megatron_whose_signatures_do_not_match_exits_2_with_one_line(tmp_path):
    """A stand-in Megatron-LM 0.16.9 (of a tested series), routed with the override (the fault:
    save_checkpoint lost its parameters): the hook refuses before the script runs."""
    line = _run_fake_megatron(
        tmp_path, "__version__ = '0.16.9'\n", "iteration, model", warned="0.16.9", DSM_ALLOW_UNTESTED_MEGATRON="1"
    )
    assert line.startswith(
        "error: Megatron-LM 0.16.9: megatron.training.checkpointing.save_checkpoint(iteration, model)"
    )
    assert "no parameter optimizer, opt_param_scheduler," in line and "scripts/apply_patches.sh" in line


@pytest.mark.parametrize(
    "package_info",
    ["MAJOR = 0\nMINOR = 21\nPATCH = 3\n__version__ = '0.21.3+abc123'\n", "__version__ = '0.21.3+abc123'\n"],
    ids=["fields", "version-string"],
)
def test_an_untested_megatron_is_refused_with_one_line_naming_the_tested_ones(tmp_path, package_info):
    """0.21 is no tested series: refused even with the override (as the patch is), which is not offered."""
    for override in ("0", "1"):
        line = _run_fake_megatron(tmp_path, package_info, _FULL_SAVE, DSM_ALLOW_UNTESTED_MEGATRON=override)
        assert line.startswith("error: Megatron-LM 0.21.3 is not tested with the datastates_megatron runtime hook")
        for row in versions.TESTED:
            assert f"{row.version} ({row.source})" in line
        assert "no tested version of its 0.21 series" in line and "ALLOW_UNTESTED" not in line


def test_the_hook_routes_by_the_patchs_rule():
    """``hook._check_version`` accepts exactly the versions ``versions.resolve`` gives a patch, with
    and without the override (it once routed any version with the override)."""
    from datastates_megatron.megatron.megatron_lm import hook

    rows = [r.version for r in versions.TESTED]
    series = sorted({".".join(v.split(".")[:2]) for v in rows})
    candidates = rows + [f"{s}.99" for s in series] + ["0.12.0", "0.99.0", "1.0.0", "(unknown version)"]
    for allow in (False, True):
        for version in candidates:
            try:
                versions.resolve(version, allow=allow)
                expected = True
            except versions.UntestedVersionError:
                expected = False
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(hook, "_version_triple", lambda v=version: v)
                mp.setenv(versions.ALLOW_UNTESTED_ENV, "1" if allow else "0")
                try:
                    hook._check_version()
                    routed = True
                except hook.HookError as e:
                    routed = False
                    offered = "to route it anyway" in str(e)
                    assert version in str(e) and offered == (".".join(version.split(".")[:2]) in series)
            assert routed == expected, (version, allow, routed)
