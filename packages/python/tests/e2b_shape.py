"""The E2B-shaped program of src/sdk/e2b-shape.test.ts, in Python: what a program written for
E2B's Python SDK does, with only the import and the environment changed (DORMANT_URL,
DORMANT_TOKEN, DORMANT_ROOTFS in place of E2B_API_KEY). It exits non-zero at the first check
that fails; src/sdk/python.test.ts runs it against a real daemon.

    PYTHONPATH=packages/python python3 packages/python/tests/e2b_shape.py
"""

import os
import sys
import time

from dormant_sdk import CommandExitException, PtySize, Sandbox


def until(what, f, seconds=15.0):
    deadline = time.time() + seconds
    while not f():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main() -> None:
    run = os.urandom(4).hex()
    sandbox = Sandbox.create(metadata={"suite": "e2b-shape-py", "run": run}, timeout=3600)

    # Streaming: the first line arrives while the command still runs.
    started = time.time()
    chunks = []
    result = sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done; echo err >&2",
        on_stdout=lambda data: chunks.append((time.time(), data)),
    )
    assert result.stdout == "line1\nline2\nline3\n", result
    assert result.stderr == "err\n", result
    assert result.exit_code == 0
    assert len(chunks) >= 2, chunks
    assert chunks[0][0] - started < time.time() - started - 0.7, "the first line came before the end"

    # A non-zero exit raises, carrying the output.
    try:
        sandbox.commands.run("echo partial; exit 3")
        raise AssertionError("exit 3 did not raise")
    except CommandExitException as e:
        assert (e.exit_code, e.stdout) == (3, "partial\n"), e

    # cwd, envs, stdin with NUL bytes.
    env = sandbox.commands.run("pwd; echo $GREETING", cwd="/tmp", envs={"GREETING": "hi"})
    assert env.stdout == "/tmp\nhi\n", env
    assert sandbox.commands.run("wc -c", stdin=b"\x00\x01\x00\x02\x00").stdout.strip() == "5"

    # A background command: a handle, disconnect, connect again, kill.
    ticker = sandbox.commands.run("i=0; while true; do echo tick$i; i=$((i+1)); sleep 0.1; done", background=True)
    until("ticks", lambda: "tick2" in ticker.stdout)
    ticker.disconnect()
    again = sandbox.commands.connect(ticker.pid)
    until("ticks after connect", lambda: "tick5" in again.stdout)
    assert again.stdout.startswith("tick0\n"), "connect replays the output from the start"
    assert any(c.pid == ticker.pid and c.running for c in sandbox.commands.list())
    assert sandbox.commands.kill(ticker.pid) is True
    try:
        again.wait()
        raise AssertionError("a killed command did not raise")
    except CommandExitException as e:
        assert e.signal == "SIGKILL", e
    assert sandbox.commands.kill(ticker.pid) is False, "a second kill: already ended"

    # A background command fed through stdin.
    cat = sandbox.commands.run("cat", background=True, stdin=True)
    cat.send_stdin("hello\n")
    sandbox.commands.send_stdin(cat.pid, "world\n", eof=True)
    assert cat.wait().stdout == "hello\nworld\n"

    # Files: 1 MiB of random bytes there and back, byte for byte, under a watched folder.
    assert sandbox.files.make_dir("/data") is True
    watch = sandbox.files.watch_dir("/data", recursive=True)
    blob = os.urandom(1024 * 1024)
    written = sandbox.files.write("/data/blob.bin", blob)
    assert (written.path, written.size) == ("/data/blob.bin", len(blob)), written
    assert sandbox.files.read("/data/blob.bin", format="bytes") == blob, "read back byte for byte"
    assert b"".join(sandbox.files.read("/data/blob.bin", format="stream")) == blob
    sandbox.files.write([{"path": "/data/a.txt", "data": "alpha"}, {"path": "/data/sub/b.txt", "data": "beta"}])
    assert sandbox.files.read("/data/a.txt") == "alpha"
    names = sorted(f"{e.type}:{e.name}" for e in sandbox.files.list("/data"))
    assert names == ["dir:sub", "file:a.txt", "file:blob.bin"], names
    deep = [e.path for e in sandbox.files.list("/data", depth=2) if e.path.endswith(".txt")]
    assert deep == ["/data/a.txt", "/data/sub/b.txt"], deep
    assert sandbox.files.exists("/data/a.txt") is True
    assert sandbox.files.exists("/data/nope") is False
    assert sandbox.files.get_info("/data/blob.bin").size == len(blob)
    assert sandbox.files.make_dir("/data/new/deep") is True
    assert sandbox.files.rename("/data/a.txt", "/data/new/a.txt").path == "/data/new/a.txt"
    sandbox.files.remove("/data/new")
    assert sandbox.files.exists("/data/new") is False
    # (Not sub/b.txt: a file made in a new folder at once may come before the folder is watched.)
    seen = []
    until("watch events", lambda: seen.extend(watch.get_new_events()) or {"blob.bin", "sub"} <= {
        e.name for e in seen if e.type == "create"})
    watch.stop()

    # The meter: CPU, memory and disk over time.
    until("meter samples", lambda: len(sandbox.get_metrics()) >= 2)
    assert sandbox.get_metrics()[-1].mem_used > 0

    # A terminal: an interactive shell answers typed input.
    screen = []
    term = sandbox.pty.create(PtySize(rows=24, cols=80), on_data=lambda d: screen.append(d.decode("utf-8", "replace")))
    sandbox.pty.send_input(term.pid, b"echo $((6*7)); tty\n")
    until("the shell to answer", lambda: "42" in "".join(screen) and "/dev/pts/" in "".join(screen))
    sandbox.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sandbox.pty.send_input(term.pid, b"stty size\n")
    until("the new size", lambda: "40 120" in "".join(screen))
    assert sandbox.pty.kill(term.pid) is True

    # Listing by label (E2B's metadata query).
    mine = Sandbox.list(query={"metadata": {"run": run}, "state": "running"})
    assert [(s.sandbox_id, s.metadata.get("suite")) for s in mine] == [(sandbox.sandbox_id, "e2b-shape-py")], mine
    assert Sandbox.list(query={"metadata": {"run": "other"}}) == []

    # dormant's own: hibernate, and the next command wakes it.
    sandbox.files.write("/tmp/kept.txt", "still here")
    assert sandbox.hibernate().state == "hibernated"
    assert sandbox.commands.run("cat /tmp/kept.txt").stdout == "still here"
    assert sandbox.get_info().state == "running"

    sandbox.set_timeout(300)
    assert sandbox.info.policy["hibernateAfterMs"] == 300_000, "set_timeout is the idle timeout"
    assert sandbox.kill() is True
    assert Sandbox.kill(sandbox.sandbox_id) is False, "already gone"
    print("e2b_shape.py: ok")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"e2b_shape.py: FAILED: {e}", file=sys.stderr)
        raise
