// The shared-memory segment checks and the view checks, without a daemon: real files
// under /dev/shm (removed at the end) and AcquireResponse parts as proto-loader decodes
// them (keepCase, longs as Number), crafted to break one rule each.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { after, test } from 'node:test';

import { DTYPES, SHM_DIR, WeightCacheError, buildTensors, readSharedMemory, viewsOf } from '../src/index.mjs';

const euid = process.geteuid();
const made = [];

// A fresh name under /dev/shm, removed by after().
function shmPath(what) {
  const file = path.join(SHM_DIR, `wc-node-test-${process.pid}-${made.length}-${what}`);
  made.push(file);
  return file;
}

after(() => {
  for (const file of made) fs.rmSync(file, { recursive: true, force: true });
});

// An error with reason INVALID_HANDLE whose message matches `pattern`.
const invalidHandle = (pattern) => (err) => {
  assert.ok(err instanceof WeightCacheError, `${err}`);
  assert.equal(err.reason, 'INVALID_HANDLE');
  assert.match(err.message, pattern);
  return true;
};

const bytes = Uint8Array.from({ length: 512 }, (_, i) => (i * 7 + 3) & 0xff);

function segment() {
  const file = shmPath('segment');
  fs.writeFileSync(file, bytes);
  return file;
}

test('a segment is read whole, into a private copy', () => {
  const file = segment();

  const arena = readSharedMemory({ path: file, size: bytes.length }, euid);

  assert.deepEqual(new Uint8Array(arena), bytes);
  new Uint8Array(arena)[0] ^= 0xff;
  assert.deepEqual(new Uint8Array(fs.readFileSync(file)), bytes);
});

test('a segment of another size than the handle says is refused', () => {
  const file = segment();
  for (const size of [bytes.length - 1, bytes.length + 1]) {
    assert.throws(() => readSharedMemory({ path: file, size }, euid), invalidHandle(/512 bytes, the handle says/));
  }
});

test('a handle size that is no positive safe integer is refused before any open', () => {
  const file = segment();
  for (const size of [0, -512, 2 ** 53, 1.5, Number.NaN]) {
    assert.throws(() => readSharedMemory({ path: file, size }, euid), invalidHandle(/not a positive byte count/));
  }
});

test('a segment of another owner than the socket is refused', () => {
  const file = segment();
  assert.throws(
    () => readSharedMemory({ path: file, size: bytes.length }, euid + 1),
    invalidHandle(new RegExp(`owned by uid ${euid}, not the daemon's ${euid + 1}`)),
  );
});

test('a symlink under /dev/shm is refused, even to a good segment', () => {
  const file = segment();
  const link = shmPath('link');
  fs.symlinkSync(file, link);
  assert.throws(() => readSharedMemory({ path: link, size: bytes.length }, euid), invalidHandle(/a symlink/));
});

test('a folder or a FIFO under /dev/shm is not a regular file', () => {
  const folder = shmPath('folder');
  fs.mkdirSync(folder);
  const fifo = shmPath('fifo');
  execFileSync('mkfifo', [fifo]); // opened O_NONBLOCK: must not hang
  for (const file of [folder, fifo]) {
    assert.throws(() => readSharedMemory({ path: file, size: 4096 }, euid), invalidHandle(/not a regular file/));
  }
});

test('a path not directly under /dev/shm is refused before any open', () => {
  const file = segment();
  const name = path.basename(file);
  for (const bad of [
    `/tmp/${name}`,
    `${SHM_DIR}/sub/${name}`,
    `${SHM_DIR}/../${name}`,
    `${SHM_DIR}/.${name}`,
    `${SHM_DIR}/..`,
    `${SHM_DIR}/${name}\0`,
    `${name}`,
    '',
  ]) {
    assert.throws(() => readSharedMemory({ path: bad, size: bytes.length }, euid), invalidHandle(/not a file name directly under/), bad);
  }
});

test('a freed segment fails with ENOENT', () => {
  const gone = shmPath('gone');
  assert.throws(() => readSharedMemory({ path: gone, size: 512 }, euid), (err) => {
    assert.ok(!(err instanceof WeightCacheError));
    assert.equal(err.code, 'ENOENT');
    return true;
  });
});

// A view of the 512-byte arena `bytes`: F32 [2, 3] at 256 unless overridden.
const view = (fields = {}) => ({
  name: 'w',
  dtype: 'F32',
  shape: [2, 3],
  stride: [3, 1],
  byte_offset: 256,
  nbytes: 24,
  ...fields,
});
const arena = () => bytes.slice().buffer;

test('views become typed arrays over the arena, at their offsets', () => {
  const buffer = arena();
  const tensors = buildTensors(buffer, [
    view(),
    view({ name: 'tied', nbytes: 0 }), // nbytes 0: from a daemon older than the field
    view({ name: 'ids', dtype: 'I64', shape: [4], stride: [1], byte_offset: 480, nbytes: 32 }),
    view({ name: 'c', dtype: 'C64', shape: [], stride: [], byte_offset: 0, nbytes: 8 }),
    view({ name: 'empty', shape: [0, 3], stride: [3, 1], byte_offset: 512, nbytes: 0 }),
  ]);

  assert.deepEqual([...tensors.keys()], ['w', 'tied', 'ids', 'c', 'empty']);
  const w = tensors.get('w');
  assert.ok(w.data instanceof Float32Array);
  assert.equal(w.data.buffer, buffer); // a view, not a copy
  assert.equal(w.data.byteOffset, 256);
  assert.equal(w.data.length, 6);
  assert.deepEqual(w.bytes, bytes.subarray(256, 280));
  assert.equal(tensors.get('tied').data.byteOffset, 256);
  assert.deepEqual(tensors.get('ids').data, new BigInt64Array(bytes.slice(480, 512).buffer));
  assert.equal(tensors.get('c').data.length, 2); // (real, imaginary)
  assert.equal(tensors.get('empty').data.length, 0);
});

