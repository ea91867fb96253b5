"""The unmodified E2B SDK against poold's E2B endpoints (docs/e2b.md).

Run by tests/tests/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY
pointing at a real poold, and the template (a python-numpy snapshot tag) as
the first argument. `--code-interpreter` also drives e2b-code-interpreter,
whose default template `code-interpreter-v1` must be such a snapshot.
Every check raises on failure, so the process exits non-zero; the last line
printed is `E2B SDK OK <version>` when everything passed.
"""

import datetime
import os
import socket
import sys
import time
import uuid
from urllib.parse import urlsplit

import e2b
from e2b import (
    CommandExitException,
    Sandbox,
    SandboxQuery,
    TimeoutException,
)

try:
    from importlib.metadata import version
except ImportError:  # pragma: no cover
    version = None


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def step(name):
    print(f"--- {name}", flush=True)


def plane_request(host, path="/", headers=None, upgrade=None):
    """A raw HTTP/1.1 request to the sandbox plane naming `host`, as a
    client that resolves the sandbox URL (wildcard DNS) would send it:
    (status, headers text, body). Asking to `upgrade`, the answer comes
    right after the head, whatever the status (the connection may stay
    open): (status, headers text, the socket), the caller closes it."""
    addr = urlsplit(os.environ["E2B_SANDBOX_URL"])
    s = socket.create_connection((addr.hostname, addr.port), timeout=20)
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if upgrade:
        lines += ["Connection: Upgrade", f"Upgrade: {upgrade}"]
    else:
        lines += ["Connection: close"]
    try:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = s.recv(4096)
            if not d:
                break
            buf += d
        head, _, rest = buf.partition(b"\r\n\r\n")
        parts = head.split(b" ")
        if upgrade and len(parts) < 2:
            return 0, buf.decode(errors="replace"), s  # no answer: the caller may retry
        check(len(parts) > 1, f"no HTTP answer from the sandbox plane: {buf!r}")
        status = int(parts[1])
        check(not (upgrade and status == 101 and rest), f"bytes after the 101 head: {rest!r}")
    except BaseException:
        s.close()
        raise
    if upgrade:
        return status, head.decode(), s
    while True:
        d = s.recv(4096)
        if not d:
            break
        rest += d
    s.close()
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return status, head.decode(), rest.decode()


def dechunk(b):
    out = b""
    while b:
        size, _, b = b.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, b = out + b[:n], b[n + 2:]
    return out


def commands(sbx):
    step("commands.run: stdout, stderr, exit code, env, cwd")
    r = sbx.commands.run(
        "echo $FOO $SBX_ENV; pwd; echo oops 1>&2", envs={"FOO": "bar"}, cwd="/tmp"
    )
    check(r.stdout == "bar from-create\n/tmp\n", f"stdout {r.stdout!r}")
    check(r.stderr == "oops\n", f"stderr {r.stderr!r}")
    check(r.exit_code == 0, f"exit code {r.exit_code}")

    r = sbx.commands.run("pwd; echo $HOME")
    check(r.stdout == "/root\n/root\n", f"default cwd and HOME: {r.stdout!r}")

    step("commands.run: a failing command raises with its exit code")
    try:
        sbx.commands.run("echo partial; exit 3")
        raise AssertionError("exit 3 did not raise")
    except CommandExitException as e:
        check(e.exit_code == 3, f"exit code {e.exit_code}")
        check(e.stdout == "partial\n", f"stdout of the failed command {e.stdout!r}")

    step("commands.run: timeout")
    t0 = time.monotonic()
    try:
        sbx.commands.run("sleep 60", timeout=3)
        raise AssertionError("sleep 60 with timeout=3 did not raise")
    except TimeoutException:
        pass
    took = time.monotonic() - t0
    check(took < 45, f"the timeout took {took:.1f}s")

    step("commands.run: background, wait, list, kill")
    h = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done", background=True)
    done = h.wait()
    check(done.stdout == "line1\nline2\nline3\n", f"background output {done.stdout!r}")
    check(done.exit_code == 0, f"background exit {done.exit_code}")

    h = sbx.commands.run("sleep 600", background=True)
    pids = [p.pid for p in sbx.commands.list()]
    check(h.pid in pids, f"background pid {h.pid} not listed in {pids}")
    check(sbx.commands.kill(h.pid) is True, "kill of a running process")
    try:
        h.wait()
        raise AssertionError("a killed process waited to success")
    except CommandExitException as e:
        check(e.exit_code != 0, f"killed exit code {e.exit_code}")
    deadline = time.monotonic() + 10
    while h.pid in [p.pid for p in sbx.commands.list()]:
        check(time.monotonic() < deadline, "the killed process is still listed")
        time.sleep(0.2)
    check(sbx.commands.kill(h.pid) is False, "kill of an ended process is False")

    step("commands: a background process outlives its client and re-attaches")
    h = sbx.commands.run("sleep 3; echo late", background=True)
    pid = h.pid
    h.disconnect()
    again = sbx.commands.connect(pid)
    res = again.wait()
    check(res.stdout == "late\n", f"re-attached output {res.stdout!r}")

    step("commands: stdin")
    h = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    res = h.wait()
    check(res.stdout == "got:hello\n", f"stdin echo {res.stdout!r}")

    if hasattr(sbx.commands, "stream_input"):  # newer SDKs: envd's client stream
        step("commands: stream_input")
        h = sbx.commands.run("head -c 17 | tr a-z A-Z; echo", background=True, stdin=True)

        def chunks():
            for part in ["streamed ", b"in ", "order"]:
                time.sleep(0.2)  # sent as the iterable yields them
                yield part

        sbx.commands.stream_input(h.pid, chunks())
        res = h.wait()
        check(res.stdout == "STREAMED IN ORDER\n", f"stream_input {res.stdout!r}")
        try:
            sbx.commands.stream_input(999999, ["x"])
            raise AssertionError("stream_input to a missing process succeeded")
        except AssertionError:
            raise
        except Exception as e:
            check("999999" in str(e) or "not found" in str(e).lower(), f"missing process: {e}")


