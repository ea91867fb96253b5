"""E2B state across a poold restart, with the unmodified E2B SDK.

Run by tests/tests/e2b.rs in two phases around a poold killed with SIGKILL
and started again, after it created a sandbox through the E2B API
(template, metadata {"run": RUN_ID}, envVars {"SBX_ENV": "from-create"}).
E2B_API_URL and E2B_SANDBOX_URL point at the poold of the moment.

  e2b_restart.py pause TEMPLATE SANDBOX_ID RUN_ID    before the kill
  e2b_restart.py resume TEMPLATE SANDBOX_ID RUN_ID   after the restart

`pause` leaves Python state and a file in the sandbox, pauses it, resumes
it through the same `Sandbox` object, pauses it again, and creates a second
sandbox that pauses itself at its timeout (`on_timeout: pause`). After
the restart the test resumes the first by a raw connect; `resume` checks
its state and resumes the second with a connect. Every check raises
on failure; the last line printed is `E2B RESTART OK <version>`.
"""

import sys
import time
from datetime import datetime, timedelta, timezone

from e2b import Sandbox, SandboxQuery, SandboxState
from e2b_code_interpreter import Sandbox as CodeSandbox

try:
    from importlib.metadata import version
except ImportError:  # pragma: no cover
    version = None


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def step(what):
    print(f"-- {what}", flush=True)


def ids(state, run_id):
    q = SandboxQuery(metadata={"run": run_id}, state=[state])
    return sorted(s.sandbox_id for s in Sandbox.list(query=q).next_items())


def wait_paused(sandbox_id, secs):
    deadline = time.monotonic() + secs
    while Sandbox.get_info(sandbox_id).state != SandboxState.PAUSED:
        check(time.monotonic() < deadline, f"{sandbox_id} not paused after {secs} s")
        time.sleep(1)


def pause_phase(template, sandbox_id, run_id):
    step("state in the sandbox, then pause")
    sbx = CodeSandbox.connect(sandbox_id)
    check(sbx.run_code("x = 41\nx").text == "41", "run_code before the pause")
    sbx.files.write("kept.txt", "kept across pauses")
    check(sbx.pause() is True, "pause")
    check(sbx.pause() is False, "a second pause: already paused")
    info = Sandbox.get_info(sandbox_id)
    check(info.state == SandboxState.PAUSED, f"state after the pause: {info.state}")
    check(info.metadata.get("run") == run_id, f"metadata of the paused: {info.metadata}")
    check(ids(SandboxState.PAUSED, run_id) == [sandbox_id], "listed as paused")
    check(ids(SandboxState.RUNNING, run_id) == [], "not listed as running")

    step("the same object resumes, with its state, and pauses again")
    sbx.connect()
    check(sbx.get_info().state == SandboxState.RUNNING, "running after connect")
    ex = sbx.run_code("x + 1")
    check(ex.text == "42", f"Python state after the resume: {ex.text!r} {ex.error}")
    check(sbx.files.read("kept.txt") == "kept across pauses", "the file after the resume")
    check(sbx.commands.run("echo $SBX_ENV").stdout == "from-create\n", "envs after the resume")
    sbx.run_code("x = 100")
    check(sbx.pause() is True, "the second pause")

    step("a sandbox that pauses at its timeout")
    auto = Sandbox.create(
        template=template,
        timeout=8,
        metadata={"run": run_id, "auto": "1"},
        lifecycle={"on_timeout": "pause"},
    )
    auto.files.write("auto.txt", "paused by its timeout")
    wait_paused(auto.sandbox_id, 300)
    check(ids(SandboxState.PAUSED, run_id) == sorted([sandbox_id, auto.sandbox_id]), "both paused")
    print(f"AUTO {auto.sandbox_id}", flush=True)


def resume_phase(template, sandbox_id, run_id):
    step("after the restart (tests/tests/e2b.rs resumed the first by a connect)")
    paused = ids(SandboxState.PAUSED, run_id)
    check(len(paused) == 1 and sandbox_id not in paused, f"paused after the restart: {paused}")
    auto_id = paused[0]
    sbx = CodeSandbox.connect(sandbox_id)
    check(sbx.sandbox_id == sandbox_id, f"connect id {sbx.sandbox_id}")
    ex = sbx.run_code("x + 1")
    check(ex.text == "101", f"Python state after restart and resume: {ex.text!r} {ex.error}")
    check(sbx.files.read("kept.txt") == "kept across pauses", "the file after the restart")

    info = sbx.get_info()
    check(info.metadata.get("run") == run_id, f"metadata after the restart: {info.metadata}")
    check(info.template_id == template, f"template after the restart: {info.template_id}")
    r = sbx.commands.run("echo $SBX_ENV")
    check(r.stdout == "from-create\n", f"create-time envs after the restart: {r.stdout!r}")
    r = sbx.commands.run("echo $SBX_ENV", envs={"SBX_ENV": "per-call"})
    check(r.stdout == "per-call\n", f"a call's own env wins: {r.stdout!r}")
    check(ids(SandboxState.RUNNING, run_id) == [sandbox_id], "running after the resume")

    step("list filters: template, started_after")
    def listed(**kw):
        q = SandboxQuery(metadata={"run": run_id}, state=[SandboxState.RUNNING], **kw)
        return [s.sandbox_id for s in Sandbox.list(query=q).next_items()]

    check(listed(template=template) == [sandbox_id], "the template filter")
    check(listed(template="no-such-template") == [], "another template")
    now = datetime.now(timezone.utc)
    check(listed(started_after=now - timedelta(days=1)) == [sandbox_id], "started after")
    check(listed(started_after=now + timedelta(days=1)) == [], "started before")

    step("the auto-paused sandbox resumes too")
    auto = Sandbox.connect(auto_id)
    check(auto.files.read("auto.txt") == "paused by its timeout", "the auto-paused file")

    step("kill, running and paused")
    check(auto.pause() is True, "pause before the kill")
    check(Sandbox.kill(auto_id) is True, "kill of a paused sandbox")
    check(sbx.kill() is True, "kill after the restart")
    left = Sandbox.list(query=SandboxQuery(metadata={"run": run_id})).next_items()
    check(left == [], f"left after the kills: {[s.sandbox_id for s in left]}")


def main():
    phase, template, sandbox_id, run_id = sys.argv[1:5]
    ver = version("e2b") if version else "?"
    print(f"e2b {ver}: {phase} of sandbox {sandbox_id}", flush=True)
    {"pause": pause_phase, "resume": resume_phase}[phase](template, sandbox_id, run_id)
    print(f"E2B RESTART OK {ver}", flush=True)


if __name__ == "__main__":
    main()
