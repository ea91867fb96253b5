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

// OpenSSL's generators (behind crypto.randomBytes, randomUUID, randomInt,
// webcrypto and TLS) were instantiated when Node started, so every child of
// a warm process holds the parent's state, and OpenSSL cannot see a VM fork.
// native/openssl_reseed.c is an addon that reseeds them from the kernel; the
// agent writes it and names it in FORKD_OPENSSL_RESEED. Loaded at start, so
// a Node that cannot load it fails its warm-up rather than fork alike.
let opensslReseed = null;

function loadOpensslReseed() {
  const path = process.env.FORKD_OPENSSL_RESEED;
  delete process.env.FORKD_OPENSSL_RESEED;
  if (!path) return 'FORKD_OPENSSL_RESEED is not set';
  try {
    const m = { exports: {} };
    process.dlopen(m, path);
    opensslReseed = m.exports.reseed;
    return null;
  } catch (e) {
    return `loading ${path}: ${describe(e)} (a Node with OpenSSL linked statically does not export RAND_add)`;
  }
}

// Node keeps OpenSSL output in two caches, filled on first use: 128 UUIDs'
// worth for randomUUID (webcrypto's too) and 1024 draws for randomInt. A
// full cycle through one refills it from the reseeded state. Cycling costs
// ~15 ms under TCG, so the wrappers below note whether the process (its
// warm-up, say) ever filled them; until then there is nothing to cycle.
const cacheUse = { uuid: false, int: false };
const rawRandomUUID = require('crypto').randomUUID;
const rawRandomInt = require('crypto').randomInt;

function watchCaches() {
  const crypto = require('crypto');
  crypto.randomUUID = function randomUUID(options) {
    cacheUse.uuid = true;
    return rawRandomUUID(options);
  };
  crypto.randomInt = function randomInt(min, max, callback) {
    cacheUse.int = true;
    return rawRandomInt.apply(this, arguments);
  };
  const proto = Object.getPrototypeOf(crypto.webcrypto);
  const webRandomUUID = proto.randomUUID;
  proto.randomUUID = function randomUUID() {
    cacheUse.uuid = true;
    return webRandomUUID.call(this);
  };
}

function cycleCaches() {
  if (cacheUse.uuid) for (let i = 0; i < 128; i++) rawRandomUUID();
  if (cacheUse.int) for (let i = 0; i < 1024; i++) rawRandomInt(0, 2 ** 48 - 1);
}

// At hand-out each forked child reseeds OpenSSL and cycles Node's caches of
// its output, then replaces Math.random (V8 cannot reseed its own) with
// xoshiro128** seeded from fresh kernel entropy (the agent has reseeded the
// kernel's CRNG by then) and the agent's seed. Throws when OpenSSL cannot be
// reseeded: the agent fails the hand-out rather than hand out a twin.
function reseed(seedHex) {
  const crypto = require('crypto');
  const fresh = Buffer.alloc(16);
  const fd = fs.openSync('/dev/urandom', 'r');
  try {
    fs.readSync(fd, fresh, 0, 16, null);
  } finally {
    fs.closeSync(fd);
  }
  const seed = Buffer.concat([fresh, Buffer.from(seedHex || '', 'hex')]);
  if (opensslReseed === null) throw new Error('cannot reseed OpenSSL: its addon did not load (see the warm-up errors)');
  if (opensslReseed(seed) !== true) throw new Error("OpenSSL refused to reseed (RAND_add failed)");
  cycleCaches();
  const h = crypto.createHash('sha256').update(seed).digest();
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
  return { reseeded: true, openssl: true };
}

async function warm() {
  const errors = [];
  const opensslError = loadOpensslReseed();
  if (opensslError) errors.push(opensslError);
  watchCaches();
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
      // CA bundles installed at hand-out: for the processes this one starts
      // (Node itself read NODE_EXTRA_CA_CERTS when it started).
      else if (req.op === 'env') { Object.assign(process.env, req.set || {}); reply = { env: true }; }
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
