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

from datastates_megatron.megatron import cpu_launch, run


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton is installed")
def test_the_triton_modules_import_and_raise_when_used(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    name = cpu_launch._TRITON_MODULES[0]
    monkeypatch.delitem(sys.modules, name, raising=False)
    cpu_launch.stub_triton_modules()
    mod = importlib.import_module(name)
    with pytest.raises(RuntimeError, match="needs triton"):
        mod.enable_batch_invariant_mode()
    assert importlib.util.find_spec("triton") is None  # torch's own probe still sees no triton
    sys.modules.pop(name, None)


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
    assert (
        e.value.code == 2
        and "is not a file" in err
        and f"-m datastates_megatron.megatron.{main.__module__.split('.')[-1]} " in err
    )


def test_a_megatron_whose_signatures_do_not_match_exits_2_with_one_line(tmp_path):
    """A stand-in Megatron-LM 0.99.0 (the fault: save_checkpoint lost its parameters): the hook
    refuses before the script runs."""
    files = {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/package_info.py": "__version__ = '0.99.0'\n",
        "megatron/training/__init__.py": "",
        "megatron/training/checkpointing.py": "def save_checkpoint(iteration, model):\n    pass\n"
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
        [sys.executable, "-m", "datastates_megatron.megatron.run", str(tmp_path / "script.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), repo]), PYTHONWARNINGS="ignore"),
    )
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(
        "error: Megatron-LM 0.99.0: megatron.training.checkpointing.save_checkpoint(iteration, model)"
    )
    assert "no parameter optimizer, opt_param_scheduler," in line and "scripts/apply_patches.sh" in line
    assert not (tmp_path / "script.py.ran").exists()
