"""The unmodified E2B SDK through forkd-gateway (docs/cluster.md).

Run by tests/tests/gateway.rs with E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY pointing at the gateway's E2B planes, in front of several poold
nodes; arguments: the template (a snapshot tag every node can spawn) and how
many sandboxes to create. Every check raises on failure. Prints
`IDS <json list>` of the sandboxes it leaves running (the test checks which
nodes they landed on, then kills them) and last `E2B GATEWAY OK <version>`.
"""

import json
import sys
import time
import uuid

import e2b
from e2b import Sandbox, SandboxQuery

from e2b_sdk import check, plane_request, step

try:
    from importlib.metadata import version
except ImportError:  # pragma: no cover
    version = None


def listed(run_id, limit):
    """Every sandbox of this run, paged `limit` at a time."""
    out = []
    pager = Sandbox.list(query=SandboxQuery(metadata={"run": run_id}), limit=limit)
    while pager.has_next:
        page = pager.next_items()
        check(len(page) <= limit, f"page of {len(page)} with limit={limit}")
        out.extend(s.sandbox_id for s in page)
    return out


# A guest server that switches protocols (as a WebSocket server does)
# and then echoes: busybox nc runs it per connection.
UPGRADE_SERVER = r"""
while read -r line; do
  line=$(printf %s "$line" | tr -d '\r')
  [ -z "$line" ] && break
done
printf 'HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n'
exec cat
"""


def upgrades(b):
    step(f"{b.sandbox_id}: an upgrade (WebSocket) to a guest port goes through the gateway")
    b.files.write("/tmp/upgrade.sh", UPGRADE_SERVER)
    b.commands.run("nc -ll -p 8000 -e sh /tmp/upgrade.sh", background=True)
    host = b.get_host(8000)
    deadline = time.time() + 60
    while True:
        status, head, sock = plane_request(host, upgrade="echo")
        if status == 101:
            break
        sock.close()
        check(time.time() < deadline, f"no 101 from the guest: {head}")
        time.sleep(0.5)
    sock.sendall(b"hello through the gateway")
    got = b""
    while len(got) < 25:
        d = sock.recv(64)
        check(d, f"the upgraded stream ended early: {got!r}")
        got += d
    sock.close()
    check(got == b"hello through the gateway", f"echoed {got!r}")


def main():
    template, count = sys.argv[1], int(sys.argv[2])
    run_id = uuid.uuid4().hex
    step(f"create {count} through the gateway")
    boxes = [
        Sandbox.create(template, metadata={"run": run_id}, timeout=600)
        for _ in range(count)
    ]
    ids = [b.sandbox_id for b in boxes]
    check(len(set(ids)) == count, f"ids {ids}")

    for b in boxes:
        step(f"{b.sandbox_id}: commands and files reach its node")
        r = b.commands.run("hostname")
        check(r.stdout.strip() == b.sandbox_id, f"hostname {r.stdout!r}")
        lines = []
        r = b.commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=lines.append
        )
        check("".join(lines).split() == ["line1", "line2", "line3"], f"streamed {lines}")
        b.files.write("/tmp/gw.txt", f"hello {b.sandbox_id}")
        check(b.files.read("/tmp/gw.txt") == f"hello {b.sandbox_id}", "file read back")
        check(b.get_info().sandbox_id == b.sandbox_id, "info")
        b.set_timeout(900)

    upgrades(boxes[0])

    step("list: every node's sandboxes, paged across nodes")
    check(sorted(listed(run_id, 1)) == sorted(ids), f"paged list vs {ids}")
    check(sorted(listed(run_id, 100)) == sorted(ids), f"list vs {ids}")

    step("connect by id")
    again = Sandbox.connect(ids[0])
    check(again.commands.run("cat /tmp/gw.txt").stdout == f"hello {ids[0]}", "file after connect")

    step("kill one; it is gone from the list and from connect")
    gone = boxes.pop()
    check(Sandbox.kill(gone.sandbox_id) is True, "kill answered")
    check(gone.sandbox_id not in listed(run_id, 100), "killed sandbox listed")
    try:
        Sandbox.connect(gone.sandbox_id)
        raise AssertionError("connect to a killed sandbox did not raise")
    except e2b.SandboxException:
        pass

    print("IDS " + json.dumps([b.sandbox_id for b in boxes]), flush=True)
    v = version("e2b") if version else "?"
    print(f"E2B GATEWAY OK {v}", flush=True)


if __name__ == "__main__":
    main()
