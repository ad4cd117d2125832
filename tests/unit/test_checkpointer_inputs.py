"""LazyCheckpointer refuses a model or optimizer that is not megatron-core's, at once and saying what it needs."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallel  # noqa: E402

from datastates_megatron import LazyCheckpointer, LazyCkptConfig  # noqa: E402
from datastates_megatron.engine.errors import CheckpointError  # noqa: E402
from datastates_megatron.megatron.checkpointing.checkpointer import UnsupportedModelError  # noqa: E402


def _config(tmp_path):
    return LazyCkptConfig(save_dir=str(tmp_path / "ckpt"), host_cache_gb=1 / 1024)


def test_plain_torch_model_and_optimizer_are_refused_with_what_is_needed(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError) as exc:
        LazyCheckpointer(model, torch.optim.Adam(model.parameters()), _config(tmp_path))
    assert isinstance(exc.value, UnsupportedModelError) and isinstance(exc.value, CheckpointError)
    message = str(exc.value)
    assert "torch.nn.modules.linear.Linear" in message and "DistributedDataParallel" in message
    assert not (tmp_path / "ckpt").exists()  # refused before any directory, lock or thread


def test_the_chunk_at_fault_is_named_in_a_list(tmp_path):
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # passes the type check only
    with pytest.raises(UnsupportedModelError, match="model chunk 1 is a torch.nn.modules.linear.Linear"):
        LazyCheckpointer([ddp, torch.nn.Linear(2, 2)], None, _config(tmp_path))
    with pytest.raises(UnsupportedModelError, match="empty list"):
        LazyCheckpointer([], None, _config(tmp_path))


def test_a_torch_optimizer_is_refused(tmp_path):
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    adam = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(UnsupportedModelError, match=r"optimizer is a torch\.optim\.adam\.Adam.*get_megatron_optimizer"):
        LazyCheckpointer(ddp, adam, _config(tmp_path))
    assert not (tmp_path / "ckpt").exists()
