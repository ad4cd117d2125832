"""The tests' one Megatron-LM driver: named modes run inside a copy of a Megatron-LM tree, in one
subprocess (Megatron imported once, most of a subprocess's time), each in a forked child of its own
(no state shared), each writing its ``out`` dict.  Also the tree helpers around it:
:func:`apply_patches` (scripts/apply_patches.sh) and :func:`copy_megatron`.

Modes for tests/integration/test_megatron_lm_patch.py (a patched copy): ``without-package``,
``parse``, ``validate``, ``route``, ``glue``.  Modes for tests/integration/test_runtime_hook.py (an
unpatched copy, the runtime hook installed): ``hook-route``, ``hook-refuse``, ``hook-newparam``,
``hook-patched``.

In the subprocess: ``python megatron_lm_driver.py PREPARE JOBS_JSON``, ``JOBS = [[mode, tmp,
out_json, *extra], ...]``.  Nothing of datastates_megatron is imported at module level:
``without-package`` imports Megatron with the package hidden."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_patches.sh"
TIMEOUT_S = 300


def apply_patches(where: Path, *extra: str) -> subprocess.CompletedProcess:
    """``scripts/apply_patches.sh where *extra`` (``--check``, ``--revert``, ...)."""
    return subprocess.run(["bash", str(APPLY), str(where), *extra], capture_output=True, text=True, timeout=120)


def copy_megatron(tree, copy: Path) -> None:
    """``megatron/`` of ``tree`` copied to ``copy/megatron``, our patch reverted when it carries it
    (``tree`` itself is not touched)."""
    shutil.copytree(
        Path(tree) / "megatron", copy / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    )
    if apply_patches(copy, "--check").stdout.startswith("already applied:"):
        reverted = apply_patches(copy, "--revert")
        assert reverted.returncode == 0, reverted.stderr


def drive(tree: Path, tmp: Path, jobs: dict[str, list[str]], *, prepare: str = "imports") -> dict[str, dict]:
    """Run ``jobs`` ({mode: extra args}) in one driver process in ``tree`` (``prepare``: ``imports``,
    only what importing Megatron-LM here needs, or ``cpu_launch``, what the CPU launcher does); each
    mode works in its own directory ``tmp/MODE``.  Returns {mode: {"out": ..., "tmp": ...} or
    {"error": ...}}."""
    from tests.distributed.ranks import run_command

    tmp.mkdir(parents=True, exist_ok=True)
    spec = []
    for mode, extra in jobs.items():
        (tmp / mode).mkdir()
        spec.append([mode, str(tmp / mode), str(tmp / f"{mode}.json"), *extra])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"
    )
    done = run_command([[sys.executable, __file__, prepare, json.dumps(spec)]], env=env, cwd=tree, timeout=TIMEOUT_S)
    results = {}
    for mode in jobs:
        path = tmp / f"{mode}.json"
        if not path.exists():
            results[mode] = {"error": f"driver rc={done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"}
        else:
            results[mode] = dict(json.loads(path.read_text()), tmp=str(tmp / mode))
    return results


def result(driven: dict, mode: str) -> tuple[dict, str]:
    """``(out, tmp)`` of one mode, or the test fails with that mode's traceback."""
    got = driven[mode]
    assert "error" not in got, f"driver {mode} failed:\n{got['error']}"
    return got["out"], got["tmp"]


# --------------------------------------------------------------------------- #
# in the driver process
# --------------------------------------------------------------------------- #
def _prepare_imports() -> None:
    import typing

    if not hasattr(typing, "override"):
        # Megatron-LM core_v0.19 declares Python >= 3.12 but only needs typing.override to import.
        import typing_extensions

        typing.override = typing_extensions.override
    from datastates_megatron.megatron.cpu.launch import stub_triton_modules

    stub_triton_modules()  # megatron.training imports a triton module; triton is not needed here


def _prepare_cpu_launch() -> None:
    from datastates_megatron.megatron.cpu import launch as cpu_launch

    cpu_launch.prepare()  # typing.override on Python 3.11, no triton: what the launcher does


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def record_routing(args, save_checkpoint, load_checkpoint, finalize, out) -> list:
    """Call Megatron's ``save_checkpoint``, ``load_checkpoint`` and ``maybe_finalize_async_save`` as
    the patch or the hook routes them, the glue replaced by recorders; returns what reached the
    glue, ``out["load_returned"]`` what the load returned."""
    from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm

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
    save_checkpoint(100, model, opt, sched, 12.5, None)
    out["load_returned"] = list(load_checkpoint(model, opt, sched))
    finalize(blocking=False)
    finalize(blocking=True, terminate=True)
    args.lazy_ckpt = False
    finalize(blocking=True, terminate=True)  # Megatron's own path: no call
    return calls


