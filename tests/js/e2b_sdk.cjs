// The unmodified E2B JavaScript SDKs (npm `e2b`, `@e2b/code-interpreter`)
// against poold. Run by tests/tests/e2b.rs with node, NODE_PATH at the
// pinned packages (tests/js/package.json) and E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY at poold. Argument: the template (a
// python-numpy snapshot). Every check throws on failure; the last line
// printed is `E2B JS OK <version>` when everything passed.
'use strict'

const { Sandbox } = require('@e2b/code-interpreter')
const e2b = require('e2b')
const http = require('node:http')

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`)
}

function step(what) {
  console.log(`-- ${what}`)
}

// A GET to the sandbox plane naming `host`, as a client that resolves
// the sandbox URL (wildcard DNS) would send it: {status, body}.
function planeGet(host, path) {
  const plane = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = http.get(
      { host: plane.hostname, port: plane.port, path, headers: { Host: host }, timeout: 20_000 },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (d) => (body += d))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      },
    )
    req.on('timeout', () => req.destroy(new Error(`GET ${host}${path} timed out`)))
    req.on('error', reject)
  })
}

async function main() {
  const template = process.argv[2]
  const version = require('e2b/package.json').version
  console.log(`e2b (JS) ${version} against ${template}`)
  const runId = `js-${process.pid}-${Date.now()}`

  step('create')
  const sbx = await Sandbox.create(template, {
    timeoutMs: 600_000,
    metadata: { run: runId },
    envs: { SBX_ENV: 'from-create' },
  })
  try {
    step('commands')
    let r = await sbx.commands.run('echo $SBX_ENV; echo err >&2')
    check(r.stdout === 'from-create\n', `stdout ${JSON.stringify(r.stdout)}`)
    check(r.stderr === 'err\n', `stderr ${JSON.stringify(r.stderr)}`)
    r = await sbx.commands.run('exit 3').catch((e) => e)
    check(r instanceof e2b.CommandExitError && r.exitCode === 3, `exit 3: ${r}`)

    step('commands: sendStdin, closeStdin')
    const piped = await sbx.commands.run('tr a-z A-Z; echo :eof', { background: true, stdin: true })
    await sbx.commands.sendStdin(piped.pid, 'typed ')
    await sbx.commands.sendStdin(piped.pid, 'in')
    await sbx.commands.closeStdin(piped.pid)
    r = await piped.wait()
    check(r.stdout === 'TYPED IN:eof\n', `stdin ${JSON.stringify(r.stdout)}`)

    step('files')
    await sbx.files.write('js/note.txt', 'from js')
    check((await sbx.files.read('js/note.txt')) === 'from js', 'read back')
    const names = (await sbx.files.list('js')).map((e) => e.name)
    check(JSON.stringify(names) === '["note.txt"]', `list ${names}`)
    await sbx.files.remove('js/missing') // envd: a missing path is done
    const info = await sbx.files.getInfo('js/note.txt')
    check(info.type === 'file' && info.size === 7, `getInfo ${JSON.stringify(info)}`)
    const tagged = await sbx.files.write('js/tagged.txt', 't', { metadata: { Kind: 'note' } })
    check(tagged.metadata?.kind === 'note', `write metadata ${JSON.stringify(tagged)}`)
    const tinfo = await sbx.files.getInfo('js/tagged.txt')
    check(tinfo.metadata?.kind === 'note', `getInfo metadata ${JSON.stringify(tinfo)}`)

    step('watchDir (recursive) sees a write in a subdirectory')
    await sbx.files.makeDir('js/watched/sub')
    const seen = []
    const handle = await sbx.files.watchDir('js/watched', (ev) => seen.push(ev), { recursive: true })
    await sbx.files.write('js/watched/sub/w.txt', 'w')
    const wrote = () => seen.some((e) => e.name === 'sub/w.txt' && e.type === e2b.FilesystemEventType.WRITE)
    for (let i = 0; i < 200 && !wrote(); i++) await new Promise((r) => setTimeout(r, 100))
    await handle.stop()
    check(wrote(), `watch events ${JSON.stringify(seen)}`)

    step('getHost(port) reaches a guest server by URL')
    await sbx.files.write('/tmp/site/hello.txt', 'served by the guest')
    await sbx.commands.run('cd /tmp/site && exec python3 -m http.server 8000', { background: true })
    const host = sbx.getHost(8000)
    check(host.startsWith(`8000-${sbx.sandboxId}.`), `getHost ${host}`)
    let web = await planeGet(host, '/hello.txt')
    for (let i = 0; i < 100 && web.status !== 200; i++) {
      await new Promise((r) => setTimeout(r, 100))
      web = await planeGet(host, '/hello.txt')
    }
    check(web.status === 200 && web.body === 'served by the guest', `port 8000: ${web.status} ${web.body}`)
    web = await planeGet(sbx.getHost(8001), '/')
    check(web.status === 502 && web.body.includes('nothing listens on port 8001'), `closed port: ${web.status} ${web.body}`)

    step('run_code keeps state; timeoutMs is honoured')
    let ex = await sbx.runCode('x = 41\nx + 1')
    check(ex.text === '42', `text ${ex.text}`)
    // A cell that outlives its timeoutMs ends in the SDK's TimeoutError
    // (its body timer aborted the answer), not in a late result.
    const late = await sbx.runCode('import time\ntime.sleep(15)', { timeoutMs: 3000 }).catch((e) => e)
    check(late instanceof e2b.TimeoutError, `a 15 s cell with timeoutMs 3000 answered: ${late}`)
    // The warm interpreter has no interrupt: the next cell waits for that one.
    ex = await sbx.runCode('x')
    check(ex.text === '41', `the interpreter after a timeout: ${ex.text} ${JSON.stringify(ex.error)}`)

    step('pause, list, connect')
    await sbx.pause()
    const paused = await e2b.Sandbox.list({ query: { metadata: { run: runId }, state: ['paused'] } }).nextItems()
    check(paused.length === 1 && paused[0].sandboxId === sbx.sandboxId, `paused list ${JSON.stringify(paused)}`)
    await sbx.connect()
    ex = await sbx.runCode('x * 2')
    check(ex.text === '82', `state after the resume: ${ex.text}`)
    check((await sbx.files.read('js/note.txt')) === 'from js', 'the file after the resume')
    const got = await sbx.getInfo()
    check(got.metadata.run === runId && got.templateId === template, `getInfo ${JSON.stringify(got)}`)
  } finally {
    await sbx.kill()
  }
  const left = await e2b.Sandbox.list({ query: { metadata: { run: runId } } }).nextItems()
  check(left.length === 0, `left after the kill: ${JSON.stringify(left)}`)
  console.log(`E2B JS OK ${version}`)
}

main().catch((e) => {
  console.error(e)
  process.exit(1)
})
