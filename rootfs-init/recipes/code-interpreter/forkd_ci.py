"""forkd's code interpreter: E2B's code-interpreter HTTP protocol on port 49999.

The `code-interpreter` image starts it with the agent (FORKD_WARMUP_CMD) as
root; it drops to the image's `user` account at once, so every kernel runs
as that user in /home/user, as E2B's do. It serves, on the guest's loopback
only (the host reaches it through the agent channel's tunnel):

  POST /execute            {"code", "context_id"?, "language"?, "env_vars"?}
                           -> 200, one JSON object a line while the cell runs:
                              stdout/stderr {text, timestamp}, result {text,
                              html, markdown, svg, png, jpeg, pdf, latex, json,
                              javascript, data, chart, extra, is_main_result},
                              error {name, value, traceback},
                              number_of_executions {execution_count}, and
                              last end_of_execution
  POST /contexts           {"language"?, "cwd"?} -> {"id", "language", "cwd"}
  GET /contexts            -> [{"id", "language", "cwd"}] (default ones too)
  POST /contexts/{id}/restart, DELETE /contexts/{id}
  GET /health              -> "OK"
  forkd's own additions (not E2B's):
  POST /forkd/envs         {"env_vars": {...}}: the sandbox's create-time
                           envs, set in every context before its next cell
  POST /forkd/reseed       {"seed": hex}: fresh entropy after a fork, applied
                           in every context before its next cell
  POST /execute's optional "timeout" (seconds): interrupt the cell then.

Kernels: Python is an IPython kernel (ipykernel, driven with jupyter_client);
JavaScript is a Node process running forkd_ci_repl.js; bash is a bash
process reading cells from a pipe. A cell runs alone in its context (a lock
per context). When the client goes away mid-cell (E2B's SDK closes the
connection at its timeout) or the cell's own timeout passes, the cell is
interrupted (SIGINT, as Jupyter does), so the next cell does not wait
behind it. The interrupt waits until the kernel has taken the cell
(ipykernel ignores SIGINT between requests), and goes again if the cell
ignored it (StopClock); a kernel that does not take the cell, or then does
not stop, within INTERRUPT_GRACE each (5 s under KVM, 30 s on an emulated
CPU) is restarted, and the error says its state is lost.

Why a server of our own in Python rather than E2B's (FastAPI + a Jupyter
server): Debian has ipykernel and jupyter_client but not E2B's stack, and
the image is built from Debian packages only; one process with the
standard library's threaded HTTP server and jupyter_client's blocking
client has nothing else to start.
"""

import base64
import datetime
import http.server
import json
import os
import queue
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

PORT = 49999
LANGUAGES = ("python", "javascript", "bash")


def interrupt_grace():
    """Seconds a kernel gets to take a cell asked to stop, and again to stop
    after its interrupt, before it is restarted. An emulated CPU (QEMU's
    TCG, no kvm-clock) runs guest code tens of times slower, and IPython formatting a KeyboardInterrupt under
    load can take longer than 5 s there: a restart would lose state for a
    cell that did stop. kvm-clock is x86's: elsewhere, 5 s."""
    if os.uname().machine != "x86_64":
        return 5.0
    try:
        with open("/sys/devices/system/clocksource/clocksource0/available_clocksource") as f:
            if "kvm-clock" in f.read().split():
                return 5.0
    except OSError:
        pass
    return 30.0


INTERRUPT_GRACE = interrupt_grace()
MAX_BODY = 16 << 20
REPL_JS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkd_ci_repl.js")
OPENSSL_ADDON = "/run/forkd/openssl_reseed.node"

# Mime types of a Jupyter bundle -> E2B's Result fields.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def log(msg):
    print("forkd-ci: %s" % msg, file=sys.stderr, flush=True)


def result_line(bundle, is_main):
    """A Jupyter mime bundle as E2B's `result` line."""
    line = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            line[field] = value
    text = line.get("text")
    # A string's repr is shown without its quotes, as E2B's server does.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]
    line["extra"] = extra
    return line


