// The default socket rule of docs/protocol.md and the socket checks, without a daemon.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { once } from 'node:events';
import { test } from 'node:test';

import { WeightCacheError, checkSocket, defaultSocket, runtimeDir, trustedUids } from '../src/index.mjs';

const euid = process.geteuid();

test('the socket rule: $WEIGHTCACHE_SOCKET, then the runtime dir per device', () => {
  assert.equal(defaultSocket('cpu', { WEIGHTCACHE_SOCKET: '/s/d.sock', WEIGHTCACHE_RUNTIME_DIR: '/r' }), '/s/d.sock');
  assert.equal(defaultSocket('cpu', { WEIGHTCACHE_SOCKET: '', WEIGHTCACHE_RUNTIME_DIR: '/r' }), '/r/cpu.sock');
  const uuid = 'GPU-01234567-89ab-cdef-0123-456789abcdef';
  assert.equal(defaultSocket(uuid, { WEIGHTCACHE_RUNTIME_DIR: '/r' }), `/r/${uuid}.sock`);
});

test('the runtime dir: explicit, root, XDG, then /tmp', () => {
  assert.equal(runtimeDir({ WEIGHTCACHE_RUNTIME_DIR: '/r', XDG_RUNTIME_DIR: '/x' }), '/r');
  const fallback = euid === 0 ? '/run/weightcache' : '/x/weightcache';
  assert.equal(runtimeDir({ WEIGHTCACHE_RUNTIME_DIR: '', XDG_RUNTIME_DIR: '/x' }), fallback);
  const last = euid === 0 ? '/run/weightcache' : `/tmp/weightcache-${euid}`;
  assert.equal(runtimeDir({}), last);
});

test('a socket behind a symlink, or of an untrusted uid, is refused', async () => {
  const folder = fs.mkdtempSync(path.join(os.tmpdir(), 'wc-sock-'));
  const server = net.createServer();
  try {
    const socket = path.join(folder, 'd.sock');
    server.listen(socket);
    await once(server, 'listening');
    assert.equal(checkSocket(socket, trustedUids()), euid);

    fs.symlinkSync(socket, path.join(folder, 'link.sock'));
    const linked = (() => { try { checkSocket(path.join(folder, 'link.sock'), trustedUids()); } catch (e) { return e; } })();
    assert.ok(linked instanceof WeightCacheError);
    assert.equal(linked.reason, 'UNTRUSTED_SOCKET');
    assert.match(linked.message, /is a symlink; refusing it/);

    const stranger = (() => { try { checkSocket(socket, new Set([12345])); } catch (e) { return e; } })();
    assert.equal(stranger.reason, 'UNTRUSTED_SOCKET');
    assert.match(stranger.message, new RegExp(`belongs to uid ${euid}`));
  } finally {
    server.close();
    fs.rmSync(folder, { recursive: true, force: true });
  }
});
