"""E2B's `user` account, files (signed URLs, watches), terminals, metrics
and snapshots through the unmodified E2B SDK (docs/e2b.md).

Run by tests/tests/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY
pointing at a real poold, and the template (a snapshot of the `e2b-base`
image, which has E2B's `user` account) as the first argument. Every check
raises on failure; the last line printed is `E2B USERS OK` when all passed.
"""

import asyncio
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request

from e2b import (
    AsyncSandbox,
    ConnectionConfig,
    FilesystemEventType,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection
from e2b.sandbox_sync.paginator import get_api_client
from e2b_code_interpreter import Sandbox as CodeSandbox

from e2b_sdk import plane_request


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def step(name):
    print(f"--- {name}", flush=True)


def commands(sbx):
    step("commands run as user, in its home, unless root is asked for")
    r = sbx.commands.run("whoami; pwd; echo $HOME; id -gn")
    check(r.stdout == "user\n/home/user\n/home/user\nuser\n", f"default user: {r.stdout!r}")
    r = sbx.commands.run("whoami; pwd; echo $HOME", user="root")
    check(r.stdout == "root\n/root\n/root\n", f"user=root: {r.stdout!r}")
    r = sbx.commands.run("sudo -n whoami")
    check(r.stdout == "root\n", f"user's passwordless sudo: {r.stdout!r}")

    step("an account the guest lacks is refused, not run as root")
    try:
        r = sbx.commands.run("whoami", user="nobody-such")
        raise AssertionError(f"user=nobody-such ran: {r.stdout!r}")
    except AssertionError:
        raise
    except Exception as e:  # the SDK's AuthenticationException
        check("nobody-such" in str(e), f"the refusal names the user: {e}")


def files(sbx):
    step("files written without a user are user's, relative to its home")
    w = sbx.files.write("notes/a.txt", "hello")
    check(w.path == "/home/user/notes/a.txt", f"write path {w.path!r}")
    check(sbx.files.read("/home/user/notes/a.txt") == "hello", "read back")
    check(sbx.files.read("notes/a.txt") == "hello", "read back, relative")
    st = sbx.commands.run("stat -c '%U:%G %a' /home/user/notes /home/user/notes/a.txt").stdout
    check(st == "user:user 755\nuser:user 644\n", f"owners in the guest: {st!r}")
    info = sbx.files.get_info("notes/a.txt")
    check((info.owner, info.group) == ("user", "user"), f"get_info owner {info.owner}:{info.group}")
    check(info.path == "/home/user/notes/a.txt", f"get_info path {info.path}")
    check(info.permissions == "-rw-r--r--", f"permissions {info.permissions}")
    check(info.size == 5, f"size {info.size}")

    step("make_dir, rename, list as user")
    check(sbx.files.make_dir("made/deep") is True, "make_dir")
    check(sbx.files.get_info("made").owner == "user", "made/ belongs to user")
    check(sbx.files.get_info("made/deep").owner == "user", "made/deep belongs to user")
    moved = sbx.files.rename("notes/a.txt", "notes/b.txt")
    check(moved.path == "/home/user/notes/b.txt", f"rename {moved.path}")
    names = [(e.name, e.owner) for e in sbx.files.list("notes")]
    check(names == [("b.txt", "user")], f"list {names}")

    step("a symlink's get_info gives its absolute target")
    sbx.commands.run("ln -s notes/b.txt link")
    link = sbx.files.get_info("link")
    check(link.symlink_target == "/home/user/notes/b.txt", f"symlink target {link.symlink_target!r}")

    step("root's files stay root's")
    w = sbx.files.write("/root/secret.txt", "s", user="root")
    check(w.path == "/root/secret.txt", f"root write {w.path}")
    info = sbx.files.get_info("secret.txt", user="root")
    check(info.owner == "root", f"root's file owner {info.owner}")
    r = sbx.commands.run("cat /root/secret.txt 2>&1 || echo denied")
    check(r.stdout.endswith("denied\n"), f"user reads root's home: {r.stdout!r}")

    step("remove as user; a missing path is done, as envd's os.RemoveAll")
    sbx.files.remove("made")
    check(not sbx.files.exists("made"), "made/ removed")
    sbx.files.remove("made")
    sbx.files.remove("/tmp/never/was")

    step("a gzip upload is inflated")
    text = "zipped " * 5000
    w = sbx.files.write("z.txt", text, gzip=True)
    check(w.path == "/home/user/z.txt", f"gzip write {w.path}")
    check(sbx.files.read("z.txt") == text, "gzip upload read back")
    check(sbx.files.get_info("z.txt").owner == "user", "gzip upload owner")


def metadata(sbx):
    step("file metadata: kept as user.e2b.* xattrs, reported by get_info and list, replaced on overwrite")
    w = sbx.files.write("tagged.txt", "v1", metadata={"Owner": "agent-7", "run": "r 1"})
    check(w.metadata == {"owner": "agent-7", "run": "r 1"}, f"write answers what it kept: {w.metadata}")
    check(sbx.files.get_info("tagged.txt").metadata == w.metadata, "get_info metadata")
    listed = {e.name: e.metadata for e in sbx.files.list(".")}
    check(listed["tagged.txt"] == w.metadata, f"list metadata {listed.get('tagged.txt')}")
    check(listed["notes"] is None, f"an untagged entry has none: {listed['notes']}")
    attr = sbx.commands.run(
        "python3 -c \"import os; print(os.getxattr('tagged.txt', 'user.e2b.owner').decode())\""
    ).stdout
    check(attr == "agent-7\n", f"the guest sees the xattr: {attr!r}")
    sbx.commands.run("python3 -c \"import os; os.setxattr('tagged.txt', 'user.e2b.set', b'in guest')\"")
    check(sbx.files.get_info("tagged.txt").metadata.get("set") == "in guest", "set in the guest, read back")
    w = sbx.files.write("tagged.txt", "v2", metadata={"run": "r 2"})
    check(w.metadata == {"run": "r 2"}, f"an overwrite replaces the whole set: {w.metadata}")
    sbx.files.write("tagged.txt", "v3")
    check(sbx.files.get_info("tagged.txt").metadata is None, "an upload without metadata clears it")
    for bad in ({"k": "caf\u00e9"}, {"k": "v" * 5000}):
        try:
            sbx.files.write("bad.txt", "x", metadata=bad)
            raise AssertionError(f"metadata {list(bad)} was accepted")
        except AssertionError:
            raise
        except Exception as e:  # the SDK's InvalidArgumentException, or poold's 400
            check("metadata" in str(e).lower(), f"the refusal says metadata: {e}")
    check(not sbx.files.exists("bad.txt"), "a refused upload wrote nothing")


def logs(sandbox_id):
    step("the log API (E2B's generated client): envd's operations and the lifecycle, v1 and v2, after the kill")
    client = get_api_client(ConnectionConfig())
    v1 = get_sandboxes_sandbox_id_logs.sync(sandbox_id, client=client)
    check(hasattr(v1, "log_entries"), f"v1 answered {v1}")
    msgs = [e.message for e in v1.log_entries]
    check(msgs[0] == "Sandbox created" and msgs[-1] == "Killing sandbox", f"lifecycle ends: {msgs[:2]} {msgs[-2:]}")
    for want in ("File write", "File read", "Process start", "Filesystem stat"):
        check(want in msgs, f"{want!r} logged: {sorted(set(msgs))}")
    times = [e.timestamp for e in v1.log_entries]
    check(times == sorted(times), "v1 is oldest first")
    line = json.loads(v1.logs[0].line)
    check(line["message"] == "Sandbox created" and line["level"] == "info", f"the raw line {line}")
    later = int(times[-1].timestamp() * 1000)
    tail = get_sandboxes_sandbox_id_logs.sync(sandbox_id, client=client, start=later)
    check(tail.log_entries and all(e.timestamp >= times[-1] for e in tail.log_entries), "v1 from start")
    errors = get_v_2_sandboxes_sandbox_id_logs.sync(
        sandbox_id, client=client, direction=LogsDirection.FORWARD, level=LogLevel.ERROR
    ).logs
    check(errors and all(e.level == LogLevel.ERROR for e in errors), f"level=error: {errors[:2]}")
    bad = [e for e in errors if e.message == "File write"]
    check(bad and bad[0].fields["error_code"] == "400", f"the refused upload is an error entry: {errors}")
    last = get_v_2_sandboxes_sandbox_id_logs.sync(sandbox_id, client=client, limit=1).logs
    check([e.message for e in last] == ["Killing sandbox"], f"v2 is newest first: {last}")
    found = get_v_2_sandboxes_sandbox_id_logs.sync(sandbox_id, client=client, search="Filesystem").logs
    check(found and all("Filesystem" in e.message for e in found), "search")


def signed_urls(sbx):
    step("signed URLs: download and upload with no header; tampered or expired ones refused")
    sbx.files.write("signed.txt", "by a signed URL")
    with urllib.request.urlopen(sbx.download_url("signed.txt"), timeout=60) as r:
        check(r.read() == b"by a signed URL", "download by signed URL")
    up = sbx.upload_url("uploaded.txt")
    body = (
        b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"uploaded.txt\"\r\n"
        b"Content-Type: application/octet-stream\r\n\r\nup by URL\r\n--b--\r\n"
    )
    req = urllib.request.Request(
        up, data=body, method="POST", headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        check(r.status == 200, f"upload by signed URL: {r.status}")
    check(sbx.files.read("uploaded.txt") == "up by URL", "the uploaded file")
    check(sbx.files.get_info("uploaded.txt").owner == "user", "the upload is user's")

    def refused(url, method="GET", data=None):
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=60)
        except urllib.error.HTTPError as e:
            return e.code
        return 200

    url = sbx.download_url("signed.txt")
    check(refused(url.replace("signed.txt", "z.txt")) == 401, "another path, same signature")
    check(refused(url, "POST", body) == 401, "a read URL cannot write")
    check(refused(sbx.download_url("signed.txt", use_signature_expiration=-5)) == 401, "expired")
    check(refused(sbx.download_url("signed.txt", use_signature_expiration=300)) == 200, "not yet expired")


def terminal(sbx):
    from e2b import PtySize

    step("a PTY runs an interactive program as user; resize reaches it")
    out = bytearray()
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=120)
    events = iter(h)

    def until(text):
        while text not in out.decode(errors="replace"):
            _, _, chunk = next(events)
            if chunk:
                out.extend(chunk)

    sbx.pty.send_stdin(h.pid, b"stty size; tty; whoami\n")
    until("24 80")
    until("/dev/pts/")
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    until("30 100")
    sbx.pty.send_stdin(h.pid, b"python3 -c \"print(input('name? ').upper())\"\n")
    until("name? ")
    sbx.pty.send_stdin(h.pid, b"forkd\n")
    until("FORKD")
    sbx.pty.send_stdin(h.pid, b"exit\n")
    r = h.wait(on_pty=lambda d: out.extend(d))
    check(r.exit_code == 0, f"the shell's exit {r.exit_code}")
    text = out.decode(errors="replace")
    # Typed-ahead lines echo between outputs: look for whoami's line after tty's.
    check(re.search(r"/dev/pts/\d+.*?\r\nuser\r\n", text, re.S), f"tty and whoami on the terminal: {text!r}")