# ------------------------------------------------ modes of test_megatron_lm_patch.py
def without_package(tmp, out):
    class _Hide:  # as if datastates_megatron were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "datastates_megatron":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])

    sys.meta_path.insert(0, _Hide())
    from megatron.training.arguments import parse_args

    sys.argv = ["pretrain", "--save", tmp + "/s"]
    out["has_lazy_ckpt"] = hasattr(parse_args(), "lazy_ckpt")
    sys.argv = ["pretrain", "--save", tmp + "/s", "--lazy-ckpt"]
    try:
        parse_args()
        out["lazy_flag_rejected"] = False
    except SystemExit:
        out["lazy_flag_rejected"] = True


def parse(tmp, out):
    from megatron.training.arguments import parse_args
    from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError, config_from_args

    sys.argv = [
        "pretrain",
        "--lazy-ckpt",
        "--save",
        tmp + "/s",
        "--load",
        tmp + "/l",
        "--save-interval",
        "100",
        "--train-iters",
        "1000",
        "--lazy-ckpt-host-cache-gb",
        "8",
        "--lazy-ckpt-flush-threads",
        "3",
        "--lazy-ckpt-max-inflight",
        "1",
        "--lazy-ckpt-keep-last",
        "4",
        "--lazy-ckpt-keep-every",
        "1000",
        "--no-lazy-ckpt-verify-on-load",
        "--lazy-ckpt-on-error",
        "warn",
        "--lazy-ckpt-no-streaming",
        "--lazy-ckpt-direct-io",
        "on",
        "--lazy-ckpt-timeout-s",
        "60",
        "--lazy-ckpt-local-dir",
        tmp + "/local",
        "--lazy-ckpt-persist-interval",
        "5",
        "--lazy-ckpt-local-keep-last",
        "3",
    ]
    args = parse_args()
    out["lazy_ckpt"] = args.lazy_ckpt
    out["save_interval"] = args.save_interval
    out["train_iters"] = args.train_iters
    out["config"] = dataclasses.asdict(config_from_args(args))
    sys.argv = ["pretrain"]
    out["default_lazy_ckpt"] = parse_args().lazy_ckpt
    errors = {}
    for name, argv in {
        "no_save": ["--lazy-ckpt"],
        "async_save": ["--lazy-ckpt", "--save", tmp + "/s", "--async-save"],
        "no_save_optim": ["--lazy-ckpt", "--save", tmp + "/s", "--no-save-optim"],
        "non_persistent": ["--lazy-ckpt", "--save", tmp + "/s", "--non-persistent-save-interval", "10"],
        "bad_threads": ["--lazy-ckpt", "--save", tmp + "/s", "--lazy-ckpt-flush-threads", "0"],
    }.items():
        sys.argv = ["pretrain", *argv]
        try:
            parse_args()
            errors[name] = None
        except LazyCkptArgsError as e:
            errors[name] = str(e)
    out["errors"] = errors


def mapped(tmp, out):  # Megatron-LM's local-checkpoint flags: parse_args, then its own validate_args
    import logging
    from megatron.training.arguments import parse_args, validate_args
    from datastates_megatron.megatron.megatron_lm.args import config_from_args

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("datastates_megatron").addHandler(Keep())
    sys.argv = ["pretrain", "--lazy-ckpt", "--save", tmp + "/s", "--save-interval", "100",
                "--non-persistent-save-interval", "10", "--non-persistent-ckpt-type", "local",
                "--non-persistent-local-ckpt-dir", tmp + "/local", "--replication", "--replication-jump", "4",
                "--ckpt-format", "torch_dist", "--ckpt-fully-parallel-load",
                "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
                "--train-iters", "10", "--lr", "1e-3", "--use-distributed-optimizer", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]  # fmt: skip
    args = parse_args()
    validate_args(args, {})  # would need nvidia-resiliency-ext for Megatron's own local checkpoints
    config = config_from_args(args)
    out["config"] = [config.local_dir, config.persist_interval, config.replicas, config.replication_jump]
    out["megatron"] = [args.non_persistent_save_interval, args.non_persistent_ckpt_type, args.replication]
    out["warnings"] = warnings


