"""E2B volumes through the unmodified E2B SDK (docs/e2b.md, "Volumes").

Run by tests/tests/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
E2B_VOLUME_API_URL pointing at a real poold whose config has volume_roots,
and as the first argument a template whose snapshot has a volume at
/mnt/vol. Every check raises on failure; the last line printed is
`E2B VOLUMES OK` when all passed.
"""

import sys

from e2b import Sandbox, Volume
from e2b.volume.types import VolumeFileType


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def step(name):
    print(f"--- {name}", flush=True)


def refused(what, call, *words):
    try:
        call()
    except Exception as e:  # the SDK's VolumeException, SandboxException, ...
        text = str(e)
        for w in words:
            check(w in text, f"{what}: the refusal says {w!r}: {text}")
        return
    raise AssertionError(f"{what} was accepted")


def main():
    template = sys.argv[1]
    step("create, connect, list; a taken name is refused")
    vol = Volume.create("forkd-test-vol")
    check(vol.name == "forkd-test-vol", f"name {vol.name}")
    again = Volume.connect(vol.volume_id)
    check(again.name == vol.name, "connect")
    check(vol.volume_id in [v.volume_id for v in Volume.list()], "list")
    refused("a second create of the name", lambda: Volume.create("forkd-test-vol"), "exists")
    refused("a name with a slash", lambda: Volume.create("a/b"), "volume name")

    step("files through the content API, no sandbox")
    info = vol.write_file("/in/hello.txt", "hello from the API", force=True)
    check(info.path == "/in/hello.txt" and info.size == 18, f"write_file {info}")
    check(vol.read_file("/in/hello.txt") == "hello from the API", "read_file")
    refused("a write over a file without force", lambda: vol.write_file("/in/hello.txt", "x"), "force")
    vol.write_file("/in/hello.txt", "hello from the API", force=True)
    d = vol.make_dir("/made/deep", force=True)
    check(d.type == VolumeFileType.DIRECTORY, f"make_dir {d}")
    names = sorted(e.path for e in vol.list("/", depth=3))
    check(names == ["/in", "/in/hello.txt", "/made", "/made/deep"], f"list {names}")
    st = vol.update_metadata("/in/hello.txt", mode=0o4644)
    check(st.mode == 0o644, f"mode without its set-id bit: {oct(st.mode)}")
    check(vol.exists("/made") and not vol.exists("/nope"), "exists")
    vol.remove("/made")
    check(not vol.exists("/made"), "remove")
    refused("a wrong token", lambda: Volume("forkd-test-vol", "forkd-test-vol", token="wrong").list("/"), "token")

    step("mounted into two sandboxes at the template's volume path")
    a = Sandbox.create(template=template, timeout=120, volume_mounts={"/mnt/vol": vol})
    b = Sandbox.create(template=template, timeout=120, volume_mounts={"/mnt/vol": "forkd-test-vol"})
    try:
        r = a.commands.run("whoami")
        check(r.stdout == "user\n", f"commands run as E2B's user: {r.stdout!r}")
        mounts = a.get_info().volume_mounts
        check(mounts == [{"name": "forkd-test-vol", "path": "/mnt/vol"}], f"get_info's volume_mounts: {mounts}")
        listed = [s for s in Sandbox.list().next_items() if s.sandbox_id == b.sandbox_id]
        check(listed and listed[0].volume_mounts == mounts, f"list's volume_mounts: {listed}")
        r = a.commands.run("cat /mnt/vol/in/hello.txt")
        check(r.stdout == "hello from the API", f"the guest reads the API's file: {r.stdout!r}")
        a.commands.run("echo from a > /mnt/vol/from-a.txt")
        r = b.commands.run("cat /mnt/vol/from-a.txt")
        check(r.stdout == "from a\n", f"another sandbox sees it: {r.stdout!r}")
        check(vol.read_file("/from-a.txt") == "from a\n", "the API sees a guest's file")
        b.commands.run("ln -s /etc/passwd /mnt/vol/pw")
        refused("reading a guest's symlink", lambda: vol.read_file("/pw"), "symlink")
    finally:
        a.kill()
        b.kill()

    step("a mount the template cannot take is refused, naming why")
    refused(
        "a mount where the template has no volume",
        lambda: Sandbox.create(template=template, timeout=60, volume_mounts={"/elsewhere": vol}),
        "/elsewhere",
    )
    refused(
        "a volume that does not exist",
        lambda: Sandbox.create(template=template, timeout=60, volume_mounts={"/mnt/vol": "nope"}),
        "not found",
    )

    step("destroy: files gone, a second destroy is False")
    check(Volume.destroy(vol.volume_id) is True, "destroy")
    check(Volume.destroy(vol.volume_id) is False, "a second destroy")
    refused("connect after destroy", lambda: Volume.connect(vol.volume_id), "not found")
    print("E2B VOLUMES OK", flush=True)


if __name__ == "__main__":
    main()