def metrics(sbx):
    step("get_metrics: the guest's CPUs, memory and disk; a busy loop shows")
    m = sbx.get_metrics()
    check(len(m) >= 1, f"metrics {m}")
    last = m[-1]
    check(last.cpu_count >= 1, f"cpu_count {last.cpu_count}")
    check(0 < last.mem_used < last.mem_total, f"memory {last.mem_used}/{last.mem_total}")
    check(0 < last.disk_used < last.disk_total, f"disk {last.disk_used}/{last.disk_total}")
    busy = sbx.commands.run("timeout 20 sh -c 'while :; do :; done'", background=True)
    m = sbx.get_metrics()
    check(len(m) >= 2, f"samples kept: {len(m)}")
    check(m[-1].cpu_used_pct > 20, f"cpu_used_pct under a busy loop: {m[-1].cpu_used_pct}")
    sbx.commands.kill(busy.pid)


def snapshots(sbx):
    step("create_snapshot: the sandbox runs on; a create from the snapshot id has its state")
    sbx.files.write("state.txt", "before the snapshot")
    snap = sbx.create_snapshot()
    check(snap.snapshot_id.startswith("e2b-snap-"), f"snapshot id {snap.snapshot_id}")
    check(snap.names == [snap.snapshot_id], f"names {snap.names}")
    check(sbx.commands.run("echo alive").stdout == "alive\n", "the source runs on")
    sbx.files.write("state.txt", "after the snapshot")
    child = Sandbox.create(snap.snapshot_id, timeout=120)
    try:
        got = child.files.read("state.txt")
        check(got == "before the snapshot", f"the child's state {got!r}")
        check(child.commands.run("whoami").stdout == "user\n", "the child's default user")
    finally:
        child.kill()

    step("a named snapshot; a taken name and filesystem-only mode are refused")
    named = sbx.create_snapshot(name="users-named")
    check(named.snapshot_id == "users-named", f"named id {named.snapshot_id}")
    for kwargs, what in (({"name": "users-named"}, "a taken name"), ({"mode": "filesystem"}, "filesystem-only")):
        try:
            sbx.create_snapshot(**kwargs)
            raise AssertionError(f"{what} was accepted")
        except AssertionError:
            raise
        except Exception as e:
            print(f"    refused as it should be: {e}", flush=True)

    step("list_snapshots by sandbox, paged; delete_snapshot")
    mine = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id)
    ids = {s.snapshot_id for s in mine.next_items()}
    check(ids == {snap.snapshot_id, "users-named"}, f"listed {ids}")
    page = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
    first = page.next_items()
    check(len(first) == 1 and page.has_next, f"page of 1: {first}, has_next {page.has_next}")
    second = page.next_items()
    check(len(second) == 1 and second[0].snapshot_id != first[0].snapshot_id, f"second page {second}")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is True, "delete")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is False, "delete of a deleted snapshot")
    check(Sandbox.delete_snapshot("users-named") is True, "delete the named one")
    left = {s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()}
    check(left == set(), f"left after deletes: {left}")


