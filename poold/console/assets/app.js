// forkd console (docs/console.md). Talks to poold's /v1 API with the
// operator's bearer token (kept in sessionStorage, this tab only). Builds
// DOM nodes, never markup strings; no inline script (the page's CSP).
'use strict';

const TOKEN_KEY = 'forkd.console.token';
const POLL_MS = 2000;
const SLOW_POLL_MS = 10000;
const PLOT_POINTS = 150;
const TERM_MAX_CHARS = 200000;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

// ---- auth and the API ------------------------------------------------

let token = sessionStorage.getItem(TOKEN_KEY) || '';
let refused = false;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// One call to /v1 (or /metrics, /version): JSON or text back; a non-2xx
// answer throws ApiError with poold's {"error": ...} message. A 401 stops
// polling and shows the refusal until a token is given.
async function api(method, path, body) {
  const headers = {};
  if (token) headers['Authorization'] = 'Bearer ' + token;
  const init = { method, headers };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const type = r.headers.get('content-type') || '';
  const data = type.startsWith('application/json') ? await r.json() : await r.text();
  if (r.status === 401) {
    refuse((data && data.error) || 'missing or wrong bearer token');
  }
  if (!r.ok) {
    const msg = (data && data.error) || (typeof data === 'string' && data) || r.statusText;
    throw new ApiError(r.status, msg);
  }
  return data;
}

function refuse(msg) {
  refused = true;
  $('auth-status').textContent =
    'Refused: the server answered 401 (' + msg + '). ' +
    (token ? 'The token is wrong; enter the right one.' : 'Enter the bearer token from poold\u2019s (or the gateway\u2019s) token file.');
  $('auth').classList.add('refused');
}

function accept() {
  if (refused) {
    refused = false;
    $('auth-status').textContent = '';
    $('auth').classList.remove('refused');
  }
}

function say(msg) {
  $('status').textContent = msg;
}

function failed(what, e) {
  say(what + ' failed: ' + (e.status ? e.status + ' ' : '') + e.message);
}

function hex(s) {
  return Array.from(new TextEncoder().encode(s), (b) => b.toString(16).padStart(2, '0')).join('');
}

// ---- formatting --------------------------------------------------------

function bytes(n) {
  if (n == null) return '?';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return (i ? n.toFixed(1) : String(n)) + ' ' + units[i];
}

function age(unix) {
  return duration(Date.now() / 1000 - unix);
}

function duration(secs) {
  const s = Math.max(0, Math.floor(secs));
  if (s < 60) return s + ' s';
  if (s < 3600) return Math.floor(s / 60) + ' min';
  return Math.floor(s / 3600) + ' h ' + Math.floor((s % 3600) / 60) + ' min';
}

function limits(sb) {
  const parts = [];
  parts.push(sb.memory_limit_mib ? sb.memory_limit_mib + ' MiB' : 'memory unlimited');
  if (sb.cpus != null) parts.push(sb.cpus + ' CPUs');
  if (sb.pids_max != null) parts.push(sb.pids_max + ' pids');
  if (sb.expires_at_unix) parts.push('expires in ' + duration(sb.expires_at_unix - Date.now() / 1000));
  return parts.join(', ');
}

function network(sb) {
  if (!sb.netns) return 'none';
  const parts = [sb.guest_addr || sb.netns];
  const eg = sb.egress;
  if (eg) {
    parts.push('out: ' + ((eg.allow_out || []).join(' ') || 'public internet'));
    if ((eg.deny_out || []).length) parts.push('denied: ' + eg.deny_out.join(' '));
  }
  for (const p of sb.ports || []) {
    parts.push('port ' + p.guest_port + ' \u2192 ' + (p.host_addr || '127.0.0.1') + ':' + p.host_port);
  }
  return parts.join('; ');
}

// ---- keyed tables (rows stay put, so focus survives a refresh) --------

// Makes `tbody` hold one row per item, keyed by `key(item)`: cells' text
// is updated in place, rows of gone items removed, new rows appended with
// `actions(item)` (built once) in their last cell.
function syncRows(tbody, items, key, cells, actions) {
  const seen = new Set();
  for (const item of items) {
    const k = key(item);
    seen.add(k);
    let row = tbody.querySelector('tr[data-key="' + CSS.escape(k) + '"]');
    const texts = cells(item);
    if (!row) {
      row = el('tr', { 'data-key': k });
      texts.forEach((t, i) => row.append(i === 0 ? el('th', { scope: 'row', text: t }) : el('td', { text: t })));
      if (actions) row.append(el('td', {}, actions(item)));
      tbody.append(row);
    } else {
      texts.forEach((t, i) => {
        if (row.children[i].textContent !== t) row.children[i].textContent = t;
      });
    }
  }
  for (const row of Array.from(tbody.children)) {
    if (!seen.has(row.dataset.key)) row.remove();
  }
}

