// A model's arena as tensors: read the shared-memory segment, then one typed array per
// TensorView (docs/protocol.md, "Storage handles" and "TensorView").
//
// Node has no mmap: the segment is read once into an ArrayBuffer (a private copy, so a
// worker's writes stay its own, as MAP_PRIVATE would give) and every tensor is a typed
// array over that buffer, without a further copy. The copy costs the model's size in
// memory and one read of it; a worker that needs the pages shared uses a native mmap addon.

import fs from 'node:fs';
import path from 'node:path';

import { CLIENT_REASONS, WeightCacheError } from './errors.mjs';

export const SHM_DIR = '/dev/shm';

/**
 * safetensors dtype name -> [element size in bytes, TypedArray constructor, lanes per
 * element]. JavaScript has no bfloat16, float16 (before Node 22's Float16Array) or fp8
 * arrays: those are their raw bits (Uint16Array / Uint8Array); C64 is interleaved
 * (real, imaginary) Float32 pairs; BOOL is one byte per element, 0 or 1.
 */
export const DTYPES = Object.freeze({
  BOOL: [1, Uint8Array, 1],
  U8: [1, Uint8Array, 1],
  I8: [1, Int8Array, 1],
  U16: [2, Uint16Array, 1],
  I16: [2, Int16Array, 1],
  U32: [4, Uint32Array, 1],
  I32: [4, Int32Array, 1],
  U64: [8, BigUint64Array, 1],
  I64: [8, BigInt64Array, 1],
  F8_E4M3: [1, Uint8Array, 1],
  F8_E5M2: [1, Uint8Array, 1],
  F8_E4M3FNUZ: [1, Uint8Array, 1],
  F8_E5M2FNUZ: [1, Uint8Array, 1],
  F8_E8M0: [1, Uint8Array, 1],
  BF16: [2, Uint16Array, 1],
  F16: [2, Uint16Array, 1],
  F32: [4, Float32Array, 1],
  F64: [8, Float64Array, 1],
  C64: [8, Float32Array, 2],
});

const invalid = (message) =>
  new WeightCacheError(message, { reason: CLIENT_REASONS.INVALID_HANDLE });

/**
 * Read a SharedMemoryHandle's segment, after the checks the Python SDK makes
 * (_handles.open_shared_memory): directly under /dev/shm, opened without following a
 * symlink, a regular file owned by the daemon's uid, exactly `size` bytes long.
 *
 * @param {{path: string, size: number}} handle
 * @param {number} ownerUid the uid owning the daemon's socket.
 * @returns {ArrayBuffer} `size` bytes, a private copy of the segment.
 * @throws {WeightCacheError} INVALID_HANDLE: any check fails, or the segment is larger
 *   than an ArrayBuffer may be.
 * @throws {Error} the open or read fails (ENOENT when the model was freed meanwhile).
 */