def inotify_fds(sbx):
    """How many inotify instances the guest's processes hold (as root)."""
    r = sbx.commands.run(
        "find /proc/[0-9]*/fd -lname 'anon_inode:inotify' 2>/dev/null | wc -l", user="root"
    )
    return int(r.stdout.strip())


def wait_for(what, cond, seconds=20):
    deadline = time.monotonic() + seconds
    while not cond():
        check(time.monotonic() < deadline, f"{what} within {seconds} s")
        time.sleep(0.1)


def watch(sbx):
    step("watch_dir (polled, recursive) sees writes, new directories and removals")
    sbx.files.make_dir("watched/sub")
    before = inotify_fds(sbx)
    h = sbx.files.watch_dir("watched", recursive=True)
    check(inotify_fds(sbx) == before + 1, "the watch is one inotify instance in the guest")
    sbx.files.write("watched/sub/a.txt", "a")
    sbx.commands.run(
        "cd watched && echo more >> sub/a.txt && mkdir new && echo n > new/b.txt && rm sub/a.txt"
    )
    want = {
        ("sub/a.txt", FilesystemEventType.CREATE),
        ("sub/a.txt", FilesystemEventType.WRITE),
        ("new", FilesystemEventType.CREATE),
        ("new/b.txt", FilesystemEventType.CREATE),
        ("new/b.txt", FilesystemEventType.WRITE),
        ("sub/a.txt", FilesystemEventType.REMOVE),
    }
    seen = set()

    def all_seen():
        seen.update((e.name, e.type) for e in h.get_new_events())
        return want <= seen

    wait_for(f"events {want - seen}", all_seen)
    h.stop()
    wait_for("the guest's watch ended after stop()", lambda: inotify_fds(sbx) == before)
    try:
        h.get_new_events()
        raise AssertionError("get_new_events after stop() answered")
    except SandboxException as e:
        print(f"    a stopped watcher is refused: {e}", flush=True)

    step("watch_dir (async SDK, streamed) sees a write; stop() ends the guest watch")
    asyncio.run(watch_async(sbx.sandbox_id))
    wait_for("the streamed watch ended", lambda: inotify_fds(sbx) == before)