function setOptions(select, values) {
  const now = Array.from(select.options, (o) => o.value);
  if (now.join('\n') === values.join('\n')) return;
  const keep = select.value;
  select.replaceChildren(...values.map((v) => el('option', { value: v, text: v })));
  if (values.includes(keep)) select.value = keep;
}

// ---- sections ----------------------------------------------------------

let lastSandboxCount = 0; // a lone poold's Sandboxes cell, from the last list

function plural(n, one, many) {
  return n + ' ' + (n === 1 ? one : many);
}

function healthText(h) {
  if (!h || h.state === 'unknown') return 'not polled yet';
  if (h.state === 'down') return 'down for ' + age(h.since_unix) + ': ' + h.why;
  return h.state;
}

// One row per node: a gateway (`role: gateway` in /version) lists its
// nodes from /v1/nodes; a poold is the one node.
async function refreshNode() {
  const v = await api('GET', '/version');
  let rows, line;
  if (v.role === 'gateway') {
    const nodes = await api('GET', '/v1/nodes');
    rows = nodes.map((n) => {
      const nv = n.version || {};
      const jail = nv.jail == null ? '?' : nv.jail ? 'yes' : 'no';
      return [n.name, nv.version || '?', nv.accelerator || '?', jail, nv.isolation || '', healthText(n.health), String(n.sandboxes)];
    });
    const up = nodes.filter((n) => n.health && n.health.state === 'up').length;
    line = 'Connected to the forkd gateway ' + v.version + ' at ' + location.host + ': ' +
      up + ' of ' + plural(nodes.length, 'node', 'nodes') + ' up.';
  } else {
    rows = [[location.host, v.version, v.accelerator || '?', v.jail ? 'yes' : 'no', v.isolation || '', 'up', String(lastSandboxCount)]];
    line = 'Connected to poold ' + v.version + ' at ' + location.host + ' (' + (v.accelerator || '?') + ').';
  }
  syncRows($('nodes-body'), rows, (r) => r[0], (r) => r);
  if ($('node-line').textContent !== line) $('node-line').textContent = line;
}

async function refreshPools() {
  const pools = await api('GET', '/v1/pools');
  syncRows($('pools-body'), pools, (p) => p.tag, (p) => [
    p.tag, String(p.min_ready), String(p.max_ready), String(p.ready), String(p.in_flight), String(p.hits), String(p.misses),
  ]);
}

function sandboxActions(sb) {
  const term = el('button', { type: 'button', text: 'Terminal', 'aria-label': 'Open a terminal in ' + sb.id });
  term.addEventListener('click', () => openTerminal(sb.id));
  const branch = el('button', { type: 'button', text: 'Branch', 'aria-label': 'Branch ' + sb.id + ' into a new snapshot' });
  branch.addEventListener('click', () => branchSandbox(sb.id));
  const kill = el('button', { type: 'button', text: 'Kill', class: 'danger', 'aria-label': 'Kill ' + sb.id });
  kill.addEventListener('click', () => killSandbox(sb.id));
  return el('span', { class: 'actions' }, term, branch, kill);
}

async function refreshSandboxes() {
  const list = await api('GET', '/v1/sandboxes');
  syncRows($('sandboxes-body'), list, (s) => s.id, (s) => [
    s.id, s.node || 'this node', s.snapshot_tag, age(s.created_at_unix),
    (s.pool_hit ? 'pool hit' : 'restored') + (s.spawn_ms != null ? ', ' + s.spawn_ms + ' ms' : ''),
    limits(s), network(s),
  ], sandboxActions);
  const n = list.length;
  lastSandboxCount = n;
  const line = plural(n, 'sandbox', 'sandboxes') + ' running.';
  if ($('sandbox-count').textContent !== line) $('sandbox-count').textContent = line;
}

const infoCache = new Map(); // snapshot id -> info

