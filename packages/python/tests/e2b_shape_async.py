"""The E2B-shaped program of e2b_shape.py with ``AsyncSandbox`` (E2B's ``AsyncSandbox``):
the same steps, awaited, with a coroutine as an output callback. src/sdk/python.test.ts runs it.

    PYTHONPATH=packages/python python3 packages/python/tests/e2b_shape_async.py
"""

import asyncio
import os
import sys
import time

from dormant_sdk import AsyncSandbox, CommandExitException, PtySize


async def until(what, f, seconds=15.0):
    deadline = time.time() + seconds
    while not f():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def main() -> None:
    run = os.urandom(4).hex()
    sandbox = await AsyncSandbox.create(metadata={"suite": "e2b-shape-async", "run": run}, timeout=3600)

    started = time.time()
    chunks = []

    async def on_stdout(data):  # a coroutine: it runs on the loop, in order
        chunks.append((time.time(), data))

    result = await sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.5; done", on_stdout=on_stdout)
    assert result.stdout == "line1\nline2\nline3\n", result
    assert len(chunks) >= 2 and chunks[0][0] - started < time.time() - started - 0.7, chunks

    try:
        await sandbox.commands.run("exit 3")
        raise AssertionError("exit 3 did not raise")
    except CommandExitException as e:
        assert e.exit_code == 3

    ticker = await sandbox.commands.run("while true; do echo tick; sleep 0.1; done", background=True)
    await until("ticks", lambda: ticker.stdout.count("tick") >= 3)
    await ticker.disconnect()
    again = await sandbox.commands.connect(ticker.pid)
    await until("ticks after connect", lambda: again.stdout.count("tick") >= 5)
    assert any(c.pid == ticker.pid and c.running for c in await sandbox.commands.list())
    assert await sandbox.commands.kill(ticker.pid) is True
    try:
        await again.wait()
        raise AssertionError("a killed command did not raise")
    except CommandExitException as e:
        assert e.signal == "SIGKILL", e

    blob = os.urandom(1024 * 1024)
    await sandbox.files.write("/data/blob.bin", blob)
    assert await sandbox.files.read("/data/blob.bin", format="bytes") == blob, "read back byte for byte"
    assert [e.name for e in await sandbox.files.list("/data")] == ["blob.bin"]
    assert await sandbox.files.exists("/data/blob.bin") is True
    assert await sandbox.files.exists("/data/nope") is False

    screen = []
    term = await sandbox.pty.create(PtySize(rows=24, cols=80), on_data=lambda d: screen.append(d.decode("utf-8", "replace")))
    await sandbox.pty.send_input(term.pid, b"echo $((6*7))\n")
    await until("the shell to answer", lambda: "42" in "".join(screen))
    assert await sandbox.pty.kill(term.pid) is True

    mine = await AsyncSandbox.list(query={"metadata": {"run": run}})
    assert [s.sandbox_id for s in mine] == [sandbox.sandbox_id], mine

    await sandbox.files.write("/tmp/kept.txt", "still here")
    assert (await sandbox.hibernate()).state == "hibernated"
    assert (await sandbox.commands.run("cat /tmp/kept.txt")).stdout == "still here"
    assert await sandbox.kill() is True
    print("e2b_shape_async.py: ok")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except AssertionError as e:
        print(f"e2b_shape_async.py: FAILED: {e}", file=sys.stderr)
        raise