async def watch_async(sandbox_id):
    a = await AsyncSandbox.connect(sandbox_id)
    got = []
    h = await a.files.watch_dir("watched", got.append, recursive=True)
    await a.files.write("watched/new/async.txt", "x")
    for _ in range(200):
        if any(e.name == "new/async.txt" and e.type == FilesystemEventType.WRITE for e in got):
            break
        await asyncio.sleep(0.1)
    await h.stop()
    names = [(e.name, e.type.value) for e in got]
    check(("new/async.txt", "write") in names, f"streamed events {names}")


def killed_mid_command(template):
    step("a sandbox killed mid-command and mid-cell: both calls say it was killed")
    sbx = CodeSandbox.create(template=template, timeout=120)
    out = {}

    def call(name, f):
        try:
            f()
            out[name] = "returned"
        except Exception as e:  # what the SDK raised is the point
            out[name] = e

    threads = [
        threading.Thread(target=call, args=("command", lambda: sbx.commands.run("sleep 60", timeout=0))),
        threading.Thread(target=call, args=("cell", lambda: sbx.run_code("import time\ntime.sleep(60)", timeout=0))),
    ]
    for t in threads:
        t.start()
    wait_for("the command runs", lambda: any("sleep 60" in " ".join([p.cmd, *p.args]) for p in sbx.commands.list()))
    time.sleep(1)  # the cell reached the guest
    Sandbox.kill(sbx.sandbox_id)
    for t in threads:
        t.join(60)
        check(not t.is_alive(), "a call returned after the kill")
    c, cell = out.get("command"), out.get("cell")
    check(isinstance(c, SandboxNotRunningException), f"the command raised {type(c).__name__}: {c}")
    check(isinstance(cell, TimeoutException) and "killed" in str(cell), f"the cell raised {type(cell).__name__}: {cell}")
    print(f"    command: {type(c).__name__}: {c}", flush=True)
    print(f"    cell: {type(cell).__name__}: {cell}", flush=True)


