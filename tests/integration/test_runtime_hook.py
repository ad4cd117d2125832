"""The runtime hook (:mod:`datastates_megatron.megatron.hook`, :mod:`~datastates_megatron.megatron.run`)
on Megatron-LM trees that do NOT carry our patch.

Part 1 (``MEGATRON_LM_DIRS``/``MEGATRON_LM_DIR``): ``megatron/`` of each tree is copied and the
patch reverted; in a subprocess the hook is installed and Megatron's own ``parse_args`` takes and
validates the ``--lazy-ckpt`` flags, and the names ``megatron.training.training`` imported
(``save_checkpoint``, ``load_checkpoint``, ``maybe_finalize_async_save``) reach the glue with the
arguments the patch passes. The patched tree itself is left alone by the hook. A signature
mismatch and a partly patched tree are refused before anything is replaced.

Part 2 (``MEGATRON_LM_PRISTINE_DIRS``: unpatched trees, set by scripts/test.sh and .ci/run with
``scripts/megatron_lm_tree.sh --no-patch``): the real ``pretrain_gpt.py`` of each tree trains and
saves through ``cpu_launch`` (the CPU shim + the hook), then a second run resumes from an older
checkpoint and trains on to the bit as the first did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.megatron_lm_runs import LAZY, assert_same_training, latest, launch
from tests.integration.megatron_lm_source import parameters

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_patches.sh"
TIMEOUT_S = 300


def _dirs(var: str, fallback: str | None = None) -> list[str]:
    value = os.environ.get(var) or (os.environ.get(fallback) if fallback else None) or ""
    return [d for d in value.split(os.pathsep) if d]


TREES = _dirs("MEGATRON_LM_DIRS", "MEGATRON_LM_DIR")
PRISTINE = _dirs("MEGATRON_LM_PRISTINE_DIRS")
PATCHED_FILES = (
    "megatron/training/arguments.py",
    "megatron/training/checkpointing.py",
    "megatron/training/async_utils.py",
)


def _name(d: str | None) -> str:
    return os.path.basename(d.rstrip("/")) if d else "none"


# Runs in a Megatron-LM copy: python driver.py TMP MODE... ; each mode runs in a forked child (one
# Megatron import for all, no shared state) and writes TMP/MODE.json.
DRIVER = r"""
import json, os, sys, traceback
from datastates_megatron.megatron import cpu_launch, hook, megatron_lm

MARK = "__datastates_megatron_hook__"


def hooked(fn):
    return bool(getattr(fn, MARK, False))


def binding_sites(out):
    import megatron.training.arguments as arguments, megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as checkpointing, megatron.training.initialize as initialize
    import megatron.training.training as training
    sites = {
        "checkpointing.save_checkpoint": checkpointing.save_checkpoint,
        "checkpointing.load_checkpoint": checkpointing.load_checkpoint,
        "async_utils.maybe_finalize_async_save": async_utils.maybe_finalize_async_save,
        "arguments.parse_args": arguments.parse_args,
        "training.save_checkpoint": training.save_checkpoint,
        "training.load_checkpoint": training.load_checkpoint,
        "training.maybe_finalize_async_save": training.maybe_finalize_async_save,
    }
    if hasattr(initialize, "parse_args"):  # core_v0.16; core_v0.19 calls arguments.parse_args
        sites["initialize.parse_args"] = initialize.parse_args
    out["sites"] = {k: hooked(v) for k, v in sites.items()}
    out["wrapped_once"] = not any(hooked(getattr(v, "__wrapped__", None)) for v in sites.values())


