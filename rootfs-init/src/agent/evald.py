# forkd warm interpreter: a persistent Python process that forkd-agent drives
# over fds 3 (requests) and 4 (replies), one JSON object per line. It imports
# the warm-up modules once; forked children inherit it already warm.
import ast
import contextlib
import io
import json
import linecache
import os
import random
import sys
import time
import traceback

_in = os.fdopen(3, "rb")
_out = os.fdopen(4, "wb")
NS = {"__name__": "__forkd__", "__builtins__": __builtins__}
MAX_REPR = 8 << 20
_counter = 0


def send(obj):
    _out.write(json.dumps(obj).encode() + b"\n")
    _out.flush()


def run(code):
    """Runs statements; the value of a final expression is the result."""
    global _counter
    _counter += 1
    fname = "<eval-%d>" % _counter
    linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
    out, err = io.StringIO(), io.StringIO()
    reply = {"result": None, "error": None, "traceback": None}
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            tree = ast.parse(code, fname, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            if tree.body:
                exec(compile(tree, fname, "exec"), NS)
            if last is not None:
                value = eval(compile(last, fname, "eval"), NS)
                # Like the REPL: a final expression's value, unless None
                # (a call such as print() has no result worth showing).
                if value is not None:
                    NS["_"] = value
                    text = repr(value)
                    if len(text) > MAX_REPR:
                        text = text[:MAX_REPR] + "...[truncated]"
                    reply["result"] = text
        except BaseException as e:  # noqa: B902 - report SystemExit too
            reply["error"] = "%s: %s" % (type(e).__name__, e)
            reply["traceback"] = traceback.format_exc()
    reply["stdout"] = out.getvalue()
    reply["stderr"] = err.getvalue()
    reply["duration_ms"] = int((time.monotonic() - t0) * 1000)
    return reply


def warmup_imports():
    return [m for m in (m.strip() for m in os.environ.get("FORKD_WARMUP_IMPORTS", "").split(",")) if m]


def reseed(seed_hex):
    """At hand-out: the generators this process seeded before the snapshot
    draw fresh kernel entropy (the agent has reseeded the kernel's CRNG).
    OpenSSL's DRBG exists once `ssl` has run, and a VM fork keeps the pid
    OpenSSL's fork check looks at: RAND_add reseeds it from the kernel.
    A warm-up module that keeps random state outside this process (a
    kernel it started, say) gets the same seed: it defines
    `forkd_reseed(seed: bytes)`."""
    seed = os.urandom(32) + bytes.fromhex(seed_hex)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        # The whole Mersenne Twister state from the kernel: 19968 bits, not
        # seed()'s 32, and cheaper under TCG than seeding from an array
        # (whose checks run numpy ufuncs: +2 MiB of translated code per
        # pooled child, measured).
        key = np.frombuffer(os.urandom(624 * 4), dtype=np.uint32)
        np.random.set_state(("MT19937", key, 624))
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(seed, 0.0)
    hooked, errors = [], []
    for name in warmup_imports():
        hook = getattr(sys.modules.get(name), "forkd_reseed", None)
        if not callable(hook):
            continue
        try:
            hook(seed)
            hooked.append(name)
        except BaseException as e:  # noqa: B902 - one bad hook must not skip the rest
            errors.append("%s.forkd_reseed: %s: %s" % (name, type(e).__name__, e))
    if errors:
        # The reply's error fails the identity call: a child must not be
        # handed out with generators it shares with its siblings.
        raise RuntimeError("; ".join(errors))
    return {"reseeded": True, "openssl": ssl is not None, "hooks": hooked}


def warm():
    errors = []
    for name in warmup_imports():
        try:
            __import__(name)
            top = name.split(".")[0]
            NS[top] = sys.modules[top]
            if name == "numpy":
                NS["np"] = sys.modules["numpy"]
        except BaseException as e:
            errors.append("import %s: %s: %s" % (name, type(e).__name__, e))
    code = os.environ.get("FORKD_WARMUP_CODE")
    if code:
        r = run(code)
        if r["error"]:
            errors.append("warm-up code: " + r["error"])
    np = sys.modules.get("numpy")
    return {
        "ready": True,
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "numpy": getattr(np, "__version__", None),
        "errors": errors,
    }


def main():
    send(warm())
    for line in _in:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "eval":
                reply = run(req["code"])
            elif op == "reseed":
                reply = reseed(req.get("seed", ""))
            elif op == "env":
                # CA bundles installed at hand-out: what requests and
                # subprocesses read from the environment.
                os.environ.update({str(k): str(v) for k, v in req.get("set", {}).items()})
                reply = {"env": True}
            else:
                reply = {"error": "unknown op %r" % op}
        except BaseException as e:
            reply = {"error": "%s: %s" % (type(e).__name__, e), "traceback": traceback.format_exc()}
        send(reply)


main()
