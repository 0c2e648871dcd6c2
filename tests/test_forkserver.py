"""The fork server the tests start their Python processes through (tests/forkserver.py): a forked
child is the process the real interpreter would have started, seen from outside and from inside."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forkserver import python_for_tests

if os.environ.get("RELAY_TEST_FORK", "1") == "0":
    pytest.skip("RELAY_TEST_FORK=0: the tests start the real interpreter", allow_module_level=True)

INSIDE = (
    "import json, os, sys; "
    "print(json.dumps([sys.argv, sys.path[0], os.getcwd(), os.environ.get('MARK'), 'torch' in sys.modules]))"
)


def run(args, tmp_path, python=None, **env):
    return subprocess.run(
        [python or python_for_tests(), *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MARK": "m", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def server_log() -> str:
    """This worker's servers' last log lines: why a request ran on the real interpreter."""
    folder = Path(os.environ.get("RELAY_TEST_FORK_LOGS", os.path.dirname(python_for_tests())))
    return "".join("".join(log.read_text().splitlines(True)[-2:]) for log in folder.glob(f"server*-{os.getpid()}.log"))


def test_a_forked_child_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "sub" / "script.py"
    script.parent.mkdir()
    script.write_text(INSIDE + "\n")
    (tmp_path / "inside.py").write_text(INSIDE + "\n")
    runs = {
        "c": (["-c", INSIDE, "a"], ["-c", "a"], ""),
        "m": (["-m", "inside", "b"], [str(tmp_path / "inside.py"), "b"], str(tmp_path)),
        "script": ([str(script), "c"], [str(script), "c"], str(script.parent)),
    }
    for name, (args, argv, first) in runs.items():
        done = run(args, tmp_path)
        assert done.returncode == 0, (name, done.stderr)
        got_argv, path0, cwd, mark, preloaded = json.loads(done.stdout)
        assert (got_argv, path0, cwd, mark) == (argv, first, str(tmp_path), "m"), name
        assert preloaded, (name, server_log())  # forked from the server: torch was already imported
        real = json.loads(run(args, tmp_path, python=sys.executable).stdout)
        assert real[:4] == [argv, first, str(tmp_path), "m"] and not real[4], name  # the real interpreter's
    # a variable that torch reads while it imports: the real interpreter, which has not imported it
    done = run(["-c", INSIDE], tmp_path, OMP_NUM_THREADS="2")
    assert done.returncode == 0 and json.loads(done.stdout)[4] is False, done.stderr


@pytest.mark.parametrize("name,value", [("PYTORCH_NVML_BASED_CUDA_CHECK", "1"), ("KMP_DUPLICATE_LIB_OK", "TRUE")])
def test_a_variable_no_import_reads_still_forks(tmp_path, monkeypatch, name, value):
    """DeepSpeed's accelerator probe (a test's first tiny model) leaves PYTORCH_NVML_BASED_CUDA_CHECK
    set in the pytest worker, importing scikit-learn or an inductor compile KMP_DUPLICATE_LIB_OK: read
    when called, or when a second OpenMP runtime loads, they sent every later child of that worker to
    a fresh interpreter, and these tests failed there."""
    run(["-c", "pass"], tmp_path)  # the servers started before the variable is set
    monkeypatch.setenv(name, value)
    done = run(["-c", INSIDE], tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)[-1], server_log()


def test_exit_codes_streams_and_hash_seeds_are_a_fresh_interpreters(tmp_path):
    assert run(["-c", "import sys; sys.exit(3)"], tmp_path).returncode == 3
    done = run(["-c", "raise ValueError('bad')"], tmp_path)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: bad")
    done = run(["-c", "import sys; sys.exit('one line')"], tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == "one line"
    done = subprocess.run(
        [python_for_tests(), "-c", "import sys; print(sys.stdin.read().upper())"],
        input="hello",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "HELLO"
    # multiprocessing's spawned workers read inherited descriptors: they run on the real interpreter
    pool = (
        "import multiprocessing as mp\nwith mp.get_context('spawn').Pool(1) as pool:\n    print(pool.apply(abs, (-3,)))"
    )
    done = run(["-c", pool], tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr[-2000:]
    # ranks alternate between two servers (RANK's parity), so two ranks hash strings differently, as two
    # fresh interpreters do; ranks of one parity share a server's seed (a fresh interpreter draws its own)
    seeds = [run(["-c", "print(hash('relay'))"], tmp_path, RANK=rank).stdout for rank in ("0", "1", "2")]
    assert seeds[0] == seeds[2] != seeds[1], seeds


def test_signals_reach_the_child_and_a_killed_client_takes_it_down(tmp_path):
    handler = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
    for code, want in ((handler, 143), ("import time\n", -signal.SIGTERM)):
        proc = subprocess.Popen(
            [python_for_tests(), "-c", code + "print('up', flush=True)\ntime.sleep(60)"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == want
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    proc = subprocess.Popen([python_for_tests(), "-c", code])
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_file.exists(), server_log()
    child = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")


def test_a_signal_after_the_child_has_ended_leaves_its_exit_code(tmp_path):
    """A signal reaching the client after its child has ended and been reaped (torchrun stops the other
    ranks as one ends) is not passed on to a process that no longer exists: the client exits with the
    child's code, no traceback (a ProcessLookupError before)."""
    code = "import sys\nprint('up', flush=True)\nsys.stdin.readline()"
    proc = subprocess.Popen(
        [python_for_tests(), "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "up"
    time.sleep(0.5)  # the client has the child's pid and forwards signals
    proc.send_signal(signal.SIGSTOP)
    proc.stdin.write("\n")
    proc.stdin.flush()  # the child ends; the server reaps it
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)  # held until the client runs again
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


def test_a_child_ending_as_its_client_is_killed_leaves_the_server_serving(tmp_path):
    """The child kills its client and exits at once: the server sees the child end and the client's
    socket close in one round of its loop (it stopped with StopIteration there), or the client's
    socket reset with the server's reply unread (ConnectionResetError), and goes on forking the next
    requests. A race: before they were mended, these tries stopped the server in some runs
    (bench/RESULTS.md)."""
    code = "import os, sys\nos.kill(int(sys.stdin.readline()), 9)\nos._exit(0)"
    for _ in range(40):
        proc = subprocess.Popen([python_for_tests(), "-c", code], stdin=subprocess.PIPE, text=True)
        proc.stdin.write(f"{proc.pid}\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    done = run(["-c", "print('still forked')"], tmp_path)
    assert done.returncode == 0 and done.stdout == "still forked\n", done.stderr + server_log()
    assert "forked: ['-c', \"print('still forked')\"]" in server_log()


def test_a_childs_own_finalizers_run_at_its_exit_and_the_preloaded_ones_do_not(tmp_path):
    """The child's exit runs what the child registered (a finalizer writing a file) and not the
    finalizers the server's imports registered (torch's operator libraries unregistering themselves:
    memory the child is about to drop, pages it would copy to do it)."""
    mark = tmp_path / "finalized"
    code = (
        "import weakref, torch\n"
        "class Owner: pass\n"
        "owner = Owner()\n"
        f"weakref.finalize(owner, open({str(mark)!r}, 'w').write, 'ran')\n"
        "pending = [f for f in weakref.finalize._registry.values() if f.atexit]\n"
        "print(sum(getattr(f.func, '__module__', '') == 'torch.library' for f in pending), len(pending))\n"
    )
    done = run(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"], done.stdout + server_log()
    assert mark.read_text() == "ran"
    mark.unlink()
    real = run(["-c", code], tmp_path, python=sys.executable)  # the reference: the same write at exit
    assert real.returncode == 0 and mark.read_text() == "ran", real.stderr


def test_the_session_presets_what_this_process_would_set_later(tmp_path):
    """A stage run in a test's own process (its console set-up) and an import of lm_eval set variables
    that a preloaded library reads at import; the session sets them first (tests/conftest.py), so the
    processes started after them are forked like those started before (else: the real interpreter)."""
    from forkserver import HANDLED, IMPORT_TIME

    code = (
        "import json, os; before = dict(os.environ)\n"
        "import lm_eval\n"
        "from pipeline.engine.tracking import quiet_console; quiet_console()\n"
        "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_DISABLE_PROGRESS_BARS", "HF_XET"))}
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    set_later = {
        k: v for k, v in json.loads(done.stdout).items() if k.startswith(IMPORT_TIME) and not k.startswith(HANDLED)
    }
    assert set_later and all(os.environ.get(k) == v for k, v in set_later.items()), set_later
