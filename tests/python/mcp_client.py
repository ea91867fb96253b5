"""Drives `forkd mcp` with the official MCP Python SDK against a real poold.

Usage: mcp_client.py stdio|http

Environment: FORKD_BIN (the forkd binary), FORKD_URL and FORKD_TOKEN (the
poold to drive), MCP_TEST_TAG (a snapshot of an image with Python).
Exits non-zero, with what failed, when anything is not as expected.
Started by tests/tests/mcp.rs.
"""

import json
import os
import subprocess
import sys
import tempfile

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

FORKD = os.environ["FORKD_BIN"]
TAG = os.environ["MCP_TEST_TAG"]
TOOLS = {
    "spawn", "exec", "eval", "read_file", "write_file", "list_files", "branch",
    "kill", "list_sandboxes", "list_snapshots", "snapshot_info", "list_pools", "set_pool",
}


def say(*a):
    print("mcp_client:", *a, file=sys.stderr, flush=True)


def poold_env():
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FORKD_LOG": "warn"}
    for k in ("FORKD_URL", "FORKD_TOKEN"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


async def call(client, name, args, ok=True, progress=None):
    r = await client.call_tool(name, args, progress_callback=progress)
    text = "".join(getattr(c, "text", "") for c in r.content)
    assert r.is_error is not ok, f"{name}({args}): is_error={r.is_error}: {text}"
    if not ok:
        return text
    assert isinstance(r.structured_content, dict), f"{name}: no structured content: {text}"
    assert json.loads(text) == r.structured_content, f"{name}: text and structured differ"
    return r.structured_content


async def drive(client, label):
    tools = {t.name for t in (await client.list_tools()).tools}
    assert TOOLS <= tools, f"tools missing: {TOOLS - tools}"
    spawn_schema = next(t for t in (await client.list_tools()).tools if t.name == "spawn").input_schema
    assert "snapshot_tag" in spawn_schema["properties"], spawn_schema

    snaps = await call(client, "list_snapshots", {})
    assert TAG in [s["tag"] for s in snaps["snapshots"]], snaps

    # spawn
    made = await call(client, "spawn", {"snapshot_tag": TAG})
    (sb,) = made["sandboxes"]
    sid = sb["id"]
    assert sid.startswith("sb-"), sb
    listed = await call(client, "list_sandboxes", {})
    assert sid in [s["id"] for s in listed["sandboxes"]], listed
    say(label, "spawned", sid)

    # exec, with output streamed as progress notifications
    chunks = []

    async def on_progress(progress, total, message):
        chunks.append((progress, message))

    r = await call(
        client, "exec",
        {"sandbox_id": sid, "cmd": "echo one; sleep 1; echo two >&2; sleep 1; echo three"},
        progress=on_progress,
    )
    assert r["stdout"] == "one\nthree\n", r
    assert r["stderr"] == "two\n", r
    assert r["exit_code"] == 0 and r["timed_out"] is False, r
    streamed = "".join(m or "" for _, m in chunks)
    assert "one" in streamed and "two" in streamed and "three" in streamed, chunks
    assert len(chunks) >= 3, f"output arrived in {len(chunks)} notifications: {chunks}"
    progress = [p for p, _ in chunks]
    assert progress == sorted(progress) and len(set(progress)) == len(progress), progress
    r = await call(client, "exec", {"sandbox_id": sid, "args": ["sh", "-c", "exit 3"]})
    assert r["exit_code"] == 3, r
    say(label, "exec streamed", len(chunks), "notifications")

    # eval
    r = await call(client, "eval", {"sandbox_id": sid, "code": "x = 6 * 7\nprint('hi')\nx"})
    assert r["result"] == "42" and r["stdout"] == "hi\n" and r["error"] is None, r
    r = await call(client, "eval", {"sandbox_id": sid, "code": "1 / 0"})
    assert r["error"].startswith("ZeroDivisionError"), r
    assert "Traceback" in r["traceback"], r

    # files
    await call(client, "write_file", {"sandbox_id": sid, "path": "/tmp/mcp dir/a.txt", "content": "héllo\n"})
    r = await call(client, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp dir/a.txt"})
    assert r["content"] == "héllo\n" and r["encoding"] == "utf-8", r
    await call(client, "write_file", {"sandbox_id": sid, "path": "/tmp/mcp dir/b.bin", "content": "AP8A", "encoding": "base64"})
    r = await call(client, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp dir/b.bin"})
    assert r["encoding"] == "base64" and r["content"] == "AP8A", r
    r = await call(client, "list_files", {"sandbox_id": sid, "path": "/tmp/mcp dir"})
    assert sorted(e["name"] for e in r["entries"]) == ["a.txt", "b.bin"], r
    text = await call(client, "read_file", {"sandbox_id": sid, "path": "/nope/x"}, ok=False)
    assert "404" in text, text
    text = await call(client, "read_file", {"sandbox_id": sid, "path": "relative"}, ok=False)
    assert "absolute" in text, text

    # branch: a new snapshot with the sandbox's state in it
    btag = f"mcp-{label}-branch"
    r = await call(client, "branch", {"sandbox_id": sid, "tag": btag})
    assert r["tag"] == btag and r["status"] == "ready", r
    info = await call(client, "snapshot_info", {"tag": btag})
    assert info["parent_tag"] == TAG, info
    child = (await call(client, "spawn", {"snapshot_tag": btag}))["sandboxes"][0]["id"]
    r = await call(client, "eval", {"sandbox_id": child, "code": "x"})
    assert r["result"] == "42", f"the branch lost the interpreter's state: {r}"
    r = await call(client, "read_file", {"sandbox_id": child, "path": "/tmp/mcp dir/a.txt"})
    assert r["content"] == "héllo\n", r
    say(label, "branched", btag, "and spawned", child, "from it")

    # pools
    r = await call(client, "set_pool", {"tag": btag, "min_ready": 0, "max_ready": 0})
    assert r["tag"] == btag and r["min_ready"] == 0, r
    pools = await call(client, "list_pools", {})
    assert isinstance(pools["pools"], list), pools
    text = await call(client, "set_pool", {"tag": btag, "min_ready": 5, "max_ready": 1}, ok=False)
    assert "max_ready" in text, text

    # kill
    for s in (sid, child):
        r = await call(client, "kill", {"sandbox_id": s})
        assert r["killed"] == s, r
    listed = await call(client, "list_sandboxes", {})
    assert not {sid, child} & {s["id"] for s in listed["sandboxes"]}, listed
    text = await call(client, "exec", {"sandbox_id": sid, "cmd": "true"}, ok=False)
    assert "404" in text and "not found" in text, text
    text = await call(client, "kill", {"sandbox_id": "../etc"}, ok=False)
    assert "not a valid sandbox id" in text, text
    say(label, "spawn → exec → eval → files → branch → kill: ok")


async def over_stdio():
    params = StdioServerParameters(command=FORKD, args=["mcp"], env=poold_env())
    async with Client(params) as client:
        await drive(client, "stdio")


async def over_http():
    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        token = "mcp-test-" + os.urandom(16).hex()
        f.write(token + "\n")
    os.chmod(f.name, 0o600)
    proc = subprocess.Popen(
        [FORKD, "mcp", "--http", "127.0.0.1:0", "--token-file", f.name],
        env=poold_env(), stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        prefix = "forkd mcp listening on "
        assert line.startswith(prefix), f"forkd mcp said {line!r}"
        url = line[len(prefix):]
        say("http", url)
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "probe", "version": "0"}}}
        hdrs = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
        async with httpx2.AsyncClient() as h:
            r = await h.post(url, json=init, headers={**hdrs, "Authorization": "Bearer wrong"})
            assert r.status_code == 401, (r.status_code, r.text)
            r = await h.post(url, json=init, headers={k: v for k, v in hdrs.items() if k != "Authorization"})
            assert r.status_code == 401, (r.status_code, r.text)
            r = await h.post(url, json=init, headers={**hdrs, "Host": "evil.example"})
            assert r.status_code == 403, ("DNS rebinding", r.status_code, r.text)
            r = await h.post(url, json=init, headers={**hdrs, "Origin": "http://evil.example"})
            assert r.status_code == 403, ("cross-origin", r.status_code, r.text)
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=600)
        async with Client(streamable_http_client(url, http_client=http)) as client:
            await drive(client, "http")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        os.unlink(f.name)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    anyio.run({"stdio": over_stdio, "http": over_http}[mode])
    print(f"mcp_client {mode}: ok")


if __name__ == "__main__":
    main()