def validate(tmp, out, argv_json):  # the namespace a real run saves: parse_args + validate_args, lib.sh's flags
    from megatron.training.arguments import parse_args, validate_args
    from datastates_megatron.engine.format.tagged_json import decode_objects, encode_objects
    from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm

    sys.argv = ["pretrain", *json.loads(argv_json)]
    args = parse_args()
    validate_args(args, {})
    stored = decode_objects(encode_objects({"extra_state": megatron_lm.build_extra_state(args, 4, 1.5)}))
    saved = stored["extra_state"][megatron_lm.EXTRA_STATE_KEY]["args"]
    out["exit_signal"] = saved.get("exit_signal")
    out["saved"] = {k: saved.get(k) for k in ("lazy_ckpt", "bf16", "num_layers", "exit_signal_handler")}
    out["enums"] = sorted(k for k, v in vars(args).items() if isinstance(v, __import__("enum").Enum))


def route_or_glue(mode, tmp, out):
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import set_args
    import megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as checkpointing
    from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm

    sys.argv = ["pretrain", "--lazy-ckpt", "--save", tmp + "/s", "--load", tmp + "/s", *SMALL]
    args = parse_args()
    set_args(args)
    model, opt, sched = [object()], object(), object()
    calls = []
    if mode == "route":  # the patch forwards to the glue, with Megatron's arguments
        entries = checkpointing.save_checkpoint, checkpointing.load_checkpoint, async_utils.maybe_finalize_async_save
        calls = record_routing(args, *entries, out)
    else:  # the real glue behind the patch, with a recording checkpointer and Megatron's globals
        from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator
        from datastates_megatron.engine.format.tagged_json import encode_objects
        from datastates_megatron.engine.errors import NoCheckpointError

        store = {}

        class Recording:
            def __init__(self, model, optimizer, config, opt_param_scheduler=None, vocab_size=None):
                calls.append(
                    ["init", model is model_ref, optimizer is opt, opt_param_scheduler is sched, config.save_dir]
                )
                self.pending = []
                self.on_commit = []  # the glue hangs Megatron's commit logging here
                self.skipped = (0, 0)  # LazyCheckpointer.skipped: nothing is skipped here
                self.cache_reused = False  # no earlier in-process attempt's arena

            def save(self, iteration, extra_state=None, *, final=False):
                encode_objects({"extra_state": extra_state})
                store[iteration] = extra_state
                self.pending.append(iteration)
                calls.append(["save", iteration])

            def poll(self):
                done, self.pending = self.pending, []
                calls.append(["poll", done])
                return done

            def wait(self, persist=True, promote_newest=False):
                calls.append(["wait", persist, promote_newest])

            def load(self, iteration=None, *, optimizer=True, rng=True):
                calls.append(["load", iteration])
                if not store:
                    raise NoCheckpointError("none")
                it = max(store)
                return it, store[it]

            def close(self, *, keep_cache=False):
                calls.append(["close"])

        model_ref = model
        fake = types.ModuleType("datastates_megatron.megatron.checkpointing.checkpointer")
        fake.LazyCheckpointer = Recording
        sys.modules[fake.__name__] = fake
        import inspect

        if "step_batch_size_schedule" in inspect.signature(init_num_microbatches_calculator).parameters:
            init_num_microbatches_calculator(0, None, 16, 2, 1, step_batch_size_schedule="0:4 800:16")
        else:  # batch-size ramp-up 4 -> 16 over 800 samples
            init_num_microbatches_calculator(0, [4, 4, 800], 16, 2, 1)
        out["microbatches_before"] = get_num_microbatches()
        out["empty_load"] = list(checkpointing.load_checkpoint(model, opt, sched))
        args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples = 1600, 0, 64
        checkpointing.save_checkpoint(100, model, opt, sched, 12.5, None, train_data_iterator=None)
        async_utils.maybe_finalize_async_save(blocking=False)
        args.consumed_train_samples = args.consumed_valid_samples = 0
        out["load_returned"] = list(checkpointing.load_checkpoint(model, opt, sched))
        out["consumed"] = [args.consumed_train_samples, args.consumed_valid_samples]
        out["microbatches_after"] = get_num_microbatches()
        out["loaded_iteration"] = checkpointing.get_loaded_iteration()
        out["checkpoint_version"] = checkpointing.get_checkpoint_version()
        async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
        out["checkpointer_after_exit"] = megatron_lm.get_checkpointer() is None
    out["calls"] = calls


