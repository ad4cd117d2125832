"""Megatron-LM's own ``pretrain_gpt.py --lazy-ckpt`` on 4 CPU ranks in the parallel layouts users run:
trained, killed with ``kill -9`` after a commit, resumed, and compared to the bit with a run that
never checkpointed (every iteration's grad norm and params norm, and a digest of every model and
optimizer tensor at the end, on every rank).

Context parallelism is not here: megatron-core's local attention asserts CP == 1 (only Transformer
Engine's attention implements it), and Transformer Engine needs a GPU (docs/megatron.md, "Layouts").
"""

from __future__ import annotations

import pytest

from datastates_megatron.engine.format.manifest import read_tracker
from tests.integration.megatron_lm_runs import LAZY, MEGATRON_LM_DIR, assert_same_training, latest, launch

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
)

RANKS = 4  # gloo ranks on CPU; under NCCL one GPU each
ITERS = 16  # the first commit can lag a few seconds behind its save on 2 busy cores: room to kill after it
MOE = [
    "--num-experts",
    "4",
    "--expert-model-parallel-size",
    "2",
    "--moe-router-topk",
    "2",
    "--no-bias-gelu-fusion",  # the fused bias-GeLU of the experts takes no per-token scale
]
LAYOUTS = {
    # PP=2 x DP=2 with 4 experts on EP=2 (expert DP=1): pipeline stages, dense buffers sharded over
    # DP and expert-parallel buffers in one run (MoE with TP needs sequence parallelism, which
    # megatron-core's local LayerNorm refuses: TE or apex only)
    # the aux-loss-free router keeps expert_bias in a persistent buffer, updated outside the step
    "pp2_dp2_ep2": [
        "--pipeline-model-parallel-size",
        "2",
        *MOE,
        "--moe-router-enable-expert-bias",
        "--moe-router-score-function",
        "sigmoid",
    ],
    "tp2_dp2": ["--tensor-model-parallel-size", "2"],
    "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
    # interleaved schedule: 2 model chunks per rank (4 layers over PP=2 x VP=2)
    "pp2_vp2_dp2": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    # DP=4, experts on EP=2 (expert DP=2): the expert-parallel buffers sharded over their own group
    "moe_ep2_dp4": MOE,
}
DEFAULT = "pp2_dp2_ep2"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run without checkpointing per layout (built on first use)."""
    tmp = tmp_path_factory.mktemp("reference")
    runs = {}

    def get(layout: str):
        if layout not in runs:
            run = launch(tmp, layout, ["--train-iters", str(ITERS), *LAYOUTS[layout]], nproc=RANKS)
            assert run.returncode == 0, run.describe()
            runs[layout] = run
        return runs[layout]

    return get


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=() if name == DEFAULT else pytest.mark.slow) for name in LAYOUTS]
)
def test_layout_kill_9_then_resume_is_bit_exact(tmp_path, reference, layout):
    save = tmp_path / "ckpt"
    args = [
        "--train-iters",
        str(ITERS),
        *LAYOUTS[layout],
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "2",
        *LAZY,
    ]
    # the tracker: the first commit a run makes is written after the iteration-2 save
    committed = lambda: (read_tracker(str(save)) or 0) >= 2  # noqa: E731
    killed = launch(tmp_path, "killed", args, nproc=RANKS, kill_when=committed)
    assert killed.returncode != 0, "the run ended before it was killed:\n" + killed.describe()
    resume_from = latest(save)
    assert resume_from is not None and 2 <= resume_from < ITERS, resume_from
    resumed = launch(tmp_path, "resumed", args, nproc=RANKS)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {resume_from}" in resumed.log
    want = reference(layout)
    assert_same_training(killed, want, None, ranks=RANKS)
    assert_same_training(resumed, want, range(resume_from + 1, ITERS + 1), ranks=RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_exported_to_torch_dist_then_imported_is_bit_exact(tmp_path, reference, layout):
    """Our checkpoint -> Megatron's torch_dist (``--lazy-ckpt-convert-to``, Megatron's own save) ->
    imported by Megatron's own loader into a lazy run: the same training as a run that never stopped."""
    lazy, exported = tmp_path / "lazy", tmp_path / "exported"
    common = ["--train-iters", str(ITERS), *LAYOUTS[layout], "--save-interval", "4", *LAZY]
    first = launch(tmp_path, "first", [*common, "--exit-interval", "4", "--save", str(lazy)], nproc=RANKS)
    assert first.returncode == 0 and latest(lazy) == 4, first.describe()
    convert = [*common, "--load", str(lazy), "--save", str(lazy), "--lazy-ckpt-convert-to", str(exported)]
    converted = launch(tmp_path, "export", convert, nproc=RANKS)
    assert converted.returncode == 0, converted.describe()
    resumed = launch(
        tmp_path, "resumed", [*common, "--load", str(exported), "--save", str(tmp_path / "lazy2")], nproc=RANKS
    )
    assert resumed.returncode == 0, resumed.describe()
    assert "imported Megatron torch_dist checkpoint of iteration 4" in resumed.log
    want = reference(layout)
    assert_same_training(first, want, range(1, 5), ranks=RANKS)
    assert_same_training(resumed, want, range(5, ITERS + 1), ranks=RANKS)
