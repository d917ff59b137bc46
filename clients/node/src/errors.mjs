// Errors of the Node client, each with a `.reason`: the daemon's ErrorInfo.reason when the
// daemon refused (docs/protocol.md, "Error model"), or one of the client's own reasons.

import path from 'node:path';

import protobuf from 'protobufjs';

export const ERROR_DOMAIN = 'weightcache.v1';

/** Client-side reasons, as the Python SDK names them (core/errors.py). */
export const CLIENT_REASONS = Object.freeze({
  DAEMON_UNAVAILABLE: 'DAEMON_UNAVAILABLE',
  LEASE_LOST: 'LEASE_LOST',
  UNTRUSTED_SOCKET: 'UNTRUSTED_SOCKET',
  INVALID_HANDLE: 'INVALID_HANDLE',
});

/**
 * A refusal or failure with a reason code.
 *
 * @property {string} reason the ErrorInfo reason ("FINGERPRINT_MISMATCH", ...), a client
 *   reason (CLIENT_REASONS), or "UNKNOWN" for a gRPC status that carried no ErrorInfo.
 * @property {number|undefined} code the gRPC status code (grpc.status), when from an RPC.
 * @property {Record<string, string>} metadata ErrorInfo.metadata.
 * @property {string} domain ErrorInfo.domain ("weightcache.v1" for the daemon's refusals).
 */
export class WeightCacheError extends Error {
  constructor(message, { reason, code, metadata = {}, domain = '', cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'WeightCacheError';
    this.reason = reason;
    this.code = code;
    this.metadata = metadata;
    this.domain = domain;
  }
}

let statusTypes;

// google.rpc.Status and ErrorInfo from the vendored protos (protos/google/rpc/).
function loadStatusTypes(protoPath) {
  if (statusTypes === undefined) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) =>
      path.isAbsolute(target) ? target : path.join(protoPath, target);
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
    statusTypes = {
      Status: root.lookupType('google.rpc.Status'),
      ErrorInfo: root.lookupType('google.rpc.ErrorInfo'),
    };
  }
  return statusTypes;
}

/**
 * The WeightCacheError for a failed gRPC call: decodes the `grpc-status-details-bin`
 * trailer (a google.rpc.Status) and takes its ErrorInfo's reason. A status without
 * details came from gRPC itself: UNAVAILABLE and DEADLINE_EXCEEDED then read as
 * DAEMON_UNAVAILABLE (as in the Python SDK), anything else as "UNKNOWN".
 *
 * @param {Error & {code?: number, details?: string, metadata?: import('@grpc/grpc-js').Metadata}} err
 * @param {string} protoPath the include folder holding google/rpc/*.proto.
 * @returns {WeightCacheError}
 */
export function fromRpcError(err, protoPath) {
  const raw = err.metadata?.get('grpc-status-details-bin')?.[0];
  if (raw !== undefined) {
    const { Status, ErrorInfo } = loadStatusTypes(protoPath);
    const status = Status.decode(Buffer.isBuffer(raw) ? raw : Buffer.from(raw));
    for (const any of status.details) {
      if (any.type_url.endsWith('/google.rpc.ErrorInfo')) {
        const info = ErrorInfo.decode(any.value);
        return new WeightCacheError(status.message || err.details, {
          reason: info.reason,
          code: err.code,
          metadata: { ...info.metadata },
          domain: info.domain,
          cause: err,
        });
      }
    }
  }
  // 14 UNAVAILABLE, 4 DEADLINE_EXCEEDED.
  const unavailable = err.code === 14 || err.code === 4;
  return new WeightCacheError(err.details ?? err.message, {
    reason: unavailable ? CLIENT_REASONS.DAEMON_UNAVAILABLE : 'UNKNOWN',
    code: err.code,
    cause: err,
  });
}