class CellStopped(Exception):
    """The client went away or the cell's time ran out."""


class StopClock:
    """A cell's stop: when it was asked for, and the interrupts sent.

    The first interrupt waits until the kernel has taken the cell (`taken`:
    ipykernel ignores SIGINT between requests, so one sent earlier would be
    dropped). One the kernel ignored when it went out (the cell ignored
    SIGINT, as os.system does while its command runs; the command, in the
    kernel's process group, gets it) goes out again once the kernel catches
    SIGINT; with `repeat`, any goes again every INTERRUPT_GRACE/5 until the
    cell reports an error (one can land where ipykernel swallows it). The
    kernel gets INTERRUPT_GRACE to take the cell and INTERRUPT_GRACE from
    the first interrupt to stop; then it is restarted."""

    def __init__(self, interrupt, ignoring, repeat=False):
        self.interrupt = interrupt
        self.ignoring = ignoring
        self.repeat = repeat
        self.asked_at = None
        self.sent_at = None
        self.dropped = False
        self.last_at = None

    @property
    def sent(self):
        return self.sent_at is not None

    def tick(self, stop_asked, taken, errored=False):
        """Notes a stop request; sends what is due. `errored`: the cell
        reported an error since (the interrupt was taken after all)."""
        if stop_asked and self.asked_at is None:
            self.asked_at = time.monotonic()
        if self.asked_at is None or not taken:
            return
        if not self.sent:
            self.sent_at = time.monotonic()
            self.send()
        elif errored or self.ignoring():
            return
        elif self.dropped or (self.repeat and time.monotonic() - self.last_at >= INTERRUPT_GRACE / 5):
            # Again: ipykernel also swallows a SIGINT that lands in its own
            # code after execute_input and before the cell's code runs
            # ("KeyboardInterrupt caught in kernel"); the cell then runs on.
            self.send()

    def send(self):
        # A signal sent while ignored is discarded. Whether the kernel
        # ignored it is read just before the kill: read after, it would
        # miss os.system, which puts the handler back as soon as the
        # interrupt ends its command.
        self.dropped = self.ignoring()
        self.last_at = time.monotonic()
        self.interrupt()

    def check(self):
        """Raises CellStopped, saying which wait ran out, once one has."""
        now = time.monotonic()
        if self.sent and now - self.sent_at > INTERRUPT_GRACE:
            raise CellStopped("the cell did not stop within %ss of its interrupt" % INTERRUPT_GRACE)
        if not self.sent and self.asked_at is not None and now - self.asked_at > INTERRUPT_GRACE:
            raise CellStopped("the kernel did not take the cell within %ss of its stop" % INTERRUPT_GRACE)


