// A weightcache worker client: connect to a daemon's Unix socket, Acquire a model, read
// its tensors, keep the lease alive, Release it (docs/protocol.md, "Attaching, step by step").

import { randomUUID } from 'node:crypto';
import { EventEmitter } from 'node:events';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

import { CLIENT_REASONS, WeightCacheError, fromRpcError } from './errors.mjs';
import { checkSocket, defaultSocket, trustedUids } from './socket.mjs';
import { buildTensors, readSharedMemory, viewsOf } from './tensors.mjs';

/** The repository's protos/ (the contract plus the vendored google/rpc files). An
 * installed Python package has the same files at `weightcache.proto_path()`. */
export const DEFAULT_PROTO_PATH = path.resolve(
  path.dirname(fileURLToPath(import.meta.url)),
  '../../../protos',
);
/** An AcquireResponse lists every tensor: the daemon sends up to 256 MiB. */
export const MAX_RESPONSE_BYTES = 256 * 1024 * 1024;
const CONTRACT = 'weightcache/v1/weight_cache_service.proto';

const seconds = (duration) => Number(duration?.seconds ?? 0) + (duration?.nanos ?? 0) / 1e9;
const toDuration = (s) => ({ seconds: Math.floor(s), nanos: Math.round((s % 1) * 1e9) });
const toDate = (timestamp) => new Date(seconds(timestamp) * 1000);

// A fingerprint as computeFingerprint returns it ({level: 'full', ...}), or a wire one
// (Model.fingerprint, {level: 'FINGERPRINT_LEVEL_FULL', ...}), as the wire message.
function fingerprintMessage(fp) {
  const level = String(fp.level ?? 'full');
  return {
    digest: fp.digest ?? '',
    level: level.startsWith('FINGERPRINT_LEVEL_') ? level : `FINGERPRINT_LEVEL_${level.toUpperCase()}`,
    components: (fp.components ?? []).map(({ name, digest }) => ({ name, digest })),
  };
}

/**
 * One granted lease and the tensors it maps. Emits 'lost' (reason) when the lease is
 * lost and 'revoking' (deadline: Date) when the daemon will free the memory.
 */
export class Attachment extends EventEmitter {
  constructor(client, reply, tensors) {
    super();
    this.client = client;
    this.lease = reply.lease;
    this.leaseId = reply.lease.lease_id;
    this.model = reply.model;
    this.storage = reply.storage;
    this.environment = reply.environment;
    /** @type {Map<string, {name: string, dtype: string, shape: number[], data: ArrayBufferView, bytes: Uint8Array}>} */
    this.tensors = tensors;
    /** Lease TTL in seconds, as granted. */
    this.ttl = seconds(reply.lease.ttl);
    this.expireTime = toDate(reply.lease.expire_time);
    this.lastActive = Date.now();
    this.lost = null;
  }

  /** End the lease (idempotent). The tensors stay readable: they are a private copy. */
  release() {
    return this.client.release(this.leaseId);
  }
}

/**
 * A client of one daemon. Emits 'leaseLost' (attachment, reason) and 'revoking'
 * (attachment, deadline) for every lease it keeps alive; the reasons are "NOT_FOUND" (the
 * daemon no longer knows the lease), "EXPIRED" (no ACTIVE for 2/3 of the TTL),
 * "INSTANCE_CHANGED" (the daemon restarted) and "STREAM_BROKEN" (the KeepAlive stream ended).
 */
export class WeightCacheClient extends EventEmitter {
  /**
   * @param {object} [options]
   * @param {string} [options.socket] the daemon's socket (default: defaultSocket('cpu')).
   * @param {string} [options.protoPath] include folder of the .proto files.
   * @param {number} [options.trustedUid] a uid trusted besides yours and root's.
   * @throws {WeightCacheError} UNTRUSTED_SOCKET: the socket or its folder is a symlink or
   *   owned by an untrusted uid.
   * @throws {Error} ENOENT: no socket there.
   */
  constructor({ socket = defaultSocket(), protoPath = DEFAULT_PROTO_PATH, trustedUid } = {}) {
    super();
    this.socket = socket;
    this.protoPath = protoPath;
    this.ownerUid = checkSocket(socket, trustedUids(trustedUid));
    const definition = protoLoader.loadSync(CONTRACT, {
      includeDirs: [protoPath],
      keepCase: true,
      longs: Number, // byte sizes and offsets stay below 2^53
      enums: String,
      defaults: true,
      oneofs: true,
    });
    const { WeightCacheService } = grpc.loadPackageDefinition(definition).weightcache.v1;
    this.stub = new WeightCacheService(`unix:${path.resolve(socket)}`, grpc.credentials.createInsecure(), {
      'grpc.max_receive_message_length': MAX_RESPONSE_BYTES,
    });
    /** @type {Map<string, Attachment>} */
    this.leases = new Map();
    this.stream = null;
    this.timer = null;
  }

