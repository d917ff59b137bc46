// The weightcache fingerprint (format weightcache.fingerprint/2), from docs/fingerprint.md.
//
// Written from the spec alone, with no weightcache code: the Python implementation and
// this one are checked against the same test vectors (tests/vectors/check.mjs runs this
// module over tests/vectors/vectors.json; clients/node/test/fingerprint.test.mjs too).
// Node built-ins only.

import { createHash } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';

export const FORMAT = 'weightcache.fingerprint/2';

// ---------------------------------------------------------------------------------------
// JCS (RFC 8785), reduced to what the spec says is hashed: objects, arrays, strings,
// non-negative integers below 2^53 and null.

export function jcs(value) {
  if (value === null) return 'null';
  if (typeof value === 'string') {
    // JSON.stringify escapes exactly as RFC 8785 §3.2.2.2 requires: '"' and '\', the
    // short forms \b \t \n \f \r, other controls as \u00xx (lowercase hex), everything
    // else as itself. (Lone surrogates cannot occur: names are valid Unicode.)
    return JSON.stringify(value);
  }
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value) || value < 0) throw new Error(`not a JCS-able integer: ${value}`);
    return String(value);
  }
  if (Array.isArray(value)) return '[' + value.map(jcs).join(',') + ']';
  if (typeof value === 'object') {
    // Members sorted by name as arrays of UTF-16 code units (RFC 8785 §3.2.3). JS string
    // comparison with < compares UTF-16 code units, which is exactly that; it is NOT
    // code-point order: "😀" (D83D DE00) sorts before "ｍ" (FF4D) here, though U+1F600 >
    // U+FF4D. Do not use localeCompare.
    const keys = Object.keys(value).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    return '{' + keys.map((k) => JSON.stringify(k) + ':' + jcs(value[k])).join(',') + '}';
  }
  throw new Error(`not a JCS-able value: ${typeof value}`);
}

export const sha256hex = (data) => createHash('sha256').update(data).digest('hex');
// JCS output is UTF-8 bytes; Buffer.from(string) encodes UTF-8.
export const digestOf = (value) => sha256hex(Buffer.from(jcs(value), 'utf8'));

// ---------------------------------------------------------------------------------------
// Safetensors header.

// Reads the 8-byte little-endian length N and the N raw header bytes (padding included).
function readHeader(fd) {
  const lenBuf = Buffer.alloc(8);
  if (fs.readSync(fd, lenBuf, 0, 8, 0) !== 8) throw new Error('file shorter than 8 bytes');
  const n = lenBuf.readBigUInt64LE(0);
  if (n > BigInt(Number.MAX_SAFE_INTEGER)) throw new Error('header length too large');
  const N = Number(n);
  const raw = Buffer.alloc(N);
  if (fs.readSync(fd, raw, 0, N, 8) !== N) throw new Error('header truncated');
  return { N, raw };
}

// Top-level member names of a JSON object, in the order the TEXT lists them.
// JSON.parse cannot be used for the order: ECMAScript objects put integer-like names
// ("7", "10") first in ascending numeric order, whatever the text says. So scan the text:
// track nesting depth and strings; at depth 1, a string followed by ':' is a member name.
// Each name is decoded with JSON.parse on its own quoted text (handles \" \\ \uXXXX...).
function topLevelKeys(text) {
  const keys = [];
  let depth = 0;
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === '"') {
      const start = i;
      i++;
      while (text[i] !== '"') i += text[i] === '\\' ? 2 : 1; // skip escaped chars
      i++; // past the closing quote
      if (depth === 1) {
        let j = i;
        while (/\s/.test(text[j])) j++;
        if (text[j] === ':') keys.push(JSON.parse(text.slice(start, i)));
      }
      continue;
    }
    if (c === '{' || c === '[') depth++;
    else if (c === '}' || c === ']') depth--;
    i++;
  }
  return keys;
}

// content_sha256 (level "sampled"): one sha256 over, per tensor in header-text order
// (__metadata__ excluded), the tensor's name in UTF-8 then samples of its bytes: all of
// them when nbytes <= 192 (none when empty), else 64 bytes at b, at b + floor((nbytes-64)/2)
// and at b + nbytes - 64, with b = 8 + N + data_offsets[0] (offsets are relative to the
// end of the header, so the 8 length bytes and the N header bytes are added).
// Nothing separates the pieces.
function contentSha256(fd, N, headerText) {
  const header = JSON.parse(headerText); // values only; order comes from topLevelKeys
  const h = createHash('sha256');
  const read = (pos, len) => {
    const buf = Buffer.alloc(len);
    if (fs.readSync(fd, buf, 0, len, pos) !== len) throw new Error('tensor data truncated');
    return buf;
  };
  for (const name of topLevelKeys(headerText)) {
    if (name === '__metadata__') continue;
    const [begin, end] = header[name].data_offsets;
    const nbytes = end - begin;
    const b = 8 + N + begin;
    h.update(Buffer.from(name, 'utf8'));
    if (nbytes <= 192) {
      if (nbytes > 0) h.update(read(b, nbytes));
    } else {
      h.update(read(b, 64));
      h.update(read(b + Math.floor((nbytes - 64) / 2), 64));
      h.update(read(b + nbytes - 64, 64));
    }
  }
  return h.digest('hex');
}

