"""The glue's one question before a save: is it Megatron-LM's last before the run ends?  That save
is never skipped (``--lazy-ckpt-when-behind skip`` skips only saves the run goes on after)."""

from __future__ import annotations

import types

import pytest

from datastates_megatron.megatron.megatron_lm.checkpointing import is_final_save


def _args(**kw):
    base = dict(train_iters=100, exit_interval=None, phase_transition_iterations=None, exit_signal_handler=False)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "args,iteration,why",
    [
        (_args(), 100, "the end of training"),
        (_args(), 99, None),
        (_args(exit_interval=30), 60, "--exit-interval"),
        (_args(exit_interval=30), 61, None),
        (_args(phase_transition_iterations=[40, 70]), 70, "a phase transition"),
        (_args(train_iters=None), 10**6, None),
    ],
)
def test_the_last_save_before_the_run_ends_is_final(args, iteration, why):
    assert is_final_save(args, iteration) == why
