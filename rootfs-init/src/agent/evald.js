// forkd warm interpreter for Node images (forkd's Node mode,
// FORKD_AGENT_LANG=node): a persistent Node process that forkd-agent drives
// over fds 3 (requests) and 4 (replies), one JSON object per line, exactly
// like evald.py. It requires the warm-up modules once; forked children
// inherit the process, its heap and its globals already warm.
'use strict';
const fs = require('fs');
const net = require('net');
const readline = require('readline');
const util = require('util');
const vm = require('vm');

const MAX_REPR = 8 << 20;
let counter = 0;

function send(obj) {
  fs.writeSync(4, JSON.stringify(obj) + '\n');
}

function describe(e) {
  if (e instanceof Error) return `${e.name}: ${e.message}`;
  return `Error: ${util.inspect(e)}`;
}

function clip(text) {
  return text.length > MAX_REPR ? text.slice(0, MAX_REPR) + '...[truncated]' : text;
}

// A write() replacement that appends to reply[key] (console.log and
// process.stdout.write both end up here while an eval runs).
function capture(reply, key) {
  return (chunk, enc, cb) => {
    if (reply[key].length < MAX_REPR) {
      reply[key] += typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString();
    }
    const done = typeof enc === 'function' ? enc : cb;
    if (typeof done === 'function') process.nextTick(done);
    return true;
  };
}

// Runs `code` as a classic script in the global context, so `var`, `let`,
// `const` and function declarations persist between calls, like a REPL. The
// completion value is the result; a Promise (e.g. from an async IIFE) is
// awaited first.
async function run(code) {
  counter += 1;
  const reply = { result: null, result_json: null, error: null, traceback: null, stdout: '', stderr: '' };
  const t0 = process.hrtime.bigint();
  const saved = [process.stdout.write, process.stderr.write];
  process.stdout.write = capture(reply, 'stdout');
  process.stderr.write = capture(reply, 'stderr');
  try {
    let value = new vm.Script(code, { filename: `<eval-${counter}>` }).runInThisContext();
    if (value !== null && typeof value === 'object' && typeof value.then === 'function') {
      value = await value;
    }
    if (value !== undefined) {
      globalThis._ = value;
      reply.result = clip(util.inspect(value, { depth: 6 }));
      try {
        const j = JSON.stringify(value);
        if (j !== undefined && j.length <= MAX_REPR) reply.result_json = j;
      } catch (_) {
        // No JSON form (a cycle, a BigInt): `result` only.
      }
    }
  } catch (e) {
    reply.error = describe(e);
    reply.traceback = e && e.stack ? String(e.stack) : null;
  } finally {
    [process.stdout.write, process.stderr.write] = saved;
  }
  reply.duration_ms = Number((process.hrtime.bigint() - t0) / 1000000n);
  return reply;
}

// V8 cannot reseed Math.random, so at hand-out each forked child replaces it
// with xoshiro128** seeded from fresh kernel entropy (the agent has reseeded
// the kernel's CRNG by then) and the agent's seed. OpenSSL's DRBG (behind
// the crypto module) is not reseeded: Node instantiates it at start and
// OpenSSL 3 gives Node no way to force a reseed, so forked siblings draw the
// same crypto.randomBytes until OpenSSL reseeds on its own (docs/recipes.md).
function reseed(seedHex) {
  const crypto = require('crypto');
  const fresh = Buffer.alloc(16);
  const fd = fs.openSync('/dev/urandom', 'r');
  try {
    fs.readSync(fd, fresh, 0, 16, null);
  } finally {
    fs.closeSync(fd);
  }
  const h = crypto.createHash('sha256').update(fresh).update(Buffer.from(seedHex || '', 'hex')).digest();
  const s = new Uint32Array([h.readUInt32LE(0), h.readUInt32LE(4), h.readUInt32LE(8), h.readUInt32LE(12)]);
  if (!(s[0] | s[1] | s[2] | s[3])) s[0] = 1;
  const rotl = (x, k) => ((x << k) | (x >>> (32 - k))) >>> 0;
  Math.random = function random() {
    const r = Math.imul(rotl(Math.imul(s[1], 5) >>> 0, 7), 9) >>> 0;
    const t = s[1] << 9;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return r / 4294967296;
  };
  return { reseeded: true };
}

async function warm() {
  const errors = [];
  const names = (process.env.FORKD_WARMUP_IMPORTS || '').split(',').map((m) => m.trim()).filter(Boolean);
  for (const name of names) {
    try {
      globalThis[name.replace(/[^A-Za-z0-9_$]/g, '_')] = require(name);
    } catch (e) {
      errors.push(`require ${name}: ${describe(e)}`);
    }
  }
  const code = process.env.FORKD_WARMUP_CODE;
  if (code) {
    const r = await run(code);
    if (r.error) errors.push('warm-up code: ' + r.error);
  }
  return { ready: true, pid: process.pid, node: process.version.replace(/^v/, ''), errors };
}

async function main() {
  // Eval'd code resolves modules from the global module directories too.
  module.paths.push('/usr/local/lib/node_modules', '/usr/lib/node_modules', '/usr/share/nodejs');
  globalThis.require = require;
  // Code left running after its eval must not take the warm process down.
  process.on('uncaughtException', (e) => process.stderr.write(`forkd evald.js: uncaught ${describe(e)}\n`));
  process.on('unhandledRejection', (e) => process.stderr.write(`forkd evald.js: unhandled rejection ${describe(e)}\n`));
  send(await warm());
  // fd 3 is a pipe: read it through a libuv pipe handle.
  const input = new net.Socket({ fd: 3, readable: true, writable: false });
  const rl = readline.createInterface({ input, crlfDelay: Infinity });
  for await (const line of rl) {
    let reply;
    try {
      const req = JSON.parse(line);
      if (req.op === 'eval') reply = await run(String(req.code));
      else if (req.op === 'reseed') reply = reseed(req.seed);
      else reply = { error: `unknown op ${JSON.stringify(req.op)}` };
    } catch (e) {
      reply = { error: describe(e), traceback: e && e.stack ? String(e.stack) : null };
    }
    send(reply);
  }
  // The agent closed the pipe: it is gone or restarting us.
  process.exit(0);
}

main().catch((e) => {
  process.stderr.write(`forkd evald.js: ${e && e.stack ? e.stack : e}\n`);
  process.exit(1);
});
