// The Node client against a real daemon (test/daemon.py starts it): every tensor bitwise
// equal to what Python's safetensors reads, exact reason codes, KeepAlive renewals, lease
// loss, Release; the daemon must leave nothing behind when it stops.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { once } from 'node:events';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';

import { DTYPES, WeightCacheClient, WeightCacheError, computeFingerprint } from '../src/index.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PYTHON = process.env.WEIGHTCACHE_PYTHON ?? path.resolve(HERE, '../../../.venv/bin/python');

// Seconds the launcher may take to print its line (torch import, checkpoints, the daemon's
// preload: run_daemon alone allows the daemon 150 s to be ready), then to stop the daemon
// and check for leftovers once its stdin closes (run_daemon waits 45 s after SIGTERM).
const START_TIMEOUT = 180;
const STOP_TIMEOUT = 60;
// Each test's calls carry no deadline: a daemon that accepts but never answers would hold
// a test, and after() with it, forever.
const EACH = { timeout: 60_000 };
const LATE = Symbol('late');

let daemon; // the launcher process, leader of its own process group
let stderr = ''; // everything it wrote there, for the failure messages
let info; // what it printed: socket, checkpoints, tensors, dtypes
let client;

const ended = () => daemon.exitCode !== null || daemon.signalCode !== null;

// `promise`'s value, or LATE once `seconds` have passed.
async function within(promise, seconds) {
  const abort = new AbortController();
  try {
    return await Promise.race([promise, sleep(seconds * 1000, LATE, { signal: abort.signal })]);
  } finally {
    abort.abort();
  }
}

// SIGKILL to the launcher's whole group: the daemon it started too.
async function killGroup() {
  const exited = once(daemon, 'exit');
  try {
    process.kill(-daemon.pid, 'SIGKILL');
  } catch (err) {
    if (err.code !== 'ESRCH') throw err;
  }
  if (!ended()) await exited;
}

before(async () => {
  // detached: a process group of its own, for killGroup. Its stdin is a pipe: should this
  // process die, the launcher reads EOF and stops the daemon as after() would.
  daemon = spawn(PYTHON, [path.join(HERE, 'daemon.py')], { stdio: 'pipe', detached: true });
  daemon.stderr.setEncoding('utf8').on('data', (chunk) => {
    stderr += chunk;
  });
  daemon.stdin.on('error', () => {}); // EPIPE once it has exited: its status tells why
  const line = once(createInterface({ input: daemon.stdout }), 'line').then(([text]) => text);
  const exit = once(daemon, 'exit').then(([code, signal]) => ({ code, signal }));
  const got = await within(Promise.race([line, exit]), START_TIMEOUT);
  if (typeof got !== 'string') {
    let why = `exited (status ${got.code}, signal ${got.signal}) before printing its line`;
    if (got === LATE) {
      why = `printed nothing in ${START_TIMEOUT} s`;
      // SIGINT first: the launcher's KeyboardInterrupt stops the daemon and removes its
      // files; SIGKILL to the group if that does not end it.
      const exited = once(daemon, 'exit');
      daemon.kill('SIGINT');
      if ((await within(exited, STOP_TIMEOUT)) === LATE) await killGroup();
    }
    throw new Error(`daemon.py ${why}; its stderr:\n${stderr}`);
  }
  info = JSON.parse(got);
  client = new WeightCacheClient({ socket: info.socket });
});

after(async () => {
  client?.close();
  if (info === undefined) return; // before() failed, said why and left no process
  const exited = once(daemon, 'exit').then(([code]) => code);
  daemon.stdin.end(); // the launcher stops the daemon and checks for leftovers
  const code = ended() ? daemon.exitCode : await within(exited, STOP_TIMEOUT);
  if (code === LATE) {
    await killGroup();
    assert.fail(`daemon.py did not stop in ${STOP_TIMEOUT} s after its stdin closed; its stderr:\n${stderr}`);
  }
  assert.equal(code, 0, `the daemon stopped cleanly and left no socket or segment; stderr:\n${stderr}`);
});

const sha256 = (bytes) => createHash('sha256').update(bytes).digest('hex');

function assertBitwiseEqual(attachment, expected) {
  assert.deepEqual([...attachment.tensors.keys()].sort(), Object.keys(expected).sort());
  for (const [name, want] of Object.entries(expected)) {
    const tensor = attachment.tensors.get(name);
    assert.equal(tensor.dtype, want.dtype, name);
    assert.deepEqual(tensor.shape, want.shape, name);
    assert.equal(sha256(tensor.bytes), want.sha256, name);
    const [, Typed, lanes] = DTYPES[tensor.dtype];
    assert.ok(tensor.data instanceof Typed, name);
    assert.equal(tensor.data.length, want.shape.reduce((a, b) => a * b, 1) * lanes, name);
  }
}

test("the dtype table is the Python SDK's: the same names, the same element sizes", EACH, () => {
  const sizes = Object.fromEntries(Object.entries(DTYPES).map(([name, [itemsize]]) => [name, itemsize]));
  assert.deepEqual(sizes, info.dtypes);
  for (const [name, [itemsize, Typed, lanes]] of Object.entries(DTYPES)) {
    assert.equal(Typed.BYTES_PER_ELEMENT * lanes, itemsize, name);
  }
});

