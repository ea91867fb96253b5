// forkd's JavaScript context for the code interpreter (forkd_ci.py).
//
// Requests arrive one JSON object a line on fd 4; events go out one JSON
// object a line on fd 3, each request's last being {"type":"done"}. What a
// cell prints goes to this process's own stdout and stderr (pipes, which
// Node writes synchronously on Linux), so it is in them before "done".
//
// A cell is a classic script run in this process's global context
// (declarations persist, as in Node's REPL); its completion value is the
// result, a returned Promise awaited first. SIGINT interrupts a running
// script (vm's breakOnSigint) or abandons the Promise a cell waits for.
'use strict';

const fs = require('fs');
const util = require('util');
const vm = require('vm');
const readline = require('readline');

// Cells are scripts, not modules: give them `require` as Node's REPL does.
globalThis.require = require;

function send(ev) {
  fs.writeSync(3, JSON.stringify(ev) + '\n');
}

function describe(e) {
  if (e instanceof Error) return { name: e.name || 'Error', value: e.message || String(e), traceback: e.stack || '' };
  return { name: 'Error', value: util.inspect(e), traceback: '' };
}

// OpenSSL's generators were seeded when Node started: a forked VM's copy
// holds its parent's state. forkd's addon reseeds them from the (reseeded)
// kernel; Math.random is replaced by a generator seeded from fresh entropy.
let opensslReseed = null;
if (process.env.FORKD_OPENSSL_RESEED) {
  try {
    const m = { exports: {} };
    process.dlopen(m, process.env.FORKD_OPENSSL_RESEED);
    opensslReseed = m.exports.reseed;
  } catch (e) {
    process.stderr.write(`forkd-ci: cannot load ${process.env.FORKD_OPENSSL_RESEED}: ${e.message}\n`);
  }
}
delete process.env.FORKD_OPENSSL_RESEED;

function reseed(seedHex) {
  const crypto = require('crypto');
  const seed = Buffer.concat([crypto.randomBytes(0), Buffer.from(seedHex, 'hex')]);
  if (opensslReseed === null || opensslReseed(seed) !== true) {
    throw new Error('cannot reseed OpenSSL in this JavaScript context');
  }
  const h = crypto.createHash('sha256').update(seed).update(crypto.randomBytes(16)).digest();
  const s = new Uint32Array([h.readUInt32LE(0), h.readUInt32LE(4), h.readUInt32LE(8), h.readUInt32LE(12) | 1]);
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
}

// The cell waiting for a Promise, if any: SIGINT abandons it.
let waiting = null;
process.on('SIGINT', () => {
  if (waiting) {
    const w = waiting;
    waiting = null;
    w(new Error('Script execution interrupted.'));
  }
});

function finish(value) {
  if (value !== undefined) {
    const text = typeof value === 'string' ? JSON.stringify(value) : util.inspect(value, { depth: 6 });
    send({ type: 'result', data: { 'text/plain': text } });
  }
  send({ type: 'done' });
}

function fail(e) {
  send(Object.assign({ type: 'error' }, describe(e)));
  send({ type: 'done' });
}

function exec(code) {
  let value;
  try {
    value = new vm.Script(code, { filename: 'cell.js' }).runInThisContext({ breakOnSigint: true, displayErrors: false });
  } catch (e) {
    return fail(e);
  }
  if (value && typeof value.then === 'function') {
    let settled = false;
    waiting = (e) => {
      settled = true;
      fail(e);
    };
    value.then(
      (v) => {
        if (settled) return;
        settled = true;
        waiting = null;
        finish(v);
      },
      (e) => {
        if (settled) return;
        settled = true;
        waiting = null;
        fail(e);
      },
    );
    return undefined;
  }
  return finish(value);
}

const input = readline.createInterface({ input: fs.createReadStream(null, { fd: 4 }) });
input.on('line', (line) => {
  let req;
  try {
    req = JSON.parse(line);
  } catch (e) {
    return fail(e);
  }
  try {
    if (req.op === 'exec') return exec(req.code);
    if (req.op === 'env') {
      Object.assign(process.env, req.set || {});
      for (const k of req.unset || []) delete process.env[k];
    } else if (req.op === 'chdir') process.chdir(req.path);
    else if (req.op === 'reseed') reseed(req.seed);
    else if (req.op !== 'ping') throw new Error(`unknown op ${req.op}`);
    send({ type: 'done' });
  } catch (e) {
    fail(e);
  }
  return undefined;
});
input.on('close', () => process.exit(0));