  /** A unary call, its failure as a WeightCacheError. */
  call(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, (err, reply) =>
        err ? reject(fromRpcError(err, this.protoPath)) : resolve(reply),
      );
    });
  }

  /** @returns {Promise<object>} the held model `name` (a weightcache.v1.Model). */
  async getModel(name) {
    return (await this.call('GetModel', { name })).model;
  }

  /** @returns {Promise<object[]>} every held model, sorted by name. */
  async listModels() {
    return (await this.call('ListModels', {})).models;
  }

  /**
   * Acquire the model whose fingerprint is `fingerprint`, read its tensors and keep its
   * lease alive.
   *
   * @param {object} options
   * @param {{digest: string, level: string, components: Array<{name: string, digest: string}>}} options.fingerprint
   *   from computeFingerprint (normal mode) or a Model.fingerprint (acquireByName).
   * @param {string} [options.checkpointPath] the worker's checkpoint folder (realpath),
   *   used by the daemon only to explain a mismatch.
   * @param {number} [options.ttl] lease TTL in seconds (default: the daemon's, 10 s).
   * @param {'TABLE'|'VIEWS'} [options.tensorFormat='TABLE']
   * @param {number} [options.loadingTimeout=30] seconds to retry while MODEL_LOADING.
   * @returns {Promise<Attachment>}
   * @throws {WeightCacheError} with the daemon's reason (FINGERPRINT_MISMATCH,
   *   MODEL_NOT_FOUND, MODEL_LOADING after loadingTimeout, ...), DAEMON_UNAVAILABLE, or
   *   INVALID_HANDLE (a CUDA handle, which this client does not open, or bad views).
   */
  async acquire({ fingerprint, checkpointPath = '', ttl, tensorFormat = 'TABLE', loadingTimeout = 30 }) {
    const request = {
      request_id: randomUUID(),
      fingerprint: fingerprintMessage(fingerprint),
      checkpoint_path: checkpointPath,
      pid: process.pid,
      tensor_format: `TENSOR_FORMAT_${tensorFormat}`,
    };
    if (ttl !== undefined) request.ttl = toDuration(ttl);
    const deadline = Date.now() + loadingTimeout * 1000;
    let reply;
    for (;;) {
      try {
        // The same request_id on a retry: a retry returns the same lease.
        reply = await this.call('Acquire', request);
        break;
      } catch (err) {
        if (err.reason !== 'MODEL_LOADING' || Date.now() > deadline) throw err;
        await sleep(100);
      }
    }
    return this.attach(reply);
  }

  /**
   * Acquire model `name` trusting the daemon's identity (docs/protocol.md, "Acquire
   * trusting the daemon's identity"): its Model.fingerprint is sent back unchanged, and
   * nothing about the worker's own files is checked.
   *
   * While the model loads at level FULL its fingerprint may be pending (empty digest:
   * docs/protocol.md, "A pending fingerprint while a first load hashes"): the model is
   * asked for again until its digest is there, as Acquire is retried on MODEL_LOADING.
   *
   * @param {string} name the held model's name.
   * @param {object} [options] as for acquire, without fingerprint.
   * @returns {Promise<Attachment>}
   * @throws {WeightCacheError} as acquire, MODEL_NOT_FOUND for an unknown name,
   *   MODEL_LOADING when its fingerprint is still pending after options.loadingTimeout, and
   *   MODEL_FAILED when it failed before its fingerprint was complete.
   */
  async acquireByName(name, options = {}) {
    const deadline = Date.now() + (options.loadingTimeout ?? 30) * 1000;
    let model = await this.getModel(name);
    while (!model.fingerprint?.digest) {
      const loading = model.state === 'MODEL_STATE_LOADING';
      if (!loading || Date.now() > deadline) {
        // FAILED before its hashes were done: the daemon's own reason is in model.error.
        throw new WeightCacheError(
          `model ${name} is ${model.state} with its fingerprint pending: ${model.error || 'still hashing its shards'}`,
          { reason: loading ? 'MODEL_LOADING' : 'MODEL_FAILED', metadata: { model: name } },
        );
      }
      await sleep(100);
      model = await this.getModel(name);
    }
    return this.acquire({ ...options, fingerprint: model.fingerprint, checkpointPath: model.path });
  }

  async attach(reply) {
    let tensors;
    try {
      if (reply.storage?.handle !== 'shared_memory') {
        throw new WeightCacheError(
          `the daemon offers a ${reply.storage?.handle} handle; this client reads only shared memory (cpu_shm)`,
          { reason: CLIENT_REASONS.INVALID_HANDLE },
        );
      }
      const arena = readSharedMemory(reply.storage.shared_memory, this.ownerUid);
      tensors = buildTensors(arena, viewsOf(reply));
    } catch (err) {
      await this.call('Release', { lease_id: reply.lease.lease_id }).catch(() => {});
      throw err;
    }
    const attachment = new Attachment(this, reply, tensors);
    this.leases.set(attachment.leaseId, attachment);
    this.keepAlive();
    return attachment;
  }

  /** End a lease (idempotent: an unknown lease succeeds). */
  async release(leaseId) {
    this.leases.delete(leaseId);
    await this.call('Release', { lease_id: leaseId });
    if (this.leases.size === 0) this.stopKeepAlive();
  }

  // One KeepAlive stream for every lease of this client: all lease ids every ttl/3.
  keepAlive() {
    if (this.stream === null) {
      const stream = this.stub.KeepAlive();
      this.stream = stream;
      stream.on('data', (response) => this.onKeepAlive(response));
      stream.on('error', () => {}); // reported by 'close' below
      stream.on('close', () => {
        if (this.stream === stream) {
          this.stream = null;
          this.loseAll('STREAM_BROKEN');
        }
      });
    }
    this.renew();
    const ttl = Math.min(...[...this.leases.values()].map((a) => a.ttl));
    clearInterval(this.timer);
    this.timer = setInterval(() => this.renew(), (ttl * 1000) / 3);
  }

  renew() {
    const now = Date.now();
    for (const attachment of [...this.leases.values()]) {
      if (now - attachment.lastActive > (attachment.ttl * 1000 * 2) / 3) this.lose(attachment, 'EXPIRED');
    }
    if (this.stream !== null && this.leases.size > 0) this.stream.write({ lease_ids: [...this.leases.keys()] });
  }

  onKeepAlive(response) {
    for (const status of response.leases) {
      const attachment = this.leases.get(status.lease_id);
      if (attachment === undefined) continue;
      if (response.instance_id !== attachment.lease.instance_id) {
        this.lose(attachment, 'INSTANCE_CHANGED');
      } else if (status.state === 'LEASE_STATE_ACTIVE') {
        attachment.lastActive = Date.now();
        attachment.expireTime = toDate(status.expire_time);
        attachment.emit('renewed', attachment.expireTime);
      } else if (status.state === 'LEASE_STATE_REVOKING') {
        const deadline = toDate(status.revoke_deadline);
        attachment.emit('revoking', deadline);
        this.emit('revoking', attachment, deadline);
      } else {
        this.lose(attachment, 'NOT_FOUND');
      }
    }
  }

  lose(attachment, reason) {
    if (!this.leases.delete(attachment.leaseId)) return;
    attachment.lost = reason;
    attachment.emit('lost', reason);
    this.emit('leaseLost', attachment, reason);
    if (this.leases.size === 0) this.stopKeepAlive();
  }

  loseAll(reason) {
    for (const attachment of [...this.leases.values()]) this.lose(attachment, reason);
  }

  stopKeepAlive() {
    clearInterval(this.timer);
    this.timer = null;
    const stream = this.stream;
    this.stream = null;
    stream?.end();
  }

  /** Close the connection. Leases still held end with the KeepAlive stream. */
  close() {
    this.leases.clear();
    this.stopKeepAlive();
    this.stub.close();
  }
}
