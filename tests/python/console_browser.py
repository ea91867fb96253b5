"""The web console (docs/console.md) in Debian's headless Chromium, driven
by Playwright. Run by tests/tests/console.rs with one argument, a JSON spec:

    {"url": "http://127.0.0.1:PORT/console/", "token": "...",
     "sandbox": "sb-...", "tag": "m", "marker": "hi-<random>",
     "chromium": "/usr/bin/chromium"}

Launches the given Chromium binary (never downloads one). Steps, as an
operator would, by labels and roles (what a screen reader announces):

1. open the console without a token: the page loads, its data calls are
   refused (401) and it says so; a wrong token is refused too; the right
   one is accepted;
2. the spawned `sandbox` is listed;
3. its terminal runs `echo <marker>` and shows the output line;
4. the spawn form spawns one more sandbox;
5. `sandbox` is killed from the console and leaves the list;
6. the pool of `tag` is resized to 2 and its children fill (the pools
   table read while they do).

Also records the nodes table and the header line (a gateway lists its
nodes there). Prints one JSON object of what it saw; the Rust side checks it and the
node's state.
"""

import json
import re
import sys
import time

from playwright.sync_api import expect
from playwright.sync_api import sync_playwright

TIMEOUT_MS = 180_000


def main():
    spec = json.loads(sys.argv[1])
    out = {"responses": [], "console_errors": []}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=spec["chromium"],
            headless=True,
            # As root, Chromium's own sandbox cannot start.
            args=["--no-sandbox"],
        )
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        phase = {"now": "no-token"}
        page.on(
            "response",
            lambda r: out["responses"].append(
                {"phase": phase["now"], "url": r.url, "status": r.status}
            ),
        )
        page.on(
            "console",
            lambda m: m.type == "error" and out["console_errors"].append(m.text),
        )
        page.on("pageerror", lambda e: out["console_errors"].append(str(e)))

        # 1. No token: refused, and said.
        main_resp = page.goto(spec["url"], wait_until="load")
        out["page_status"] = main_resp.status
        out["page_headers"] = main_resp.headers
        status = page.locator("#auth-status")
        expect(status).to_contain_text("401")
        out["refusal_text"] = status.inner_text()
        out["rows_without_token"] = page.locator("#sandboxes-body tr").count()

        phase["now"] = "wrong-token"
        page.get_by_label(re.compile("Bearer token")).fill("wrong-" + spec["token"])
        page.get_by_role("button", name="Use token").click()
        expect(status).to_contain_text("token is wrong")
        out["wrong_token_text"] = status.inner_text()

        phase["now"] = "token"
        page.get_by_label(re.compile("Bearer token")).fill(spec["token"])
        page.get_by_role("button", name="Use token").press("Enter")
        # 2. The sandbox is listed.
        row = page.locator("#sandboxes-body tr", has_text=spec["sandbox"])
        expect(row).to_have_count(1)
        expect(status).to_have_text("")
        out["row_text"] = row.inner_text()
        expect(page.locator("#nodes-body tr").first).to_contain_text("up")
        out["nodes_text"] = page.locator("#nodes-body").inner_text()
        out["node_line"] = page.locator("#node-line").inner_text()

        # 3. Its terminal runs echo.
        page.get_by_role("button", name="Open a terminal in " + spec["sandbox"]).click()
        line = page.get_by_label("Input (Enter sends the line)")
        expect(line).to_be_enabled()
        expect(line).to_be_focused()
        line.fill("echo " + spec["marker"])
        line.press("Enter")
        term = page.locator("#term-out")
        page.wait_for_function(
            "m => document.getElementById('term-out').textContent"
            ".split('\\n').some(l => l.trim() === m)",
            arg=spec["marker"],
        )
        out["terminal"] = term.inner_text()
        out["terminal_state"] = page.locator("#term-state").inner_text()

        # 4. Spawn one more from the form.
        spawn = page.locator("#spawn-form")
        spawn.get_by_label("Snapshot").select_option(spec["tag"])
        spawn.get_by_label("How many").fill("1")
        spawn.get_by_role("button", name="Spawn", exact=True).click()
        expect(page.locator("#status")).to_contain_text("Spawned sb-")
        out["spawn_status"] = page.locator("#status").inner_text()
        expect(page.locator("#sandboxes-body tr")).to_have_count(2)

        # 5. Kill the first one from the console.
        page.get_by_role("button", name="Kill " + spec["sandbox"]).click()
        expect(row).to_have_count(0)
        expect(page.locator("#status")).to_contain_text("Killed " + spec["sandbox"])
        out["kill_status"] = page.locator("#status").inner_text()
        out["rows_after_kill"] = page.locator("#sandboxes-body tr").count()

        # 6. Resize the pool and watch it fill.
        form = page.locator("#pool-form")
        form.get_by_label("Snapshot").select_option(spec["tag"])
        form.get_by_label("Min ready").fill("2")
        form.get_by_role("button", name="Set pool size").click()
        pool = page.locator("#pools-body tr", has_text=spec["tag"])
        seen = []
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while time.monotonic() < deadline:
            if pool.count() == 1:
                cells = [c.inner_text() for c in pool.locator("th, td").all()]
                if not seen or seen[-1] != cells:
                    seen.append(cells)
                if cells[3] == "2" and cells[4] == "0":
                    break
            time.sleep(0.2)
        out["pool_seen"] = seen

        # The plots were drawn from /metrics.
        out["latency_desc"] = page.locator("#plot-latency desc").text_content()
        out["fanout_desc"] = page.locator("#plot-fanout desc").text_content()
        out["snapshot_tree"] = page.locator("#snapshot-tree").inner_text()
        browser.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