export function readSharedMemory(handle, ownerUid) {
  if (path.dirname(handle.path) !== SHM_DIR || path.basename(handle.path).startsWith('.')) {
    throw invalid(`${handle.path}: not directly under ${SHM_DIR}`);
  }
  const { O_RDONLY, O_NOFOLLOW, O_NONBLOCK } = fs.constants;
  const fd = fs.openSync(handle.path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  try {
    const info = fs.fstatSync(fd);
    if (!info.isFile()) throw invalid(`${handle.path}: not a regular file`);
    if (info.uid !== ownerUid) {
      throw invalid(`${handle.path}: owned by uid ${info.uid}, not the daemon's ${ownerUid}`);
    }
    if (info.size !== handle.size) {
      throw invalid(`${handle.path}: ${info.size} bytes, the handle says ${handle.size}`);
    }
    let buffer;
    try {
      buffer = new ArrayBuffer(handle.size);
    } catch (err) {
      throw invalid(`${handle.path}: ${handle.size} bytes do not fit an ArrayBuffer: ${err.message}`);
    }
    const bytes = new Uint8Array(buffer);
    const chunk = 1 << 30; // readSync reads at most 2 GiB - 1 at once
    for (let done = 0; done < handle.size; ) {
      const got = fs.readSync(fd, bytes, done, Math.min(chunk, handle.size - done), done);
      if (got === 0) throw invalid(`${handle.path}: shorter than ${handle.size} bytes`);
      done += got;
    }
    return buffer;
  } finally {
    fs.closeSync(fd);
  }
}

/**
 * The tensor views of an AcquireResponse (decoded with keepCase, longs as Number), from
 * its tensor_table when set, else from its tensors.
 *
 * @returns {Array<{name: string, dtype: string, shape: number[], stride: number[],
 *   byte_offset: number, nbytes: number}>}
 * @throws {WeightCacheError} INVALID_HANDLE: the table's columns do not fit together.
 */
export function viewsOf(reply) {
  const table = reply.tensor_table;
  if (table === null || table === undefined) return reply.tensors;
  const { names, dtypes, dtype_index: index, ranks, shape, stride, byte_offsets: offsets } = table;
  const nbytes = table.nbytes.length ? table.nbytes : names.map(() => 0);
  const n = names.length;
  if (![index, ranks, offsets, nbytes].every((column) => column.length === n)) {
    throw invalid('tensor table: the per-tensor columns differ in length');
  }
  const total = ranks.reduce((a, b) => a + b, 0);
  if (shape.length !== total || stride.length !== total) {
    throw invalid('tensor table: shape and stride do not hold sum(ranks) entries');
  }
  const views = [];
  for (let i = 0, r = 0; i < n; r += ranks[i], i += 1) {
    if (index[i] >= dtypes.length) throw invalid(`tensor table: a dtype_index is past the ${dtypes.length} dtypes`);
    views.push({
      name: names[i],
      dtype: dtypes[index[i]],
      shape: shape.slice(r, r + ranks[i]),
      stride: stride.slice(r, r + ranks[i]),
      byte_offset: offsets[i],
      nbytes: nbytes[i],
    });
  }
  return views;
}

/**
 * One tensor per view over the arena.
 *
 * @param {ArrayBuffer} arena
 * @param {ReturnType<typeof viewsOf>} views
 * @returns {Map<string, {name: string, dtype: string, shape: number[], byteOffset: number,
 *   nbytes: number, data: ArrayBufferView, bytes: Uint8Array}>} by name, in the views'
 *   order; `data` is the typed array (DTYPES), `bytes` the same memory as bytes.
 * @throws {WeightCacheError} INVALID_HANDLE: an unknown dtype, a view that is not
 *   row-major contiguous, a misaligned offset, nbytes that disagrees with shape and dtype,
 *   or a view past the end of the arena.
 */
export function buildTensors(arena, views) {
  const tensors = new Map();
  for (const view of views) {
    const { name, dtype, shape, stride } = view;
    const entry = DTYPES[dtype];
    if (entry === undefined) throw invalid(`tensor ${JSON.stringify(name)}: unknown dtype ${dtype}`);
    const [itemsize, Typed, lanes] = entry;
    if (shape.length !== stride.length || shape.some((s) => s < 0)) {
      throw invalid(`tensor ${JSON.stringify(name)}: shape ${shape} and stride ${stride} disagree`);
    }
    let expect = 1;
    for (let d = shape.length - 1; d >= 0; d -= 1) {
      if (shape[d] > 1 && stride[d] !== expect) {
        throw invalid(`tensor ${JSON.stringify(name)}: not row-major contiguous (stride ${stride})`);
      }
      expect *= shape[d];
    }
    const numel = shape.reduce((a, b) => a * b, 1);
    const size = numel * itemsize;
    const offset = view.byte_offset;
    if (offset % itemsize !== 0) throw invalid(`tensor ${JSON.stringify(name)}: misaligned byte_offset ${offset}`);
    if (view.nbytes && view.nbytes !== size) {
      throw invalid(`tensor ${JSON.stringify(name)}: nbytes ${view.nbytes} is not its shape [${shape}] times the ${itemsize}-byte size of ${dtype}`);
    }
    if (offset < 0 || offset + size > arena.byteLength) {
      throw invalid(`tensor ${JSON.stringify(name)}: reaches past the ${arena.byteLength}-byte arena`);
    }
    tensors.set(name, {
      name,
      dtype,
      shape,
      byteOffset: offset,
      nbytes: size,
      data: new Typed(arena, offset, numel * lanes),
      bytes: new Uint8Array(arena, offset, size),
    });
  }
  return tensors;
}
