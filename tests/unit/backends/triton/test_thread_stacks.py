"""tritonserver's thread stacks (backends/triton/server_binary.py, thread_stacks): a process started inside the block
has the raised soft RLIMIT_STACK (Triton 2.51's HTTP front end crashed on a body over half of it), this one gets its
own back; a larger limit is kept, a hard limit is not passed."""
import resource
import subprocess

from backends.triton.server_binary import thread_stacks


def _child_stack_kib() -> int:
    return int(subprocess.run(["sh", "-c", "ulimit -s"], capture_output=True, text=True, check=True).stdout)


def test_a_process_started_inside_gets_the_stacks_and_this_one_keeps_its_own():
    before = resource.getrlimit(resource.RLIMIT_STACK)
    hard = before[1]
    nbytes = 64 << 20 if hard == resource.RLIM_INFINITY else min(64 << 20, hard)
    resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, hard))
    try:
        with thread_stacks(nbytes):
            assert _child_stack_kib() == nbytes >> 10
        assert resource.getrlimit(resource.RLIMIT_STACK) == (8 << 20, hard)
        with thread_stacks(4 << 20):  # 8 MiB already: kept
            assert _child_stack_kib() == 8 << 10
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, before)
