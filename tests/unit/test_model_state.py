"""model_state: persistent buffers and ``get_extra_state()`` values, captured and restored by key."""

import pytest
import torch

from datastates_megatron.engine.errors import LayoutMismatchError
from datastates_megatron.engine.format.tagged_json import decode_objects, encode_objects
from datastates_megatron.megatron.checkpointing import model_state


class WithExtra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.meta = {"amax": [0.0, 0.0], "n": 0}
        self.register_buffer("bias_like", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def get_extra_state(self):
        return torch.tensor(self.meta["amax"] + [float(self.meta["n"])])

    def set_extra_state(self, state):
        *amax, n = state.tolist()
        self.meta = {"amax": amax, "n": int(n)}


class Wrapper(torch.nn.Module):  # as DDP / Float16Module: the state lives under .module
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Sequential(torch.nn.Linear(2, 2), WithExtra())


def test_capture_then_restore_through_the_codec_round_trips():
    a = Wrapper()
    inner = a.module[1]
    inner.meta = {"amax": [1.5, 2.5], "n": 7}
    inner.bias_like.copy_(torch.tensor([1.0, 2.0, 3.0]))
    inner.scratch.fill_(9)
    saved = decode_objects(encode_objects(model_state.capture([a])))
    assert set(saved["buffers"]) == {"0.1.bias_like"}  # the non-persistent one is not state
    assert set(saved["extra_state"]) == {"0.1._extra_state"}
    b = Wrapper()
    model_state.restore(saved, [b], where="test")
    assert b.module[1].meta == {"amax": [1.5, 2.5], "n": 7}
    assert torch.equal(b.module[1].bias_like, torch.tensor([1.0, 2.0, 3.0]))
    assert b.module[1].scratch.sum() == 0


def test_capture_is_a_value_at_save_time():
    a = Wrapper()
    body = encode_objects(model_state.capture([a]))
    a.module[1].bias_like.fill_(5)
    a.module[1].meta["n"] = 3
    saved = decode_objects(body)
    assert saved["buffers"]["0.1.bias_like"].sum() == 0 and saved["extra_state"]["0.1._extra_state"][-1] == 0


def test_a_different_model_is_refused_before_anything_is_set():
    saved = decode_objects(encode_objects(model_state.capture([Wrapper()])))
    other = torch.nn.Sequential(WithExtra(), WithExtra())
    other[0].bias_like.fill_(4)
    with pytest.raises(LayoutMismatchError, match="missing in the checkpoint"):
        model_state.restore(saved, [other], where="rank 0: iteration 3")
    assert other[0].bias_like.sum() == 12
    b = Wrapper()
    saved["buffers"]["0.1.bias_like"] = torch.zeros(4)
    b.module[1].meta["n"] = 2
    with pytest.raises(LayoutMismatchError, match="bias_like"):
        model_state.restore(saved, [b], where="rank 0: iteration 3")
    assert b.module[1].meta["n"] == 2  # extra state untouched too


def test_a_checkpoint_without_model_state_only_warns(caplog):
    b = Wrapper()
    model_state.restore(None, [b], where="rank 0: iteration 3")
    assert "no model buffers or extra state" in caplog.text


class TELikeWithoutFP8(torch.nn.Module):
    """As Transformer Engine's layers without FP8: the extra state is an empty uint8 tensor."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        assert state is None or state.numel() == 0


def test_held_state_is_what_another_layout_cannot_take():
    """A layout change refuses the values that hold state (buffers, FP8 metadata) and takes the
    extra state that holds nothing: ``None`` and TE's empty tensor, through the codec."""
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), TELikeWithoutFP8())
    saved = decode_objects(encode_objects(model_state.capture([plain])))
    assert set(saved["extra_state"]) == {"0.1._extra_state"} and model_state.held_state(saved) == []
    assert model_state.held_state({"extra_state": {"0.x._extra_state": None}}) == []
    assert model_state.held_state(None) == []
    fp8 = decode_objects(encode_objects(model_state.capture([Wrapper()])))
    assert model_state.held_state(fp8) == ["0.1._extra_state", "0.1.bias_like"]