# ------------------------------------------------ modes of test_runtime_hook.py
MARK = "__datastates_megatron_hook__"


def hooked(fn):
    return bool(getattr(fn, MARK, False))


def binding_sites(out):
    import megatron.training.arguments as arguments
    import megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as checkpointing
    import megatron.training.initialize as initialize
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


def hook_route(tmp, out):
    from datastates_megatron.megatron.megatron_lm import hook

    out["install"] = [hook.install(), hook.install()]
    binding_sites(out)
    import megatron.training.arguments as arguments
    import megatron.training.training as training
    from megatron.training.global_vars import set_args
    from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError

    base = ["pretrain", "--save", tmp + "/s", "--load", tmp + "/s", *SMALL]

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
    entries = training.save_checkpoint, training.load_checkpoint, training.maybe_finalize_async_save
    out["calls"] = record_routing(args, *entries, out)


def hook_refuse(tmp, out):
    from datastates_megatron.megatron.megatron_lm import hook

    import megatron.training.checkpointing as checkpointing
    import megatron.training.async_utils as async_utils

    original_save, original_fin = checkpointing.save_checkpoint, async_utils.maybe_finalize_async_save

    def save_checkpoint(
        iteration,
        model,
        optimizer,
        num_floating_point_operations_so_far,
        checkpointing_context=None,
        non_persistent_ckpt=False,
        train_data_iterator=None,
    ):
        pass

    def new_required(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context,
        must,
        non_persistent_ckpt=False,
        train_data_iterator=None,
        release=False,
    ):
        pass

    namespace = {}
    exec(
        "def maybe_finalize_async_save(blocking=False, terminate=False):\n"
        "    from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm\n",
        namespace,
    )
    errors = []
    for attr, fake in (
        ("save", save_checkpoint),
        ("save", new_required),
        ("fin", namespace["maybe_finalize_async_save"]),
    ):
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


def hook_newparam(tmp, out):  # a newer Megatron-LM: save_checkpoint has an optional parameter the glue does not take
    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing
    from megatron.training.global_vars import set_args

    from datastates_megatron.megatron.megatron_lm import hook, checkpointing as megatron_lm

    def save_checkpoint(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context=None,
        future_knob=None,
        release=False,
    ):
        pass

    checkpointing.save_checkpoint = save_checkpoint
    out["install"] = hook.install()
    sys.argv = ["pretrain", "--save", tmp + "/s", *SMALL, "--lazy-ckpt"]
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


def hook_patched(tmp, out):
    from datastates_megatron.megatron.megatron_lm import hook

    out["install"] = hook.install()
    binding_sites(out)


MODES = {
    "without-package": without_package,
    "parse": parse,
    "mapped": mapped,
    "validate": validate,
    "route": lambda tmp, out: route_or_glue("route", tmp, out),
    "glue": lambda tmp, out: route_or_glue("glue", tmp, out),
    "hook-route": hook_route,
    "hook-refuse": hook_refuse,
    "hook-newparam": hook_newparam,
    "hook-patched": hook_patched,
}
PREPARE = {"imports": _prepare_imports, "cpu_launch": _prepare_cpu_launch}


def main(prepare: str, jobs_json: str) -> None:
    PREPARE[prepare]()
    jobs = json.loads(jobs_json)
    if any(job[0] != "without-package" for job in jobs):
        import megatron.training.arguments  # noqa: F401
        import megatron.training.async_utils  # noqa: F401
        import megatron.training.checkpointing  # noqa: F401
    for mode, tmp, out_path, *extra in jobs:
        pid = os.fork()
        if pid == 0:
            out = {}
            try:
                MODES[mode](tmp, out, *extra)
                payload = {"out": out}
            except BaseException:  # noqa: BLE001 - the test reports it
                payload = {"error": traceback.format_exc()}
            with open(out_path, "w") as f:
                json.dump(payload, f)
            os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(*sys.argv[1:])
