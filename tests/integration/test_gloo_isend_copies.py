"""The guard that makes Megatron-LM's interleaved schedule reproducible on gloo CPU ranks
(:mod:`datastates_megatron.megatron.cpu.gloo_sends`): a tensor sent with ``isend`` whose storage is
swapped before the send is waited on -- Megatron-LM's ``deallocate_output_tensor`` -- arrives as it
was sent, and the CPU launcher installs the guard.

Without the guard the same script receives something else in most rounds (seen: 133 of 200), as
gloo reads the freed memory from its own thread while the next tensors are allocated in it; that
is left unasserted, as it happens only by chance."""

from __future__ import annotations

import os
import sys

import subprocess

from tests.distributed.ranks import run_command

ROUNDS = 200

# rank 0 sends a tensor per round and at once does what deallocate_output_tensor does, then
# allocates as the next microbatch would; rank 1 checks each tensor it receives
SCRIPT = """
import sys, torch, torch.distributed as dist
from datastates_megatron.megatron.cpu import gloo_sends
gloo_sends.install()
gloo_sends.install()  # idempotent
dist.init_process_group("gloo")
rounds, n, bad = int(sys.argv[1]), 64 * 2 * 64, 0
for r in range(rounds):
    if dist.get_rank() == 0:
        out = torch.full((n,), float(r))
        sent = dist.isend(out, 1)
        out.data = torch.empty((1,))
        junk = [torch.full((n,), -1.0) for _ in range(4)]
        sent.wait()
    else:
        got = torch.empty(n)
        dist.irecv(got, 0).wait()
        bad += int(not torch.equal(got, torch.full((n,), float(r))))
if dist.get_rank() == 1:
    print(f"RECEIVED {rounds - bad} of {rounds} as sent", flush=True)
dist.destroy_process_group()
"""


def test_the_cpu_launcher_installs_the_guard():
    code = (
        "import torch, torch.distributed as d; torch.cuda.is_available = lambda: False; "
        "from datastates_megatron.megatron.cpu import launch; assert launch.prepare(); "
        "from torch.distributed import distributed_c10d as c; "
        "assert d.isend.__name__ == c.isend.__name__ == '_isend_a_copy', d.isend"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_tensor_freed_while_its_isend_is_in_flight_arrives_as_sent(tmp_path):
    script = tmp_path / "send_then_free.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = run_command([[*cmd, str(ROUNDS)]], env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"RECEIVED {ROUNDS} of {ROUNDS} as sent" in done.stdout, done.stdout + done.stderr