async function refreshSnapshots() {
  const snaps = await api('GET', '/v1/snapshots');
  const ready = snaps.filter((s) => s.status !== 'writing' && s.status !== 'failed').map((s) => s.tag).sort();
  setOptions($('spawn-tag'), ready);
  setOptions($('pool-tag'), ready);
  for (const s of snaps) {
    const k = s.id || s.tag;
    if (s.status === 'ready' && !infoCache.has(k)) {
      try {
        infoCache.set(k, await api('GET', '/v1/snapshots/' + encodeURIComponent(s.tag) + '/info'));
      } catch (e) {
        if (e.status === 401) throw e;
      }
    }
  }
  const byParent = new Map();
  const tags = new Set(snaps.map((s) => s.tag));
  for (const s of snaps) {
    const p = s.parent_tag && tags.has(s.parent_tag) ? s.parent_tag : '';
    if (!byParent.has(p)) byParent.set(p, []);
    byParent.get(p).push(s);
  }
  const build = (parent) => (byParent.get(parent) || [])
    .sort((a, b) => a.tag.localeCompare(b.tag))
    .map((s) => {
      const info = infoCache.get(s.id || s.tag);
      let text = s.tag + ' \u2014 ' + s.status;
      if (info) {
        text += ', stores ' + bytes(info.stored_unique_bytes) + ' beyond its parent; memory ' +
          bytes(info.memory_logical_bytes) + ' (' + bytes(info.memory_physical_bytes) + ' non-zero); chain depth ' + info.chain_depth;
      }
      if (s.branched_from) text += '; branched from ' + s.branched_from;
      const li = el('li', {}, el('span', { text }));
      const kids = build(s.tag);
      if (kids.length) li.append(el('ul', {}, ...kids));
      return li;
    });
  const tree = $('snapshot-tree');
  const items = build('');
  const sig = items.map((i) => i.textContent).join('\n');
  if (tree.dataset.sig !== sig) {
    tree.dataset.sig = sig;
    tree.replaceChildren(...(items.length ? items : [el('li', { text: 'No snapshots.' })]));
  }
}

// ---- actions -----------------------------------------------------------

async function killSandbox(id) {
  say('Killing ' + id + '\u2026');
  try {
    await api('DELETE', '/v1/sandboxes/' + encodeURIComponent(id));
    say('Killed ' + id + '.');
    if (term && term.id === id) closeTerminal();
    await refreshSandboxes();
  } catch (e) {
    failed('Killing ' + id, e);
  }
}

async function branchSandbox(id) {
  say('Branching ' + id + '\u2026');
  try {
    const s = await api('POST', '/v1/sandboxes/' + encodeURIComponent(id) + '/branch', {});
    say('Branched ' + id + ' into snapshot ' + s.tag + '.');
    await refreshSnapshots();
  } catch (e) {
    failed('Branching ' + id, e);
  }
}

function numberField(form, name) {
  const v = form.elements[name].value.trim();
  return v === '' ? undefined : Number(v);
}

async function spawn(ev) {
  ev.preventDefault();
  const f = ev.target;
  const body = { snapshot_tag: f.elements.snapshot_tag.value, n: numberField(f, 'n') };
  for (const k of ['memory_limit_mib', 'ttl_secs']) {
    const v = numberField(f, k);
    if (v !== undefined) body[k] = v;
  }
  say('Spawning ' + body.n + ' from ' + body.snapshot_tag + '\u2026');
  try {
    const made = await api('POST', '/v1/sandboxes', body);
    say('Spawned ' + made.map((s) => s.id).join(', ') + '.');
    await refreshSandboxes();
  } catch (e) {
    failed('Spawning', e);
  }
}

async function resizePool(ev) {
  ev.preventDefault();
  const f = ev.target;
  const tag = f.elements.tag.value;
  const body = { min_ready: numberField(f, 'min_ready') };
  const max = numberField(f, 'max_ready');
  if (max !== undefined) body.max_ready = max;
  try {
    const p = await api('PUT', '/v1/pools/' + encodeURIComponent(tag), body);
    say('Pool ' + p.tag + ' set to ' + p.min_ready + '\u2013' + p.max_ready + ' ready.');
    await refreshPools();
  } catch (e) {
    failed('Resizing pool ' + tag, e);
  }
}

// ---- terminal ----------------------------------------------------------

let term = null; // {id, ws, decoder}

// Strips what a <pre> cannot show: CSI and OSC sequences, other escapes,
// bells; applies backspaces and carriage returns within the chunk.
function plain(s) {
  s = s.replace(/\x1b\][^\x07\x1b]*(\x07|\x1b\\)/g, '')
    .replace(/\x1b\[[0-?]*[ -/]*[@-~]/g, '')
    .replace(/\x1b[@-Z\\-_]/g, '')
    .replace(/\x1b[()][0-9A-Za-z]/g, '')
    .replace(/\x07/g, '')
    .replace(/\r+\n/g, '\n');
  return s;
}