def ignores_sigint(pid):
    """Whether process `pid` ignores SIGINT right now (its SigIgn mask).
    Unknown: False."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    except (OSError, ValueError, TypeError):
        pass
    return False


class Cell:
    """One /execute: where its lines go and when it must stop."""

    def __init__(self, emit, should_stop):
        self.emit = emit
        self.should_stop = should_stop


def env_python(set_vars, unset):
    return "(lambda o: (o.environ.update(%r), [o.environ.pop(k, None) for k in %r]))(__import__('os'))" % (
        dict(set_vars),
        list(unset),
    )


class PythonKernel:
    """An IPython kernel, driven over ZeroMQ by jupyter_client."""

    language = "python"

    def __init__(self, cwd):
        import jupyter_client.manager

        self.km = jupyter_client.manager.KernelManager(kernel_name="python3")
        env = dict(os.environ)
        # Figures come back as PNG display data, as in a notebook.
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        self.km.start_kernel(cwd=cwd, env=env, extra_arguments=["--InteractiveShell.colors=NoColor"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.quiet("import forkd_ci_charts as _forkd_ci_charts; _forkd_ci_charts.install(); del _forkd_ci_charts")

    def quiet(self, code, timeout=60):
        """Runs `code` without output or history; raises on an error."""
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.kc.get_shell_msg(timeout=deadline - time.monotonic())
            if reply["parent_header"].get("msg_id") == msg_id:
                if reply["content"]["status"] != "ok":
                    raise RuntimeError("%s: %s" % (reply["content"].get("ename"), reply["content"].get("evalue")))
                self.drain_iopub()
                return
        raise TimeoutError("kernel did not answer within %ss" % timeout)

    def drain_iopub(self):
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0)
            except queue.Empty:
                return

    def set_env(self, set_vars, unset):
        self.quiet(env_python(set_vars, unset))

    def chdir(self, path):
        self.quiet("__import__('os').chdir(%r)" % path)

    def reseed(self, seed):
        self.quiet(
            "(lambda s, r, m: (r.seed(s), m.get('numpy') and m['numpy'].random.seed("
            "m['numpy'].frombuffer(s[:32], dtype=m['numpy'].uint32)), "
            "m.get('ssl') and m['ssl'].RAND_add(s, 0.0)))(bytes.fromhex(%r), "
            "__import__('random'), __import__('sys').modules)" % seed.hex()
        )

    def execute(self, code, cell):
        self.drain_iopub()
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
        stop = StopClock(
            self.km.interrupt_kernel, lambda: ignores_sigint(getattr(self.km.provisioner, "pid", None)), repeat=True
        )
        # ipykernel publishes the cell's execute_input once its handler,
        # which catches SIGINT, is in place.
        taken = errored = False
        while True:
            stop.tick(cell.should_stop(), taken, errored)
            stop.check()
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                if not self.km.is_alive():
                    raise RuntimeError("the Python kernel died")
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            date = msg["header"].get("date")
            stamp = date.isoformat() if hasattr(date, "isoformat") else (date or now())
            if kind == "stream":
                cell.emit({"type": content["name"], "text": content["text"], "timestamp": stamp})
            elif kind == "execute_input":
                taken = True
                cell.emit({"type": "number_of_executions", "execution_count": content["execution_count"]})
            elif kind == "execute_result":
                cell.emit(result_line(content["data"], True))
            elif kind == "display_data":
                cell.emit(result_line(content["data"], False))
            elif kind == "error":
                errored = True
                cell.emit(
                    {
                        "type": "error",
                        "name": content["ename"],
                        "value": content["evalue"],
                        "traceback": "\n".join(content["traceback"]),
                    }
                )
            elif kind == "status" and content["execution_state"] == "idle":
                break
        # The shell channel's reply to the cell: read so it does not pile up.
        try:
            while True:
                self.kc.get_shell_msg(timeout=0 if stop.sent else 0.5)
        except queue.Empty:
            pass

    def interrupt(self):
        self.km.interrupt_kernel()

    def shutdown(self):
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception as e:  # noqa: BLE001 (shutting down: say it, go on)
            log("stopping a Python kernel: %s" % e)


class PipeKernel:
    """A process that takes cells on a pipe and says on fd 3 when each is
    done; its stdout and stderr are the cell's. Subclasses say how."""

    def __init__(self, cwd, argv):
        self.cwd = cwd
        done_r, done_w = os.pipe()
        cmd_r, cmd_w = os.pipe()
        env = dict(os.environ)

        def fds_3_and_4():
            # Copies above 10 first, so neither dup2 overwrites the other's
            # source; dup2 makes 3 and 4 inheritable, everything else of
            # ours is close-on-exec (PEP 446).
            import fcntl

            a = fcntl.fcntl(done_w, fcntl.F_DUPFD_CLOEXEC, 10)
            b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            close_fds=False,
            start_new_session=True,
            preexec_fn=fds_3_and_4,
        )
        os.close(done_w)
        os.close(cmd_r)
        self.done = os.fdopen(done_r, "rb", buffering=0)
        self.cmd = os.fdopen(cmd_w, "wb", buffering=0)
        for f in (self.proc.stdout, self.proc.stderr, self.done):
            os.set_blocking(f.fileno(), False)
        self.pending = b""
        self.count = 0

    def send(self, obj):
        self.cmd.write((json.dumps(obj) + "\n").encode())

    def events(self, cell, stoppable=True):
        """Yields fd-3 events of the current request, emitting its output;
        interrupts on a stop; returns at its `done`."""
        stop = StopClock(self.interrupt, lambda: False)
        fds = {self.proc.stdout.fileno(): "stdout", self.proc.stderr.fileno(): "stderr", self.done.fileno(): None}
        while True:
            stop.tick(stoppable and cell.should_stop(), True)
            stop.check()
            ready, _, _ = select.select(list(fds), [], [], 0.1)
            for fd in ready:
                data = os.read(fd, 65536)
                name = fds[fd]
                if name is not None:
                    if data:
                        cell.emit({"type": name, "text": data.decode("utf-8", "replace"), "timestamp": now()})
                    continue
                if not data:
                    raise RuntimeError("the %s context's process ended (exit status %s)" % (self.language, self.proc.wait()))
                self.pending += data
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                ev = json.loads(line)
                if ev.get("type") == "done":
                    self.flush_output(cell)
                    return
                yield ev

    def flush_output(self, cell):
        """What the process wrote before saying `done` is in its pipes."""
        for f, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            while True:
                try:
                    data = os.read(f.fileno(), 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                cell.emit({"type": name, "text": data.decode("utf-8", "replace"), "timestamp": now()})

    def run_quiet(self, request):
        sink = Cell(lambda line: None, lambda: False)
        for ev in self.events_after(request, sink, stoppable=False):
            if ev.get("type") == "error":
                raise RuntimeError("%s: %s" % (ev.get("name"), ev.get("value")))

    def events_after(self, request, cell, stoppable=True):
        self.flush_output(Cell(lambda line: None, lambda: False))
        self.send(request)
        return self.events(cell, stoppable)

    def interrupt(self):
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def shutdown(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr, self.done, self.cmd):
            f.close()


class NodeKernel(PipeKernel):
    """JavaScript in a Node process (forkd_ci_repl.js): cells run as
    scripts in one global context, so declarations persist."""

    language = "javascript"

    def __init__(self, cwd):
        env_addon = OPENSSL_ADDON if os.path.exists(OPENSSL_ADDON) else ""
        os.environ["FORKD_OPENSSL_RESEED"] = env_addon
        try:
            super().__init__(cwd, ["node", REPL_JS])
        finally:
            os.environ.pop("FORKD_OPENSSL_RESEED", None)
        self.run_quiet({"op": "ping"})

    def execute(self, code, cell):
        self.count += 1
        cell.emit({"type": "number_of_executions", "execution_count": self.count})
        for ev in self.events_after({"op": "exec", "code": code}, cell):
            if ev["type"] == "result":
                cell.emit(result_line(ev["data"], True))
            elif ev["type"] == "display":
                cell.emit(result_line(ev["data"], False))
            elif ev["type"] == "error":
                cell.emit({"type": "error", "name": ev["name"], "value": ev["value"], "traceback": ev["traceback"]})

    def set_env(self, set_vars, unset):
        self.run_quiet({"op": "env", "set": dict(set_vars), "unset": list(unset)})

    def chdir(self, path):
        self.run_quiet({"op": "chdir", "path": path})

    def reseed(self, seed):
        self.run_quiet({"op": "reseed", "seed": seed.hex()})


BASH_LOOP = r"""
trap 'return 130 2>/dev/null' INT
while IFS= read -r __forkd_cell <&4; do
  . "$__forkd_cell"
  printf '{"type":"exit","status":%d}\n{"type":"done"}\n' "$?" >&3
done
"""


class BashKernel(PipeKernel):
    """A bash process: each cell is sourced from a file, so `cd`, variables
    and functions persist; a non-zero status is the cell's error (as
    bash_kernel reports it: no name, the status as its value)."""

    language = "bash"

    def __init__(self, cwd):
        super().__init__(cwd, ["bash", "--noprofile", "--norc", "-c", BASH_LOOP])
        self.dir = os.path.join(os.environ.get("HOME", "/tmp"), ".cache", "forkd-ci", uuid.uuid4().hex)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def source(self, text, cell, stoppable=True):
        path = os.path.join(self.dir, "cell-%d.sh" % self.count)
        with open(path, "w") as f:
            f.write(text)
        self.flush_output(Cell(lambda line: None, lambda: False))
        self.cmd.write((path + "\n").encode())
        status = 0
        for ev in self.events(cell, stoppable):
            if ev.get("type") == "exit":
                status = ev["status"]
        os.unlink(path)
        return status

    def execute(self, code, cell):
        self.count += 1
        cell.emit({"type": "number_of_executions", "execution_count": self.count})
        status = self.source(code + "\n", cell)
        if status != 0:
            cell.emit({"type": "error", "name": "", "value": str(status), "traceback": ""})

    def quiet(self, text):
        sink = Cell(lambda line: None, lambda: False)
        if self.source(text, sink, stoppable=False) != 0:
            raise RuntimeError("bash setup failed: %s" % text)

    def set_env(self, set_vars, unset):
        lines = ["export %s=%s" % (k, shlex.quote(v)) for k, v in set_vars.items() if k.isidentifier()]
        lines += ["unset %s" % k for k in unset if k.isidentifier()]
        self.quiet("\n".join(lines) + "\ntrue\n")

    def chdir(self, path):
        self.quiet("cd %s\n" % shlex.quote(path))

    def reseed(self, seed):
        self.quiet("RANDOM=%d\n" % int.from_bytes(seed[:4], "little"))

    def shutdown(self):
        super().shutdown()
        subprocess.run(["rm", "-rf", self.dir], check=False)


KERNELS = {"python": PythonKernel, "javascript": NodeKernel, "bash": BashKernel}


def normalize_language(language):
    language = (language or "python").strip().lower()
    return {"js": "javascript", "sh": "bash"}.get(language, language)


class Context:
    """A kernel, its language and cwd, and what was applied to it."""

    def __init__(self, server, language, cwd):
        self.id = str(uuid.uuid4())
        self.server = server
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.kernel = None
        self.env_version = 0
        self.applied_env = {}
        self.seed_version = 0
        self.start()

    def start(self):
        if not os.path.isdir(self.cwd):
            raise ValueError("cwd %s is not a directory" % self.cwd)
        self.kernel = KERNELS[self.language](self.cwd)
        self.kernel.chdir(self.cwd)
        self.applied_env = {}
        self.env_version = 0
        # A fresh kernel drew its seeds after any fork: nothing to reseed.
        self.seed_version = self.server.seed_version

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def prepare(self):
        """Applies the sandbox's envs and fresh entropy that arrived since
        this context's last cell (holding its lock)."""
        seed_version, seed = self.server.seed
        if seed_version != self.seed_version:
            try:
                self.kernel.reseed(seed)
                self.seed_version = seed_version
            except Exception as e:  # noqa: BLE001 (a fresh kernel draws fresh seeds)
                log("reseeding context %s failed (%s): restarting it" % (self.id, e))
                self.restart()
        version, envs = self.server.global_env
        if version != self.env_version:
            gone = [k for k in self.applied_env if k not in envs]
            self.kernel.set_env(envs, gone)
            self.applied_env = dict(envs)
            self.env_version = version

    def restart(self):
        self.kernel.shutdown()
        self.start()

    def run(self, code, env_vars, cell):
        self.prepare()
        if env_vars:
            self.kernel.set_env(env_vars, [])
        try:
            self.kernel.execute(code, cell)
        except CellStopped as e:
            log("context %s: %s; restarting it" % (self.id, e))
            cell.emit(
                {
                    "type": "error",
                    "name": "ContextRestarting",
                    "value": "%s: the context was restarted and its state is lost" % e,
                    "traceback": "",
                }
            )
            self.restart()
            return
        except RuntimeError as e:
            cell.emit({"type": "error", "name": "ContextRestarting", "value": "%s: the context was restarted and its state is lost" % e, "traceback": ""})
            self.restart()
            return
        if env_vars:
            # Back to the sandbox's own values (or unset), as E2B does.
            globals_ = self.applied_env
            back = {k: globals_[k] for k in env_vars if k in globals_}
            self.kernel.set_env(back, [k for k in env_vars if k not in globals_])


class Server:
    def __init__(self):
        self.contexts = {}
        self.defaults = {}
        self.lock = threading.Lock()
        self.global_env = (0, {})
        self.seed = (0, b"")
        self.seed_version = 0
        self.ready = threading.Event()

    def start_defaults(self):
        for language in ("python", "javascript"):
            try:
                ctx = Context(self, language, HOME)
            except Exception as e:  # noqa: BLE001 (a missing runtime: say so, serve the rest)
                log("default %s context: %s" % (language, e))
                continue
            with self.lock:
                self.contexts[ctx.id] = ctx
                self.defaults[language] = ctx.id
        self.ready.set()

    def create(self, language, cwd):
        ctx = Context(self, language, cwd)
        with self.lock:
            self.contexts[ctx.id] = ctx
        return ctx

    def default_for(self, language):
        with self.lock:
            cid = self.defaults.get(language)
            if cid in self.contexts:
                return self.contexts[cid]
        ctx = self.create(language, HOME)
        with self.lock:
            if language in self.defaults and self.defaults[language] in self.contexts:
                other = self.contexts[self.defaults[language]]
                threading.Thread(target=ctx.kernel.shutdown, daemon=True).start()
                self.contexts.pop(ctx.id, None)
                return other
            self.defaults[language] = ctx.id
        return ctx


SERVER = Server()
HOME = "/home/user"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "forkd-ci"

    def log_message(self, fmt, *args):  # quiet: the console is the guest's
        pass

    def reply(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if content_type.startswith("text/") and not isinstance(body, bytes):
            data = str(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def text(self, status, message):
        self.reply(status, message.encode(), "text/plain; charset=utf-8")

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise ValueError("send the body with a Content-Length")
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body of %d bytes is over %d" % (n, MAX_BODY))
        raw = self.rfile.read(n) if n else b"{}"
        v = json.loads(raw or b"{}")
        if not isinstance(v, dict):
            raise ValueError("the body must be a JSON object")
        return v

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, "OK")
        if self.path == "/forkd/ready":
            # The default contexts are up (the image's warm-up waits for it).
            if SERVER.ready.is_set():
                return self.reply(200, [c.describe() for c in SERVER.contexts.values()])
            return self.text(503, "starting the default contexts")
        if self.path == "/contexts":
            with SERVER.lock:
                return self.reply(200, [c.describe() for c in SERVER.contexts.values()])
        self.text(404, "no such endpoint: GET %s" % self.path)

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with SERVER.lock:
                ctx = SERVER.contexts.pop(parts[1], None)
            if ctx is None:
                return self.text(404, "Context %s not found" % parts[1])
            ctx.kernel.interrupt()
            with ctx.lock:
                ctx.kernel.shutdown()
            return self.reply(200, None)
        self.text(404, "no such endpoint: DELETE %s" % self.path)

    def do_POST(self):
        try:
            body = self.body()
        except ValueError as e:
            return self.text(400, "bad request body: %s" % e)
        parts = self.path.strip("/").split("/")
        if self.path == "/execute":
            return self.execute(body)
        if self.path == "/contexts":
            language = normalize_language(body.get("language"))
            if language not in LANGUAGES:
                return self.text(400, "language %r is not available here (python, javascript, bash)" % language)
            try:
                ctx = SERVER.create(language, body.get("cwd") or HOME)
            except Exception as e:  # noqa: BLE001 (the client gets why)
                return self.text(500, "creating a %s context: %s" % (language, e))
            return self.reply(200, ctx.describe())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with SERVER.lock:
                ctx = SERVER.contexts.get(parts[1])
            if ctx is None:
                return self.text(404, "Context %s not found" % parts[1])
            ctx.kernel.interrupt()
            with ctx.lock:
                ctx.restart()
            return self.reply(200, None)
        if self.path == "/forkd/envs":
            envs = body.get("env_vars") or {}
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
                return self.text(400, "env_vars must map strings to strings")
            with SERVER.lock:
                SERVER.global_env = (SERVER.global_env[0] + 1, dict(envs))
            return self.reply(200, None)
        if self.path == "/forkd/reseed":
            try:
                seed = bytes.fromhex(body.get("seed", ""))
            except ValueError:
                return self.text(400, "seed must be hex")
            with SERVER.lock:
                SERVER.seed_version += 1
                SERVER.seed = (SERVER.seed_version, seed)
            return self.reply(200, None)
        self.text(404, "no such endpoint: POST %s" % self.path)

    def gone(self):
        """Whether the client closed its connection."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            return self.text(400, "code must be a string")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
            return self.text(400, "env_vars must map strings to strings")
        if body.get("context_id") and body.get("language"):
            return self.text(400, "Only one of context_id or language can be provided")
        timeout = body.get("timeout")
        if timeout is not None:
            # A JSON number only (bool is an int subclass); float() of an
            # integer beyond a double raises OverflowError.
            try:
                ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < float(timeout) < float("inf")
            except OverflowError:
                ok = False
            if not ok:
                return self.text(400, "timeout must be a positive number of seconds, not %.40r" % (timeout,))
        try:
            if body.get("context_id"):
                with SERVER.lock:
                    ctx = SERVER.contexts.get(body["context_id"])
                if ctx is None:
                    return self.text(404, "Context %s not found" % body["context_id"])
            else:
                language = normalize_language(body.get("language"))
                if language not in LANGUAGES:
                    return self.text(400, "language %r is not available here (python, javascript, bash)" % language)
                ctx = SERVER.default_for(language)
        except Exception as e:  # noqa: BLE001 (the client gets why)
            return self.text(500, str(e))

        deadline = time.monotonic() + float(timeout) if timeout else None
        state = {"broken": False}

        def should_stop():
            return state["broken"] or (deadline is not None and time.monotonic() > deadline) or self.gone()

        def emit(line):
            if state["broken"]:
                return
            data = (json.dumps(line) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            except OSError:
                state["broken"] = True

        # Wait for the context, giving up if the client does.
        while not ctx.lock.acquire(timeout=0.2):
            if self.gone():
                self.close_connection = True
                return
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            ctx.run(code, env_vars, Cell(emit, should_stop))
            emit({"type": "end_of_execution"})
        except Exception as e:  # noqa: BLE001 (a broken kernel: the client gets why)
            log("cell in context %s: %s" % (ctx.id, e))
            emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})
            emit({"type": "end_of_execution"})
        finally:
            ctx.lock.release()
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True


class ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def drop_privileges(name):
    import grp
    import pwd

    pw = pwd.getpwnam(name)
    groups = [g.gr_gid for g in grp.getgrall() if name in g.gr_mem]
    os.setgroups([pw.pw_gid] + [g for g in groups if g != pw.pw_gid])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ.update(HOME=pw.pw_dir, USER=name, LOGNAME=name)
    os.environ.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    os.environ.setdefault("LANG", "C.UTF-8")
    os.chdir(pw.pw_dir)
    return pw.pw_dir


def main():
    global HOME
    args = sys.argv[1:]
    user = args[args.index("--user") + 1] if "--user" in args else None
    port = int(args[args.index("--port") + 1]) if "--port" in args else PORT
    if user and os.geteuid() == 0:
        HOME = drop_privileges(user)
    else:
        HOME = os.environ.get("HOME", HOME)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    httpd = ThreadingServer(("127.0.0.1", port), Handler)
    threading.Thread(target=SERVER.start_defaults, daemon=True).start()
    log("serving on 127.0.0.1:%d as %s" % (port, os.environ.get("USER", os.geteuid())))
    httpd.serve_forever()


if __name__ == "__main__":
    main()