test('an unknown dtype is refused, Object.prototype names included', () => {
  for (const dtype of ['F4', 'f32', 'constructor', '__proto__', 'toString', 'hasOwnProperty', '', undefined]) {
    assert.equal(DTYPES[dtype], undefined, String(dtype));
    assert.throws(() => buildTensors(arena(), [view({ dtype })]), invalidHandle(/unknown dtype/), String(dtype));
  }
});

test('a view past the end of the arena is refused, by a byte or by 2^53 and more', () => {
  const cases = [
    view({ shape: [65], stride: [1], nbytes: 260 }), // 256 + 260 = 516 > 512
    view({ byte_offset: 512 - 20 }), // 24 bytes from 492
    view({ shape: [0], stride: [1], byte_offset: 516, nbytes: 0 }), // empty, but past the end
    view({ byte_offset: 2 ** 53 - 8 }), // still a safe integer: BigInt keeps the sum exact
    view({ dtype: 'U8', shape: [2 ** 40, 2 ** 30], stride: [2 ** 30, 1], nbytes: 0 }), // 2^70 bytes
  ];
  for (const v of cases) {
    assert.throws(() => buildTensors(arena(), [v]), invalidHandle(/reaches past the 512-byte arena/), JSON.stringify(v));
  }
});

test('offsets, sizes, shapes and strides that are no safe non-negative integers are refused', () => {
  const cases = [
    [view({ byte_offset: -256 }), /byte_offset -256 is not a byte offset/],
    [view({ byte_offset: 2 ** 64 }), /is not a byte offset/], // a uint64 as longs: Number rounds it
    [view({ byte_offset: 258 }), /misaligned byte_offset 258/],
    [view({ nbytes: 25 }), /nbytes 25 is not its shape \[2,3\] times the 4-byte size of F32/],
    [view({ nbytes: -24 }), /nbytes -24/],
    [view({ nbytes: 2 ** 64 }), /nbytes/],
    [view({ shape: [2, -3] }), /disagree/],
    [view({ shape: [2 ** 53, 1] }), /disagree/],
    [view({ shape: [1, 6], stride: [-1, 1] }), /disagree/],
    [view({ stride: [3] }), /disagree/],
    [view({ stride: [1, 2] }), /not row-major contiguous/],
  ];
  for (const [v, pattern] of cases) {
    assert.throws(() => buildTensors(arena(), [v]), invalidHandle(pattern), JSON.stringify(v));
  }
});

test('a tensor table becomes the same views as TensorView messages', () => {
  const table = {
    names: ['a', 'b', 'scalar'],
    dtypes: ['F32', 'BF16'],
    dtype_index: [0, 1, 0],
    ranks: [2, 1, 0],
    shape: [2, 3, 4],
    stride: [3, 1, 1],
    byte_offsets: [0, 256, 384],
    nbytes: [24, 8, 4],
  };

  const views = viewsOf({ tensor_table: table, tensors: [] });

  assert.deepEqual(views, [
    { name: 'a', dtype: 'F32', shape: [2, 3], stride: [3, 1], byte_offset: 0, nbytes: 24 },
    { name: 'b', dtype: 'BF16', shape: [4], stride: [1], byte_offset: 256, nbytes: 8 },
    { name: 'scalar', dtype: 'F32', shape: [], stride: [], byte_offset: 384, nbytes: 4 },
  ]);
  const tensors = buildTensors(arena(), views);
  assert.deepEqual(tensors.get('b').data, new Uint16Array(bytes.slice(256, 264).buffer));
  // From a daemon older than nbytes: the column is empty, each view's nbytes 0.
  assert.deepEqual(viewsOf({ tensor_table: { ...table, nbytes: [] } }).map((v) => v.nbytes), [0, 0, 0]);
  const plain = [view()];
  assert.equal(viewsOf({ tensor_table: null, tensors: plain }), plain);
});

test('a tensor table whose columns do not fit together is refused', () => {
  const table = {
    names: ['a'],
    dtypes: ['F32'],
    dtype_index: [0],
    ranks: [1],
    shape: [6],
    stride: [1],
    byte_offsets: [0],
    nbytes: [24],
  };
  const cases = [
    [{ dtype_index: [1] }, /a dtype_index is past the 1 dtypes/],
    [{ byte_offsets: [0, 256] }, /the per-tensor columns differ in length/],
    [{ nbytes: [24, 24] }, /the per-tensor columns differ in length/],
    [{ ranks: [2] }, /shape and stride do not hold sum\(ranks\) entries/],
    [{ stride: [] }, /shape and stride do not hold sum\(ranks\) entries/],
  ];
  for (const [fields, pattern] of cases) {
    assert.throws(() => viewsOf({ tensor_table: { ...table, ...fields } }), invalidHandle(pattern), JSON.stringify(fields));
  }
});