function termWrite(s) {
  const out = $('term-out');
  let text = out.textContent;
  for (const part of plain(s).split(/(\r|\x08)/)) {
    if (part === '\x08') text = text.slice(0, -1);
    else if (part === '\r') text = text.slice(0, text.lastIndexOf('\n') + 1);
    else text += part;
  }
  if (text.length > TERM_MAX_CHARS) text = text.slice(-TERM_MAX_CHARS);
  out.textContent = text;
  out.scrollTop = out.scrollHeight;
}

function termControls(on) {
  for (const id of ['term-in', 'term-send', 'term-ctrlc', 'term-close']) $(id).disabled = !on;
}

function openTerminal(id) {
  closeTerminal();
  const url = new URL('/v1/sandboxes/' + encodeURIComponent(id) + '/pty?rows=24&cols=100', location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  // A browser cannot set Authorization on a WebSocket: the token rides as
  // a subprotocol, hex-encoded (docs/console.md, "Auth").
  const protocols = ['forkd.pty'];
  if (token) protocols.push('forkd.bearer.' + hex(token));
  const ws = new WebSocket(url, protocols);
  ws.binaryType = 'arraybuffer';
  term = { id, ws, decoder: new TextDecoder() };
  $('term-out').textContent = '';
  $('term-state').textContent = 'Connecting to ' + id + '\u2026';
  ws.addEventListener('open', () => {
    $('term-state').textContent = 'Terminal in ' + id + '.';
    termControls(true);
    $('term-in').focus();
  });
  ws.addEventListener('message', (m) => {
    if (typeof m.data !== 'string') {
      termWrite(term.decoder.decode(new Uint8Array(m.data), { stream: true }));
      return;
    }
    let c;
    try {
      c = JSON.parse(m.data);
    } catch (e) {
      return;
    }
    if (c.type === 'exit') $('term-state').textContent = 'The shell in ' + id + ' exited (' + (c.signal ? 'signal ' + c.signal : 'code ' + c.exit_code) + ').';
    else if (c.type === 'error') $('term-state').textContent = 'Terminal error: ' + c.error;
    else if (c.type === 'warning') say('Terminal: ' + c.error);
  });
  ws.addEventListener('close', (ev) => {
    if (term && term.ws === ws) {
      termControls(false);
      if ($('term-state').textContent.startsWith('Connecting')) {
        $('term-state').textContent = 'Could not open a terminal in ' + id + ' (refused or gone; close code ' + ev.code + ').';
      } else if (!/exited|error/.test($('term-state').textContent)) {
        $('term-state').textContent = 'Terminal in ' + id + ' closed.';
      }
    }
  });
}

function closeTerminal() {
  if (!term) return;
  const { ws, id } = term;
  term = null;
  ws.close();
  termControls(false);
  $('term-state').textContent = 'Terminal in ' + id + ' closed.';
}

function termSend(data) {
  if (term && term.ws.readyState === WebSocket.OPEN) term.ws.send(new TextEncoder().encode(data));
}

// ---- plots -------------------------------------------------------------

// Prometheus text: [{name, labels, value}] (a timestamp after the value
// is ignored).
function parseMetrics(text) {
  const out = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

// The sum of `name`'s samples whose labels include every one of `want`:
// through a gateway each node has its own series (label `node`).
function sumOf(samples, name, want) {
  let s = 0;
  for (const x of samples) {
    if (x.name === name && Object.entries(want || {}).every(([k, v]) => x.labels[k] === v)) s += x.value;
  }
  return s;
}

const series = { pool: [], restore: [], active: [], ready: [] };
let lastMetrics = {}; // source -> {sum, count} at the last poll

function push(arr, v) {
  arr.push(v);
  if (arr.length > PLOT_POINTS) arr.shift();
}

async function refreshMetrics() {
  const m = parseMetrics(await api('GET', '/metrics'));
  for (const src of ['pool', 'restore']) {
    const sum = sumOf(m, 'forkd_spawn_latency_seconds_sum', { source: src });
    const count = sumOf(m, 'forkd_spawn_latency_seconds_count', { source: src });
    let mean = null;
    const before = lastMetrics[src];
    if (before && count > before.count) mean = ((sum - before.sum) / (count - before.count)) * 1000;
    push(series[src], mean);
    lastMetrics[src] = { sum, count };
  }
  push(series.active, sumOf(m, 'forkd_sandboxes_active'));
  push(series.ready, sumOf(m, 'forkd_pool_ready'));
  const last = (a) => a.filter((v) => v != null).slice(-1)[0];
  draw($('plot-latency'), [series.pool, series.restore], 'ms',
    (last(series.pool) == null && last(series.restore) == null) ? 'No spawns yet.'
      : 'Latest mean spawn latency: ' + ms('from a pool', last(series.pool)) + ', ' + ms('restored', last(series.restore)) + '.');
  draw($('plot-fanout'), [series.active, series.ready], '',
    'Now ' + plural(last(series.active), 'sandbox', 'sandboxes') + ' running, ' +
      plural(last(series.ready), 'pool child', 'pool children') + ' ready.');
}

function ms(what, v) {
  return v == null ? what + ' none yet' : what + ' ' + v.toFixed(0) + ' ms';
}

const SVG = 'http://www.w3.org/2000/svg';

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// A line per series (gaps where a value is null) over the last
// PLOT_POINTS polls; the y axis from 0 to the largest value.
function draw(svg, lines, unit, description) {
  const W = 640, H = 180, L = 48, B = 20, T = 10;
  const max = Math.max(1, ...lines.flat().filter((v) => v != null));
  const x = (i) => L + (i * (W - L - 8)) / (PLOT_POINTS - 1);
  const y = (v) => H - B - (v / max) * (H - B - T);
  const keep = Array.from(svg.children).filter((c) => c.tagName === 'title' || c.tagName === 'desc');
  const parts = [
    svgEl('line', { x1: L, y1: H - B, x2: W - 8, y2: H - B, class: 'axis' }),
    svgEl('line', { x1: L, y1: T, x2: L, y2: H - B, class: 'axis' }),
  ];
  const top = svgEl('text', { x: L - 4, y: T + 10, class: 'label', 'text-anchor': 'end' });
  top.textContent = (max >= 10 ? max.toFixed(0) : max.toFixed(1)) + (unit ? ' ' + unit : '');
  const zero = svgEl('text', { x: L - 4, y: H - B, class: 'label', 'text-anchor': 'end' });
  zero.textContent = '0';
  parts.push(top, zero);
  lines.forEach((vals, n) => {
    const off = PLOT_POINTS - vals.length;
    let d = '';
    let pen = false;
    vals.forEach((v, i) => {
      if (v == null) {
        pen = false;
        return;
      }
      d += (pen ? 'L' : 'M') + x(off + i).toFixed(1) + ' ' + y(v).toFixed(1) + ' ';
      pen = true;
      parts.push(svgEl('circle', { cx: x(off + i).toFixed(1), cy: y(v).toFixed(1), r: 2, class: 'dot s' + n }));
    });
    if (d) parts.push(svgEl('path', { d, class: 'line s' + n }));
  });
  svg.replaceChildren(...keep, ...parts);
  const desc = svg.querySelector('desc');
  if (desc.textContent !== description) desc.textContent = description;
}

// ---- polling -----------------------------------------------------------

let slowAt = 0;

async function tick() {
  if (refused) return;
  try {
    const slow = Date.now() >= slowAt;
    const jobs = [refreshSandboxes(), refreshPools(), refreshMetrics()];
    if (slow) {
      slowAt = Date.now() + SLOW_POLL_MS;
      jobs.push(refreshNode(), refreshSnapshots());
    }
    const results = await Promise.allSettled(jobs);
    const bad = results.find((r) => r.status === 'rejected');
    if (bad && bad.reason.status !== 401) say('Refreshing failed: ' + bad.reason.message);
    if (!bad) accept();
  } catch (e) {
    say('Refreshing failed: ' + e.message);
  }
}

function start() {
  $('token').value = token;
  $('auth-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    token = $('token').value.trim();
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
    refused = false;
    $('auth-status').textContent = '';
    $('auth').classList.remove('refused');
    slowAt = 0;
    say('Token set; refreshing.');
    tick();
  });
  $('forget').addEventListener('click', () => {
    token = '';
    $('token').value = '';
    sessionStorage.removeItem(TOKEN_KEY);
    say('Token forgotten.');
  });
  $('spawn-form').addEventListener('submit', spawn);
  $('pool-form').addEventListener('submit', resizePool);
  $('term-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    termSend($('term-in').value + '\r');
    $('term-in').value = '';
  });
  $('term-ctrlc').addEventListener('click', () => termSend('\x03'));
  $('term-close').addEventListener('click', closeTerminal);
  tick();
  setInterval(tick, POLL_MS);
}

start();
