"""Playwright's connect_over_cdp against forked browser sandboxes
(docs/browser.md). Run by tests/tests/browser.rs with one argument, a JSON
spec:

    {"children": [{"endpoint": "http://127.0.0.1:PORT", "id": "child-0",
                   "url": "http://.../page?id=child-0", "tls_url": "https://...",
                   "shot": "/path/child-0.png"}, ...],
     "untouched": "http://127.0.0.1:PORT"}

Each child's browser is driven through its own published DevTools port:
its warm page is listed, draws from its generators are taken in it, it
navigates to its own URL, its page is read back and screenshotted, then it
opens `tls_url` (a TLS handshake with the test's server). The `untouched`
child is only looked at. Prints one JSON object; checks that need all
children together are the Rust side's. Never downloads a browser:
connect_over_cdp needs none.
"""

import json
import sys
import time

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

TIMEOUT_MS = 180_000

# Draws from the browser's generators: V8's Math.random and base::RandBytes
# (getRandomValues). The pages are no secure contexts (plain HTTP, or
# about:blank), so WebCrypto and randomUUID are not there; BoringSSL is
# drawn from by the TLS handshake instead.
DRAWS = """() => ({
  math_random: Math.random(),
  get_random_values: Array.from(crypto.getRandomValues(new Uint8Array(16)),
    (b) => b.toString(16).padStart(2, '0')).join(''),
})"""

# The clock as the page sees it, and a timer armed after the hand-out.
CLOCK = """() => new Promise((resolve) => {
  const t0 = performance.now();
  setTimeout(() => resolve({date_now: Date.now(), timer_ms: performance.now() - t0}), 100);
})"""


def page_urls(browser):
    return [p.url for c in browser.contexts for p in c.pages]


def drive(pw, child):
    t0 = time.monotonic()
    browser = pw.chromium.connect_over_cdp(child["endpoint"], timeout=TIMEOUT_MS)
    out = {"id": child["id"], "connect_s": time.monotonic() - t0}
    out["pages_before"] = page_urls(browser)
    page = browser.contexts[0].pages[0]
    page.set_default_timeout(TIMEOUT_MS)
    out["warm_page_draws"] = page.evaluate(DRAWS)
    t0 = time.monotonic()
    page.goto(child["url"], wait_until="load")
    out["navigate_s"] = time.monotonic() - t0
    out["text"] = page.inner_text("#child")
    out["title"] = page.title()
    out["draws"] = page.evaluate(DRAWS)
    out["clock"] = page.evaluate(CLOCK)
    out["host_now_ms"] = time.time() * 1000
    t0 = time.monotonic()
    page.screenshot(path=child["shot"])
    out["screenshot_s"] = time.monotonic() - t0
    # A TLS handshake from the browser (its network service): the test's
    # server keeps the ClientHello and answers nothing more.
    try:
        page.goto(child["tls_url"], timeout=60_000)
    except PlaywrightError as e:
        out["tls_error"] = str(e).splitlines()[0]
    out["pages_after"] = page_urls(browser)
    return out


def main():
    spec = json.loads(sys.argv[1])
    report = {"children": []}
    with sync_playwright() as pw:
        for child in spec["children"]:
            report["children"].append(drive(pw, child))
        browser = pw.chromium.connect_over_cdp(spec["untouched"], timeout=TIMEOUT_MS)
        report["untouched_pages"] = page_urls(browser)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
