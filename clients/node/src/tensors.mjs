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
 * (real, imaginary) Float32 pairs; BOOL is one byte per element, 0 or 1. The sizes are
 * the Python SDK's (weightcache.core.dtypes); test/client.test.mjs compares them. A
 * null-prototype object: a dtype named "constructor" or "__proto__" is unknown, not an
 * Object.prototype member.
 */
export const DTYPES = Object.freeze(Object.assign(Object.create(null), {
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
}));

const invalid = (message) =>
  new WeightCacheError(message, { reason: CLIENT_REASONS.INVALID_HANDLE });

// A size, offset or count as proto-loader decodes an int64 (longs: Number): one past 2^53
// arrives rounded, so anything that is not a safe integer is refused rather than trusted.
const isCount = (value) => Number.isSafeInteger(value) && value >= 0;

/**
 * Read a SharedMemoryHandle's segment, after the checks the Python SDK makes
 * (_handles.open_shared_memory): directly under /dev/shm, opened without following a
 * symlink, a regular file owned by the daemon's uid, exactly `size` bytes long.
 *
 * @param {{path: string, size: number}} handle
 * @param {number} ownerUid the uid owning the daemon's socket.
 * @returns {ArrayBuffer} `size` bytes, a private copy of the segment.
 * @throws {WeightCacheError} INVALID_HANDLE: the path is not a file name directly under
 *   /dev/shm or is a symlink, the file is not a regular file, belongs to another uid than
 *   `ownerUid` or is not exactly `size` bytes, `size` is not a positive safe integer, or
 *   the segment is larger than an ArrayBuffer may be.
 * @throws {Error} the open or read fails otherwise (ENOENT when the model was freed
 *   meanwhile).
 */
export function readSharedMemory(handle, ownerUid) {
  const file = handle.path;
  if (
    typeof file !== 'string' ||
    file.includes('\0') ||
    path.dirname(file) !== SHM_DIR ||
    path.basename(file).startsWith('.')
  ) {
    throw invalid(`${JSON.stringify(file)}: not a file name directly under ${SHM_DIR}`);
  }
  if (!isCount(handle.size) || handle.size === 0) {
    throw invalid(`${file}: the handle's size ${handle.size} is not a positive byte count`);
  }
  const { O_RDONLY, O_NOFOLLOW, O_NONBLOCK } = fs.constants;
  let fd;
  try {
    // O_NONBLOCK: opening a FIFO planted at the path must not block; the type is checked
    // right after. O_NOFOLLOW: a symlink fails with ELOOP.
    fd = fs.openSync(file, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  } catch (err) {
    if (err.code === 'ELOOP') throw invalid(`${file}: a symlink; refusing it`);
    throw err;
  }
  try {
    const info = fs.fstatSync(fd);
    if (!info.isFile()) throw invalid(`${file}: not a regular file`);
    if (info.uid !== ownerUid) {
      throw invalid(`${file}: owned by uid ${info.uid}, not the daemon's ${ownerUid}`);
    }
    if (info.size !== handle.size) {
      throw invalid(`${file}: ${info.size} bytes, the handle says ${handle.size}`);
    }
    let buffer;
    try {
      buffer = new ArrayBuffer(handle.size);
    } catch (err) {
      throw invalid(`${file}: ${handle.size} bytes do not fit an ArrayBuffer: ${err.message}`);
    }
    const bytes = new Uint8Array(buffer);
    const chunk = 1 << 30; // readSync reads at most 2 GiB - 1 at once
    for (let done = 0; done < handle.size; ) {
      const got = fs.readSync(fd, bytes, done, Math.min(chunk, handle.size - done), done);
      if (got === 0) throw invalid(`${file}: shorter than ${handle.size} bytes`);
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
 * @throws {WeightCacheError} INVALID_HANDLE: an unknown dtype; a shape or stride that is
 *   not a list of non-negative safe integers of one length; a view with elements that is
 *   not row-major contiguous; a byte_offset that is not a non-negative safe integer or
 *   not a multiple of the dtype's size; a non-zero nbytes other than the elements times
 *   the dtype's size; a view whose byte_offset plus its size passes the arena's end.
 */
export function buildTensors(arena, views) {
  const tensors = new Map();
  const end = BigInt(arena.byteLength);
  for (const view of views) {
    const { name, dtype, shape } = view;
    const { Typed, lanes, numel, offset, size } = checkView(view, end);
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

// The checks of one view against an arena of `end` bytes. Sizes are multiplied as BigInt:
// a product of safe integers can pass 2^53 (rounded) or reach Infinity (and Infinity
// times a 0 dimension is NaN, which every comparison lets through).
function checkView(view, end) {
  const { name, dtype, shape, stride } = view;
  const label = `tensor ${JSON.stringify(name)}`;
  if (typeof dtype !== 'string' || !Object.hasOwn(DTYPES, dtype)) {
    throw invalid(`${label}: unknown dtype ${JSON.stringify(dtype)}`);
  }
  const [itemsize, Typed, lanes] = DTYPES[dtype];
  if (
    !Array.isArray(shape) ||
    !Array.isArray(stride) ||
    shape.length !== stride.length ||
    !shape.every(isCount) ||
    !stride.every(isCount)
  ) {
    throw invalid(`${label}: shape [${shape}] and stride [${stride}] disagree`);
  }
  const numel = shape.reduce((n, s) => n * BigInt(s), 1n);
  // An empty view has no element to misplace: its strides do not matter.
  for (let d = shape.length - 1, expect = 1n; numel > 0n && d >= 0; d -= 1) {
    if (shape[d] > 1 && BigInt(stride[d]) !== expect) {
      throw invalid(`${label}: not row-major contiguous (shape [${shape}], stride [${stride}])`);
    }
    expect *= BigInt(shape[d]);
  }
  const size = numel * BigInt(itemsize);
  const offset = view.byte_offset;
  if (!isCount(offset)) throw invalid(`${label}: byte_offset ${offset} is not a byte offset`);
  if (offset % itemsize !== 0) throw invalid(`${label}: misaligned byte_offset ${offset}`);
  const nbytes = view.nbytes ?? 0;
  if (!isCount(nbytes) || (nbytes !== 0 && BigInt(nbytes) !== size)) {
    throw invalid(
      `${label}: nbytes ${nbytes} is not its shape [${shape}] times the ${itemsize}-byte size of ${dtype}`,
    );
  }
  if (BigInt(offset) + size > end) {
    throw invalid(`${label}: reaches past the ${end}-byte arena`);
  }
  // Within the arena from here: both below 2^53.
  return { Typed, lanes, numel: Number(numel), offset, size: Number(size) };
}