# A guest web server: answers GET with the headers it got, and switches
# an `Upgrade: echo` request to a byte stream it echoes upper-cased.
PORT_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101)
            self.send_header("Connection", "Upgrade")
            self.send_header("Upgrade", "echo")
            self.end_headers()
            self.wfile.flush()
            while True:
                d = self.connection.recv(4096)
                if not d:
                    break
                self.connection.sendall(d.upper())
            self.close_connection = True
            return
        h = self.headers
        body = f"host={h.get('Host')} token={h.get('e2b-traffic-access-token')} access={h.get('x-access-token')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H)
if len(sys.argv) > 2:  # TLS, with this certificate and key
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""


def start_server(sbx, port):
    sbx.files.write("/tmp/port_server.py", PORT_SERVER)
    sbx.commands.run(f"python3 /tmp/port_server.py {port}", background=True)
    host = sbx.get_host(port)
    wait_for(f"the guest server on {port}", lambda: plane_request(host)[0] == 200)
    return host


def ports(template):
    step("get_host(port) reaches a guest server by URL, HTTP and upgrades")
    sbx = Sandbox.create(template=template, timeout=120)
    try:
        host = start_server(sbx, 8000)
        check(host.startswith(f"8000-{sbx.sandbox_id}."), f"get_host: {host}")
        status, _, body = plane_request(host, headers={"X-Access-Token": "stripped"})
        check(status == 200, f"public port: {status} {body}")
        check(body == f"host={host} token=None access=None", f"the guest saw {body!r}")
        status, _, body = plane_request(sbx.get_host(8001))
        check(status == 502 and "nothing listens on port 8001" in body, f"closed port: {status} {body}")
        status, head, sock = plane_request(host, "/ws", upgrade="echo")
        if status != 101:
            sock.close()
        check(status == 101, f"upgrade: {status} {head}")
        sock.sendall(b"hello over the tunnel")
        got = b""
        while len(got) < 21:
            d = sock.recv(64)
            check(d, f"the upgraded stream ended early: {got!r}")
            got += d
        sock.close()
        check(got == b"HELLO OVER THE TUNNEL", f"upgraded stream: {got!r}")
    finally:
        sbx.kill()
    status, _, body = plane_request(host)
    check(status == 502 and "was not found" in body, f"a killed sandbox's URL: {status} {body}")

    step("allow_public_traffic=False wants the traffic token; mask_request_host is the Host the guest sees")
    sbx = Sandbox.create(
        template=template,
        timeout=120,
        network={"allow_public_traffic": False, "mask_request_host": "app.internal:${PORT}"},
    )
    try:
        sbx.files.write("/tmp/port_server.py", PORT_SERVER)
        sbx.commands.run("python3 /tmp/port_server.py 8000", background=True)
        host = sbx.get_host(8000)
        token = {"e2b-traffic-access-token": sbx.traffic_access_token}
        wait_for("the guest server", lambda: plane_request(host, headers=token)[0] == 200)
        status, _, body = plane_request(host)
        check(status == 403 and "e2b-traffic-access-token" in body, f"no token: {status} {body}")
        status, _, body = plane_request(host, headers={"e2b-traffic-access-token": "wrong"})
        check(status == 403, f"a wrong token: {status} {body}")
        status, _, body = plane_request(host, headers=token)
        check(status == 200 and body == "host=app.internal:8000 token=None access=None", f"with the token: {status} {body!r}")
    finally:
        sbx.kill()

    https_ports(template)


