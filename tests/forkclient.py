"""The `python` the tests hand to the processes they start (tests/forkserver.py): the standard library
only, so that it starts in milliseconds.

    <client> [-u] SCRIPT ARGS | [-u] -m MODULE ARGS | [-u] -c CODE ARGS

It asks a fork server (one of two Unix sockets, written into the client by tests/forkserver.py) to
run the command in a child forked from an interpreter that has already imported torch,
transformers, peft and accelerate (waiting for a server still importing them), hands it its
standard streams, forwards the signals it gets to that child, and exits as the child did (its code,
or the same signal). Ranks (RANK) alternate between the two servers, whose string-hash seeds differ
as two fresh interpreters' do. Anything else (other interpreter options, no server, a server that
refuses: an environment variable that a preloaded library reads at import differs) runs the real
interpreter with the same arguments instead.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def real_python(python: str, argv: list[str]) -> None:
    os.execv(python, [python, *argv])


def supported(argv: list[str]) -> bool:
    """The command forms the server runs; multiprocessing's helpers (spawned workers, the resource
    tracker) read file descriptors they inherit by number, which only the real interpreter keeps."""
    args = argv[1:] if argv[:1] == ["-u"] else argv
    if not args or any("multiprocessing" in arg for arg in args):
        return False
    if args[0] in ("-m", "-c"):
        return len(args) >= 2
    return not args[0].startswith("-")


def read_line(sock: socket.socket, buffer: bytearray) -> dict:
    while b"\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def main(servers: list[str], python: str) -> None:
    argv = sys.argv[1:]
    path = servers[int(os.environ.get("RANK", "0") or 0) % 2]
    if not supported(argv):
        real_python(python, argv)
    deadline = time.monotonic() + 300
    while not os.path.exists(path) and not os.path.exists(path + ".failed") and time.monotonic() < deadline:
        time.sleep(0.05)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        real_python(python, argv)
    request = json.dumps(
        {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "pgid": os.getpgrp(), "sid": os.getsid(0)}
    ).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    buffer = bytearray()
    reply = read_line(sock, buffer)
    if "fallback" in reply:
        sock.close()
        real_python(python, argv)
    pid = reply["pid"]

    def forward(got, frame):
        with contextlib.suppress(ProcessLookupError):  # the child has ended and been reaped: its status follows
            os.kill(pid, got)

    for number in FORWARDED:
        signal.signal(number, forward)
    status = read_line(sock, buffer)["status"]
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
