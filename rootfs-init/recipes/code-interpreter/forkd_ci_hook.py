"""The warm interpreter's side of forkd's code interpreter (forkd_ci.py).

The image's agent imports this module in its warm interpreter
(FORKD_WARMUP_IMPORTS) and runs wait_ready() as its warm-up, so the agent
reports ready, and a snapshot is taken, only once the code interpreter's
default contexts run: a forked child's first cell pays no kernel start.
At each child's hand-out the agent calls forkd_reseed() with fresh
entropy, which the server applies in every context before its next cell.
"""

import json
import time
import urllib.error
import urllib.request

URL = "http://127.0.0.1:49999"
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_ready(timeout=900):
    """Waits until the code interpreter's default contexts are up."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with _opener.open(URL + "/forkd/ready", timeout=10) as r:
                return json.load(r)
        except (urllib.error.URLError, OSError) as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError("the code interpreter on %s was not ready within %ss: %s" % (URL, timeout, last))


def forkd_reseed(seed):
    """Called by forkd's agent at hand-out with fresh entropy."""
    body = json.dumps({"seed": bytes(seed).hex()}).encode()
    req = urllib.request.Request(URL + "/forkd/reseed", data=body, headers={"Content-Type": "application/json"})
    with _opener.open(req, timeout=30) as r:
        r.read()


def run(code, language=None):
    """Runs a cell in the code interpreter's default context of `language`
    (Python by default) and returns its lines; raises if the cell fails.
    For a snapshot's warm-up: `--eval-warmup "forkd_ci_hook.run('import pandas')"`
    leaves the import done in the kernel every child forks from."""
    body = json.dumps({"code": code, "language": language}).encode()
    req = urllib.request.Request(URL + "/execute", data=body, headers={"Content-Type": "application/json"})
    with _opener.open(req, timeout=900) as r:
        lines = [json.loads(line) for line in r.read().splitlines() if line.strip()]
    for line in lines:
        if line.get("type") == "error":
            raise RuntimeError("%s: %s\n%s" % (line.get("name"), line.get("value"), line.get("traceback")))
    return lines