def api_post(path, body):
    """A raw POST to the E2B API, for what the SDK cannot send:
    (status, parsed answer)."""
    req = urllib.request.Request(
        os.environ["E2B_API_URL"] + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"X-API-Key": os.environ["E2B_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def https_ports(template):
    # E2B's `network.httpsPorts` (its open-source runtime's API; the SDKs
    # do not send it yet): the plane speaks TLS to those guest ports.
    step("httpsPorts: guest servers speaking TLS are reached over TLS, any certificate")
    import subprocess
    import tempfile

    status, body = api_post("/sandboxes", {"templateID": template, "network": {"httpsPorts": [49983]}})
    check(status == 400 and "envd" in body["message"], f"envd's port: {status} {body}")
    status, body = api_post("/sandboxes", {"templateID": template, "network": {"httpsPorts": [443, 443]}})
    check(status == 400 and "more than once" in body["message"], f"a port twice: {status} {body}")
    d = tempfile.mkdtemp()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=guest.invalid", "-keyout", f"{d}/key.pem", "-out", f"{d}/cert.pem"],
        check=True,
        capture_output=True,
    )
    status, body = api_post(
        "/sandboxes", {"templateID": template, "timeout": 120, "network": {"httpsPorts": [8443, 8444]}}
    )
    check(status == 201, f"create with httpsPorts: {status} {body}")
    sbx = Sandbox.connect(body["sandboxID"])
    try:
        sbx.files.write("/tmp/port_server.py", PORT_SERVER)
        for name in ("cert.pem", "key.pem"):
            with open(f"{d}/{name}", "rb") as f:
                sbx.files.write(f"/tmp/{name}", f.read())
        sbx.commands.run("python3 /tmp/port_server.py 8443 /tmp/cert.pem /tmp/key.pem", background=True)
        sbx.commands.run("python3 /tmp/port_server.py 8444", background=True)
        sbx.commands.run("python3 /tmp/port_server.py 8000", background=True)
        tls = sbx.get_host(8443)
        wait_for("the guest's TLS server", lambda: plane_request(tls)[0] == 200)
        status, _, body = plane_request(tls)
        check(status == 200 and body.startswith(f"host={tls} "), f"over TLS: {status} {body!r}")
        # A port not listed stays plain HTTP.
        wait_for("the guest's plain server", lambda: plane_request(sbx.get_host(8000))[0] == 200)
        # A listed port whose server speaks plain HTTP: a 502 that says so.
        wait_for("the plain server on 8444", lambda: "httpsPorts" in plane_request(sbx.get_host(8444))[2])
        status, _, body = plane_request(sbx.get_host(8444))
        check(status == 502 and "TLS handshake" in body, f"plain HTTP on an https port: {status} {body}")
    finally:
        sbx.kill()


def main():
    template = sys.argv[1]
    step("create")
    sbx = Sandbox.create(template=template, timeout=300)
    try:
        commands(sbx)
        files(sbx)
        metadata(sbx)
        signed_urls(sbx)
        watch(sbx)
        terminal(sbx)
        metrics(sbx)
        snapshots(sbx)
    finally:
        step("kill")
        sbx.kill()
    logs(sbx.sandbox_id)
    killed_mid_command(template)
    ports(template)
    print("E2B USERS OK", flush=True)


if __name__ == "__main__":
    main()
