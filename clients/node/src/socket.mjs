// Where a device's daemon listens (docs/protocol.md, "Where a device's daemon listens"),
// and whether its socket may be trusted (the Python SDK's _trust.check_socket).

import fs from 'node:fs';
import path from 'node:path';

import { CLIENT_REASONS, WeightCacheError } from './errors.mjs';

const nonEmpty = (value) => (value === undefined || value === '' ? undefined : value);

/**
 * The runtime folder: $WEIGHTCACHE_RUNTIME_DIR; else /run/weightcache as root; else
 * $XDG_RUNTIME_DIR/weightcache; else /tmp/weightcache-<euid>.
 *
 * @param {NodeJS.ProcessEnv} [env=process.env]
 * @returns {string}
 */
export function runtimeDir(env = process.env) {
  const given = nonEmpty(env.WEIGHTCACHE_RUNTIME_DIR);
  if (given !== undefined) return given;
  if (process.geteuid() === 0) return '/run/weightcache';
  const xdg = nonEmpty(env.XDG_RUNTIME_DIR);
  if (xdg !== undefined) return path.join(xdg, 'weightcache');
  return `/tmp/weightcache-${process.geteuid()}`;
}

/**
 * The daemon socket of a device: $WEIGHTCACHE_SOCKET if set, else <runtime dir>/cpu.sock
 * for the CPU, <runtime dir>/<uuid>.sock for a GPU given by its UUID ("GPU-..." or
 * "MIG-...", as nvidia-smi -L prints it; never an index).
 *
 * @param {string} [device='cpu'] "cpu" or a device UUID.
 * @param {NodeJS.ProcessEnv} [env=process.env]
 * @returns {string} an absolute path.
 */
export function defaultSocket(device = 'cpu', env = process.env) {
  const given = nonEmpty(env.WEIGHTCACHE_SOCKET);
  if (given !== undefined) return given;
  return path.join(runtimeDir(env), device === 'cpu' ? 'cpu.sock' : `${device}.sock`);
}

/**
 * Uids whose daemon is trusted: this user, root, and $WEIGHTCACHE_TRUSTED_UID.
 *
 * @param {number} [trustedUid]
 * @returns {Set<number>}
 * @throws {WeightCacheError} UNTRUSTED_SOCKET: $WEIGHTCACHE_TRUSTED_UID is not a uid.
 */
export function trustedUids(trustedUid, env = process.env) {
  const uids = new Set([process.geteuid(), 0]);
  let extra = trustedUid;
  if (extra === undefined && nonEmpty(env.WEIGHTCACHE_TRUSTED_UID) !== undefined) {
    extra = Number(env.WEIGHTCACHE_TRUSTED_UID);
    if (!Number.isSafeInteger(extra)) {
      throw new WeightCacheError('$WEIGHTCACHE_TRUSTED_UID is not a uid', {
        reason: CLIENT_REASONS.UNTRUSTED_SOCKET,
      });
    }
  }
  if (extra !== undefined) uids.add(extra);
  return uids;
}

function checkOne(file, isKind, what, trusted) {
  const info = fs.lstatSync(file);
  const refuse = (message) => {
    throw new WeightCacheError(message, { reason: CLIENT_REASONS.UNTRUSTED_SOCKET });
  };
  if (info.isSymbolicLink()) refuse(`${file}: the daemon's ${what} is a symlink; refusing it`);
  if (!isKind(info)) refuse(`${file}: not a ${what}`);
  if (!trusted.has(info.uid)) {
    refuse(`${file}: the daemon's ${what} belongs to uid ${info.uid}; trust it with $WEIGHTCACHE_TRUSTED_UID`);
  }
  return info.uid;
}

/**
 * Check a daemon socket and its folder: neither a symlink, both owned by a trusted uid.
 *
 * @param {string} socket
 * @param {Set<number>} trusted
 * @returns {number} the socket owner's uid (shared-memory segments must be theirs).
 * @throws {Error} ENOENT: nothing at `socket`.
 * @throws {WeightCacheError} UNTRUSTED_SOCKET: a symlink, the wrong kind, or an untrusted owner.
 */
export function checkSocket(socket, trusted) {
  checkOne(path.dirname(path.resolve(socket)), (i) => i.isDirectory(), 'folder', trusted);
  return checkOne(socket, (i) => i.isSocket(), 'socket', trusted);
}