def files(sbx):
    step("files.write / read / list")
    info = sbx.files.write("/tmp/e2b-test/hello.txt", "hello from the E2B SDK")
    check(info.path == "/tmp/e2b-test/hello.txt", f"write answered {info}")
    check(sbx.files.read("/tmp/e2b-test/hello.txt") == "hello from the E2B SDK", "read back")
    data = bytes(range(256))
    sbx.files.write("/tmp/e2b-test/bin.dat", data)
    check(sbx.files.read("/tmp/e2b-test/bin.dat", format="bytes") == data, "binary read back")
    entries = {e.name: e for e in sbx.files.list("/tmp/e2b-test")}
    check(set(entries) == {"hello.txt", "bin.dat"}, f"listing {sorted(entries)}")
    check(entries["bin.dat"].size == 256, f"size {entries['bin.dat'].size}")
    check(entries["hello.txt"].type == e2b.FileType.FILE, f"type {entries['hello.txt'].type}")

    step("files: relative paths, exists, make_dir, rename, remove")
    sbx.files.write("rel.txt", "in home")
    check(sbx.commands.run("cat /root/rel.txt").stdout == "in home", "relative write lands in /root")
    check(sbx.files.exists("/tmp/e2b-test/hello.txt"), "exists")
    check(not sbx.files.exists("/tmp/e2b-test/nope"), "not exists")
    check(sbx.files.make_dir("/tmp/e2b-test/sub") is True, "make_dir new")
    check(sbx.files.make_dir("/tmp/e2b-test/sub") is False, "make_dir existing")
    moved = sbx.files.rename("/tmp/e2b-test/hello.txt", "/tmp/e2b-test/sub/moved.txt")
    check(moved.path == "/tmp/e2b-test/sub/moved.txt", f"rename answered {moved}")
    check(sbx.files.read("/tmp/e2b-test/sub/moved.txt") == "hello from the E2B SDK", "moved content")
    deep = [e.path for e in sbx.files.list("/tmp/e2b-test", depth=2)]
    check("/tmp/e2b-test/sub/moved.txt" in deep, f"depth-2 listing {deep}")
    sbx.files.remove("/tmp/e2b-test/sub")
    check(not sbx.files.exists("/tmp/e2b-test/sub"), "removed")
    try:
        sbx.files.read("/tmp/e2b-test/missing")
        raise AssertionError("reading a missing file did not raise")
    except e2b.NotFoundException:
        pass


