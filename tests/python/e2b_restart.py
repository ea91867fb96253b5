"""E2B state across a poold restart, with the unmodified E2B SDK.

Run by tests/tests/e2b.rs after it created a sandbox through the E2B API
(template, metadata {"run": RUN_ID}, envVars {"SBX_ENV": "from-create"}),
killed poold with SIGKILL and started it again: E2B_API_URL and
E2B_SANDBOX_URL point at the new poold. Arguments: TEMPLATE SANDBOX_ID
RUN_ID. Every check raises on failure; the last line printed is
`E2B RESTART OK <version>` when everything passed.
"""

import sys

from e2b import Sandbox, SandboxQuery

try:
    from importlib.metadata import version
except ImportError:  # pragma: no cover
    version = None


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    template, sandbox_id, run_id = sys.argv[1:4]
    ver = version("e2b") if version else "?"
    print(f"e2b {ver}: sandbox {sandbox_id} after a poold restart", flush=True)

    sbx = Sandbox.connect(sandbox_id)
    check(sbx.sandbox_id == sandbox_id, f"connect id {sbx.sandbox_id}")

    info = sbx.get_info()
    check(info.metadata.get("run") == run_id, f"metadata after the restart: {info.metadata}")
    check(info.template_id == template, f"template after the restart: {info.template_id}")

    r = sbx.commands.run("echo $SBX_ENV")
    check(r.stdout == "from-create\n", f"create-time envs after the restart: {r.stdout!r}")
    r = sbx.commands.run("echo $SBX_ENV", envs={"SBX_ENV": "per-call"})
    check(r.stdout == "per-call\n", f"a call's own env wins: {r.stdout!r}")

    listed = Sandbox.list(query=SandboxQuery(metadata={"run": run_id})).next_items()
    check(
        [s.sandbox_id for s in listed] == [sandbox_id],
        f"list by metadata after the restart: {[s.sandbox_id for s in listed]}",
    )

    check(sbx.kill() is True, "kill after the restart")
    print(f"E2B RESTART OK {ver}", flush=True)


if __name__ == "__main__":
    main()