test('attaches by its own fingerprint (table format): every tensor bitwise', EACH, async () => {
  const folder = info.checkpoints.single;
  const attachment = await client.acquire({
    fingerprint: computeFingerprint(folder),
    checkpointPath: folder,
  });
  try {
    assert.equal(attachment.model.name, 'single');
    assertBitwiseEqual(attachment, info.tensors.single);
    // Typed values, not only bytes: F32 and I64 read as numbers.
    assert.deepEqual([...attachment.tensors.get('layers.1.norm.bias').data], [1, 2, 3, 4, 5, 6, 7, 8]);
    assert.equal(attachment.tensors.get('layers.1.scale').data[0], -3.25);
    assert.equal(attachment.tensors.get('layers.0.position_ids').data.constructor, BigInt64Array);
  } finally {
    await attachment.release();
  }
});

test('attaches a sharded checkpoint with one view message per tensor', EACH, async () => {
  const folder = info.checkpoints.sharded;
  const attachment = await client.acquire({
    fingerprint: computeFingerprint(folder),
    checkpointPath: folder,
    tensorFormat: 'VIEWS',
  });
  try {
    assert.equal(attachment.model.name, 'sharded');
    assertBitwiseEqual(attachment, info.tensors.sharded);
  } finally {
    await attachment.release();
  }
});

test('attaches trusting the daemon identity: every dtype bitwise', EACH, async () => {
  const attachment = await client.acquireByName('alltypes');
  try {
    assert.equal(attachment.model.fingerprint.digest, computeFingerprint(info.checkpoints.alltypes).digest);
    assertBitwiseEqual(attachment, info.tensors.alltypes);
    assert.equal(Object.keys(info.tensors.alltypes).length, Object.keys(DTYPES).length);
  } finally {
    await attachment.release();
  }
});

test('a fingerprint of another recipe is refused with FINGERPRINT_MISMATCH', EACH, async () => {
  const folder = info.checkpoints.single;
  const fingerprint = computeFingerprint(folder, { recipe: { dtype: 'F16' } });

  const err = await client.acquire({ fingerprint, checkpointPath: folder }).catch((e) => e);

  assert.ok(err instanceof WeightCacheError);
  assert.equal(err.reason, 'FINGERPRINT_MISMATCH');
  assert.equal(err.code, 5); // NOT_FOUND
  assert.equal(err.domain, 'weightcache.v1');
  assert.equal(err.metadata.model, 'single');
  assert.equal(err.metadata.components, 'recipe');
});

test('a fingerprint nothing resembles is refused with MODEL_NOT_FOUND', EACH, async () => {
  const fingerprint = { digest: 'a'.repeat(64), level: 'full', components: [] };

  const err = await client.acquire({ fingerprint, checkpointPath: '/nowhere' }).catch((e) => e);

  assert.equal(err.reason, 'MODEL_NOT_FOUND');
  assert.equal(err.code, 5);
  const byName = await client.acquireByName('no-such-model').catch((e) => e);
  assert.equal(byName.reason, 'MODEL_NOT_FOUND');
  assert.equal(byName.metadata.model, 'no-such-model');
});

test('a malformed request is refused with INVALID_ARGUMENT naming the field', EACH, async () => {
  const err = await client.acquire({ fingerprint: { digest: 'XYZ', level: 'full' } }).catch((e) => e);

  assert.equal(err.reason, 'INVALID_ARGUMENT');
  assert.equal(err.code, 3);
  assert.equal(err.metadata.field, 'fingerprint.digest');
});

test('KeepAlive renews a lease past its TTL, and Release ends it', EACH, async () => {
  const attachment = await client.acquireByName('single', { ttl: 1 });
  const renewals = [];
  attachment.on('renewed', (expireTime) => renewals.push(expireTime));
  let lost = null;
  attachment.on('lost', (reason) => { lost = reason; });
  assert.equal(attachment.ttl, 1);

  await sleep(3000); // three TTLs: the lease would have expired twice without renewals

  assert.equal(lost, null);
  assert.ok(renewals.length >= 6, `${renewals.length} renewals in 3 s at ttl/3`);
  assert.ok(renewals.at(-1) > renewals[0]);
  assert.equal((await client.getModel('single')).lease_count, 1);
  await attachment.release();
  assert.equal((await client.getModel('single')).lease_count, 0);
  assert.equal(client.leases.size, 0);
  assert.equal(lost, null);
});

test('a lease the daemon no longer knows is reported lost', EACH, async () => {
  const attachment = await client.acquireByName('single', { ttl: 1 });
  const lostEvent = once(client, 'leaseLost');
  // Another client ends the lease behind this one's back.
  const other = new WeightCacheClient({ socket: info.socket });
  await other.release(attachment.leaseId);
  other.close();

  const [which, reason] = await lostEvent;

  assert.equal(which, attachment);
  assert.equal(reason, 'NOT_FOUND');
  assert.equal(attachment.lost, 'NOT_FOUND');
  assert.equal(client.leases.size, 0);
  // The tensors are the client's own copy: still readable.
  assert.equal(attachment.tensors.get('layers.1.norm.bias').data[7], 8);
});