def route(out):
    out["install"] = [hook.install(), hook.install()]
    binding_sites(out)
    import megatron.training.arguments as arguments, megatron.training.training as training
    from megatron.training.global_vars import set_args
    from datastates_megatron.megatron.args import LazyCkptArgsError
    base = ["pretrain", "--save", tmp + "/s", "--load", tmp + "/s",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]

    def mine(parser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    sys.argv = [*base, "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "3", "--my-flag", "7"]
    args = arguments.parse_args(extra_args_provider=mine)
    out["parsed"] = [args.lazy_ckpt, args.lazy_ckpt_host_cache_gb, args.my_flag]
    sys.argv = [*base, "--lazy-ckpt", "--async-save"]
    try:
        arguments.parse_args()
        out["validated"] = None
    except LazyCkptArgsError as e:
        out["validated"] = str(e)
    sys.argv = [*base, "--lazy-ckpt"]
    args = arguments.parse_args()
    set_args(args)
    model, opt, sched = [object()], object(), object()
    calls = []

    def save(*a, **k):
        calls.append(["save", a[0], a[1] is model, a[2] is opt, a[3] is sched, a[4], sorted(k)])

    def load(*a, **k):
        calls.append(["load", a[0] is model, a[1] is opt, a[2] is sched, sorted(k)])
        return 100, 12.5

    def fin(blocking=False, terminate=False):
        calls.append(["finalize", blocking, terminate])

    megatron_lm.save_checkpoint, megatron_lm.load_checkpoint, megatron_lm.maybe_finalize = save, load, fin
    training.save_checkpoint(100, model, opt, sched, 12.5, None)
    out["load_returned"] = list(training.load_checkpoint(model, opt, sched))
    training.maybe_finalize_async_save(blocking=False)
    training.maybe_finalize_async_save(blocking=True, terminate=True)
    args.lazy_ckpt = False
    training.maybe_finalize_async_save(blocking=True, terminate=True)  # Megatron's own: no call
    out["calls"] = calls


def refuse(out):
    import megatron.training.checkpointing as checkpointing, megatron.training.async_utils as async_utils
    original_save, original_fin = checkpointing.save_checkpoint, async_utils.maybe_finalize_async_save

    def save_checkpoint(iteration, model, optimizer, num_floating_point_operations_so_far,
                        checkpointing_context=None, non_persistent_ckpt=False, train_data_iterator=None):
        pass

    def new_required(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                     checkpointing_context, must, non_persistent_ckpt=False, train_data_iterator=None, release=False):
        pass

    namespace = {}
    exec("def maybe_finalize_async_save(blocking=False, terminate=False):\n"
         "    from datastates_megatron.megatron import megatron_lm\n", namespace)
    errors = []
    for attr, fake in (("save", save_checkpoint), ("save", new_required),
                       ("fin", namespace["maybe_finalize_async_save"])):
        if attr == "save":
            checkpointing.save_checkpoint = fake
        else:
            async_utils.maybe_finalize_async_save = fake
        try:
            hook.install()
            errors.append(None)
        except hook.HookError as e:
            errors.append(str(e))
        checkpointing.save_checkpoint, async_utils.maybe_finalize_async_save = original_save, original_fin
    out["errors"] = errors
    out["version"] = hook.megatron_lm_version()
    binding_sites(out)


def newparam(out):  # a newer Megatron-LM: save_checkpoint has an optional parameter the glue does not take
    import megatron.training.arguments as arguments, megatron.training.checkpointing as checkpointing
    from megatron.training.global_vars import set_args

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, future_knob=None, release=False):
        pass

    checkpointing.save_checkpoint = save_checkpoint
    out["install"] = hook.install()
    sys.argv = ["pretrain", "--save", tmp + "/s", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--lazy-ckpt"]
    set_args(arguments.parse_args())  # the hook's parse_args: it adds --lazy-ckpt
    calls = []
    megatron_lm.save_checkpoint = lambda *a, **k: calls.append([len(a), sorted(k)])
    checkpointing.save_checkpoint(100, None, None, None, 0, None)  # the default: nothing to lose
    try:
        checkpointing.save_checkpoint(100, None, None, None, 0, None, future_knob=3)
        out["refused"] = None
    except hook.HookError as e:
        out["refused"] = str(e)
    out["calls"] = calls


def patched(out):
    out["install"] = hook.install()
    binding_sites(out)


cpu_launch.prepare()  # typing.override on Python 3.11, no triton: what the launcher does
import megatron.training.arguments, megatron.training.checkpointing, megatron.training.async_utils  # noqa
tmp = sys.argv[1]
for mode in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        out = {}
        try:
            {"route": route, "refuse": refuse, "newparam": newparam, "patched": patched}[mode](out)
            payload = {"out": out}
        except BaseException:
            payload = {"error": traceback.format_exc()}
        with open(os.path.join(tmp, mode + ".json"), "w") as f:
            json.dump(payload, f)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def _apply(where: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(APPLY), str(where), *extra], capture_output=True, text=True, timeout=120)


def _drive(tree: Path, tmp: Path, *modes: str) -> dict[str, dict]:
    """Run ``modes`` in one driver process in ``tree``: {mode: its ``out``} (a failed mode fails the test)."""
    tmp.mkdir(parents=True, exist_ok=True)
    driver = tmp / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"
    )
    proc = subprocess.run(
        [sys.executable, str(driver), str(tmp), *modes],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    results = {}
    for mode in modes:
        path = tmp / f"{mode}.json"
        assert path.exists(), f"driver rc={proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        got = json.loads(path.read_text())
        assert "error" not in got, f"driver {mode} failed:\n{got['error']}"
        results[mode] = got["out"]
    return results


@pytest.fixture(scope="module", params=TREES or [None], ids=_name)
def unpatched_copy(request, tmp_path_factory):
    """``megatron/`` of one tree, copied with our patch reverted (the tree itself is not touched)."""
    if request.param is None:
        pytest.skip("MEGATRON_LM_DIR(S) is not set (scripts/test.sh unpacks trees from ../shared/megatron-lm)")
    copy = tmp_path_factory.mktemp("unpatched")
    shutil.copytree(
        Path(request.param) / "megatron",
        copy / "megatron",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"),
    )
    if _apply(copy, "--check").stdout.startswith("already applied:"):
        assert _apply(copy, "--revert").returncode == 0
    for rel in PATCHED_FILES:
        assert "datastates_megatron" not in (copy / rel).read_text(), rel
    return Path(request.param), copy


@pytest.fixture(scope="module")
def driven(unpatched_copy, tmp_path_factory):
    _, copy = unpatched_copy
    return _drive(copy, tmp_path_factory.mktemp("driver"), "route", "refuse", "newparam")


def test_the_hook_routes_an_unpatched_tree(driven, unpatched_copy):
    out = driven["route"]
    _, copy = unpatched_copy
    save_kw = sorted(parameters(copy, "save_checkpoint")[6:])  # every one: call_params says what each does
    load_kw = sorted(parameters(copy, "load_checkpoint")[3:])
    assert out["install"] == ["hooked", "already"]
    assert all(out["sites"].values()), out["sites"]
    assert out["wrapped_once"]
    assert out["parsed"] == [True, 3.0, 7]  # our flags and the caller's extra_args_provider
    assert "--lazy-ckpt cannot be combined with --async-save" in out["validated"]
    assert out["load_returned"] == [100, 12.5]
    assert out["calls"] == [  # what the patch passes (tests/integration/test_megatron_lm_patch.py)
        ["save", 100, True, True, True, 12.5, save_kw],
        ["load", True, True, True, load_kw],
        ["finalize", False, False],
        ["finalize", True, True],
    ]


def test_a_mismatch_or_a_partial_patch_is_refused_before_anything_is_replaced(driven):
    out = driven["refuse"]
    missing, required, partial = out["errors"]
    where = f"Megatron-LM {out['version']}: megatron.training.checkpointing.save_checkpoint("
    assert missing.startswith(where) and "(no parameter opt_param_scheduler)" in missing and "\n" not in missing
    assert required.startswith(where) and "new required parameter must" in required, required
    assert "partly patched (megatron.training.async_utils.maybe_finalize_async_save only)" in partial, partial
    assert not any(out["sites"].values()), out["sites"]


def test_a_new_optional_parameter_is_refused_when_given_never_dropped(driven):
    out = driven["newparam"]
    assert out["install"] == "hooked"
    assert out["calls"] == [[6, ["release"]]]  # future_knob at its default: not passed, nothing lost
    assert "save_checkpoint was called with future_knob, which --lazy-ckpt does not handle" in out["refused"]
    assert "tested Megatron-LM (0.16.1 (core_v0.16.1)" in out["refused"]


def test_a_patched_tree_is_left_alone(unpatched_copy, tmp_path):
    tree, _ = unpatched_copy
    if _apply(tree, "--check").stdout.startswith("applies cleanly:"):
        pytest.skip(f"{tree} is not patched")
    out = _drive(tree, tmp_path, "patched")["patched"]
    assert out["install"] == "patched"
    assert not any(out["sites"].values()), out["sites"]


# --------------------------------------------------------------------------- #
# part 2: the real pretrain_gpt.py of an unpatched tree, trained, saved and resumed
# --------------------------------------------------------------------------- #
ITERS = 6


@pytest.mark.parametrize("tree", PRISTINE or [None], ids=_name)
def test_pretrain_gpt_of_an_unpatched_tree_saves_and_resumes(tmp_path, tree):
    if tree is None:
        pytest.skip("MEGATRON_LM_PRISTINE_DIRS is not set (scripts/megatron_lm_tree.sh --no-patch)")
    for rel in PATCHED_FILES:
        assert "datastates_megatron" not in Path(tree, rel).read_text(), f"{tree}/{rel} is patched"
    save = tmp_path / "ckpt"
    args = ["--train-iters", str(ITERS), "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY]
    first = launch(tmp_path, "first", args, nproc=1, megatron_lm_dir=tree)
    assert first.returncode == 0, first.describe()
    assert "checkpointing routed by the datastates_megatron runtime hook" in first.log, first.describe()
    assert "scheduled lazy checkpoint of iteration 4" in first.log and latest(save) == ITERS
    resumed = launch(tmp_path, "resumed", [*args, "--ckpt-step", "4"], nproc=1, megatron_lm_dir=tree)
    assert resumed.returncode == 0, resumed.describe()
    assert "loaded lazy checkpoint of iteration 4" in resumed.log, resumed.describe()
    assert_same_training(resumed, first, range(5, ITERS + 1), ranks=1)
