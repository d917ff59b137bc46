// The weightcache Node reference client (clients/node/README.md).
export { Attachment, DEFAULT_PROTO_PATH, MAX_RESPONSE_BYTES, WeightCacheClient } from './client.mjs';
export { CLIENT_REASONS, ERROR_DOMAIN, WeightCacheError, fromRpcError } from './errors.mjs';
export { FORMAT, LEVELS, computeFingerprint } from './fingerprint.mjs';
export { checkSocket, defaultSocket, runtimeDir, trustedUids } from './socket.mjs';
export { DTYPES, SHM_DIR, buildTensors, readSharedMemory, viewsOf } from './tensors.mjs';