def control(sbx, template, run_id):
    step("set_timeout / get_info")
    sbx.set_timeout(900)
    info = sbx.get_info()
    check(info.sandbox_id == sbx.sandbox_id, f"info id {info.sandbox_id}")
    check(info.template_id == template, f"info template {info.template_id}")
    check(info.metadata.get("run") == run_id, f"info metadata {info.metadata}")
    left = (info.end_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    check(800 < left <= 905, f"end_at is {left:.0f}s away after set_timeout(900)")

    step("list: metadata filter and pagination")
    other = Sandbox.create(template=template, timeout=120, metadata={"run": run_id})
    try:
        seen = []
        pager = Sandbox.list(query=SandboxQuery(metadata={"run": run_id}), limit=1)
        while pager.has_next:
            page = pager.next_items()
            check(len(page) <= 1, f"page of {len(page)} with limit=1")
            seen += [s.sandbox_id for s in page]
        check(
            sorted(seen) == sorted([sbx.sandbox_id, other.sandbox_id]),
            f"listed {seen}, want {[sbx.sandbox_id, other.sandbox_id]}",
        )
        none = Sandbox.list(query=SandboxQuery(metadata={"run": "nobody"})).next_items()
        check(none == [], f"a filter matching nothing listed {none}")
    finally:
        other.kill()

    step("connect")
    again = Sandbox.connect(sbx.sandbox_id)
    check(again.sandbox_id == sbx.sandbox_id, "connect id")
    check(again.commands.run("echo connected").stdout == "connected\n", "command after connect")
    check(again.files.read("/tmp/e2b-test/bin.dat", format="bytes") == bytes(range(256)), "file after connect")


def fork(sbx):
    step("fork: children of a live sandbox carry its files and env")
    sbx.files.write("/root/before-fork.txt", "parent state")
    forks = sbx.fork(count=2, timeout=120)
    check(len(forks) == 2, f"fork(count=2) answered {forks}")
    try:
        for f in forks:
            check(not isinstance(f, Exception), f"a fork failed: {f!r}")
        check(forks[0].sandbox_id != forks[1].sandbox_id, "two distinct children")
        for f in forks:
            check(f.files.read("/root/before-fork.txt") == "parent state", "the parent's file")
            out = f.commands.run("echo $SBX_ENV").stdout
            check(out == "from-create\n", f"the parent's create envs: {out!r}")
        forks[0].files.write("/root/mine.txt", "child 0")
        check(not forks[1].files.exists("/root/mine.txt"), "children do not share writes")
        check(not sbx.files.exists("/root/mine.txt"), "the parent does not see a child's write")
        check(sbx.commands.run("echo parent").stdout == "parent\n", "the parent runs on")
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()


def code_interpreter(template):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    step("code interpreter: run_code on the warm numpy")
    ci = CodeSandbox.create()
    try:
        check(ci.get_info().template_id == template, "the code interpreter's default template")
        ex = ci.run_code("numpy.zeros(5).tolist()")
        check(ex.error is None, f"error {ex.error}")
        check(ex.text == "[0.0, 0.0, 0.0, 0.0, 0.0]", f"text {ex.text!r}")
        ex = ci.run_code("x = 40\nprint('side effect')\nx + 2")
        check(ex.text == "42", f"text {ex.text!r}")
        check(ex.logs.stdout == ["side effect\n"], f"stdout {ex.logs.stdout}")
        ex = ci.run_code("x * 10")
        check(ex.text == "400", f"state kept between runs: {ex.text!r}")
        ex = ci.run_code("1/0")
        check(ex.error is not None, "1/0 gave no error")
        check(ex.error.name == "ZeroDivisionError", f"error name {ex.error.name}")
        check("division by zero" in ex.error.value, f"error value {ex.error.value}")
        check("Traceback" in ex.error.traceback, f"traceback {ex.error.traceback!r}")
    finally:
        ci.kill()


def main():
    template = sys.argv[1]
    with_ci = "--code-interpreter" in sys.argv[2:]
    run_id = uuid.uuid4().hex
    ver = version("e2b") if version else "?"
    print(f"e2b {ver} against {template}", flush=True)

    step("create")
    sbx = Sandbox.create(
        template=template,
        timeout=300,
        envs={"SBX_ENV": "from-create"},
        metadata={"run": run_id},
    )
    try:
        commands(sbx)
        files(sbx)
        control(sbx, template, run_id)
        if hasattr(Sandbox, "fork"):
            fork(sbx)
    finally:
        step("kill")
        killed = sbx.kill()
    check(killed is True, "kill of a live sandbox")
    check(Sandbox.kill(sbx.sandbox_id) is False, "kill of a killed sandbox")
    try:
        Sandbox.connect(sbx.sandbox_id)
        raise AssertionError("connect to a killed sandbox did not raise")
    except e2b.SandboxException:
        pass
    if with_ci:
        code_interpreter(template)
    print(f"E2B SDK OK {ver}", flush=True)


if __name__ == "__main__":
    main()
