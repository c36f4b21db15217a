import subprocess
import sys

PROGRAM = """
import atexit
from megatron_r3.rl.quick_exit import exit_without_teardown

class Teardown:
    def __del__(self):
        print("teardown ran")

kept = Teardown()  # a module global: the interpreter's teardown would finalize it
atexit.register(print, "exit handler ran")
print("unflushed output")  # stdout is a pipe, so this waits in the buffer
exit_without_teardown(3)
print("after the exit")
"""


def run(program):
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)


def test_exit_runs_the_handlers_flushes_and_skips_the_teardown():
    done = run(PROGRAM)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["unflushed output", "exit handler ran"]


def test_the_plain_exit_of_the_same_program_would_tear_down():
    # The control: the same program ending normally finalizes the global.
    done = run(PROGRAM.replace("exit_without_teardown(3)", "pass"))
    assert done.returncode == 0, done.stderr
    assert "teardown ran" in done.stdout.splitlines()