// file_sha256 (level "full"): every byte of the file. (A hub blob's file name looks like a
// sha256 but is only the uploader's claim; it is never used in place of reading.)
function fileSha256(file) {
  const h = createHash('sha256');
  const fd = fs.openSync(file, 'r');
  try {
    const buf = Buffer.alloc(1 << 20);
    let pos = 0;
    for (;;) {
      const got = fs.readSync(fd, buf, 0, buf.length, pos);
      if (got === 0) break;
      h.update(buf.subarray(0, got));
      pos += got;
    }
  } finally {
    fs.closeSync(fd);
  }
  return h.digest('hex');
}

// ---------------------------------------------------------------------------------------
// Checkpoint and components.

// Shard names of a checkpoint: the index's weight_map values, or model.safetensors, or
// the file itself. Sorted by the byte order of their UTF-8 names (= code-point order,
// which differs from JS's UTF-16 order for astral characters, hence Buffer.compare).
export function shardsOf(ckpt) {
  let dir, names;
  if (fs.statSync(ckpt).isFile()) {
    dir = path.dirname(ckpt);
    names = [path.basename(ckpt)];
  } else {
    dir = ckpt;
    const index = path.join(ckpt, 'model.safetensors.index.json');
    if (fs.existsSync(index)) {
      const weightMap = JSON.parse(fs.readFileSync(index, 'utf8')).weight_map;
      names = [...new Set(Object.values(weightMap))];
    } else {
      names = ['model.safetensors'];
    }
  }
  names.sort((a, b) => Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8')));
  return names.map((name) => ({ name, file: path.join(dir, name) }));
}

// One shard's component value. Paths are opened and stat'ed through symlinks (a hub
// snapshot's files link into blobs/); the name stays the link's name, not the blob's.
function shardValue(name, file, level) {
  const value = { name, size: fs.statSync(file).size };
  const fd = fs.openSync(file, 'r');
  try {
    const { N, raw } = readHeader(fd);
    value.header_sha256 = sha256hex(raw);
    if (level === 'sampled') value.content_sha256 = contentSha256(fd, N, raw.toString('utf8'));
  } finally {
    fs.closeSync(fd);
  }
  if (level === 'full') value.file_sha256 = fileSha256(file);
  return value;
}

// The recipe value from a vector's recipe input {dtype, tp_plan, plugins}. The vectors
// give the tp_plan already resolved to [pattern, style] pairs; it is null at tp_size 1.
export function recipeValue(recipe, placement) {
  return {
    name: 'weightcache.recipe',
    version: 2,
    dtype: recipe.dtype ?? null,
    tp_plan: placement.tp_size === 1 || recipe.tp_plan == null
      ? null
      : recipe.tp_plan.map(([pattern, style]) => [pattern, style]),
    plugins: (recipe.plugins ?? []).map((p) => ({
      name: p.name,
      version: p.version,
      params: (p.params ?? []).map(([k, v]) => [k, v]),
    })),
  };
}

// Every component value of one vector, keyed by component name.
export function componentValues(ckpt, level, recipe, placement) {
  const values = { format: { format: FORMAT, level } };
  const layout = [];
  for (const { name, file } of shardsOf(ckpt)) {
    const v = shardValue(name, file, level);
    layout.push({ name: v.name, size: v.size, header_sha256: v.header_sha256 });
    values[`checkpoint/${name}`] = v;
  }
  values.layout = layout;
  values.recipe = recipeValue(recipe, placement);
  values.placement = { tp_rank: placement.tp_rank, tp_size: placement.tp_size };
  return values;
}

// Component names sorted as the daemon sorts them (Python's sorted(): code points, which
// the byte order of UTF-8 keeps).
const byCodePoint = (a, b) => Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8'));

export const LEVELS = ['layout', 'sampled', 'full'];

/**
 * The fingerprint of a checkpoint as a worker sends it in AcquireRequest.fingerprint.
 *
 * @param {string} checkpoint a checkpoint folder (model.safetensors, or an index and its
 *   shards) or a single .safetensors file.
 * @param {object} [options]
 * @param {'layout'|'sampled'|'full'} [options.level='full'] content level; must be the
 *   daemon's (Model.fingerprint.level tells it).
 * @param {{dtype?: string|null, tp_plan?: Array<[string, string]>|null,
 *   plugins?: Array<{name: string, version: string, params?: Array<[string, string]>}>}}
 *   [options.recipe] the recipe; tp_plan already resolved to [pattern, style] pairs.
 * @param {{tp_rank: number, tp_size: number}} [options.placement={tp_rank: 0, tp_size: 1}]
 * @returns {{digest: string, level: string,
 *   components: Array<{name: string, digest: string}>}} lowercase hex sha256 digests;
 *   components sorted by name.
 * @throws {Error} a file is missing or not a safetensors file, or the level is unknown.
 */
export function computeFingerprint(checkpoint, options = {}) {
  const level = options.level ?? 'full';
  if (!LEVELS.includes(level)) throw new Error(`unknown fingerprint level: ${level}`);
  const placement = options.placement ?? { tp_rank: 0, tp_size: 1 };
  const values = componentValues(checkpoint, level, options.recipe ?? {}, placement);
  const digests = {};
  for (const [name, value] of Object.entries(values)) digests[name] = digestOf(value);
  return {
    digest: digestOf(digests),
    level,
    components: Object.keys(digests)
      .sort(byCodePoint)
      .map((name) => ({ name, digest: digests[name] })),
  };
}
