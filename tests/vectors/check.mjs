// Independent check of the fingerprint test vectors (format weightcache.fingerprint/2).
//
// Written from docs/fingerprint.md alone, with no weightcache code: for every vector in
// vectors.json it opens the checkpoint, recomputes every component value, serializes it
// with its own RFC 8785 (JCS) serializer, hashes it, and compares the JCS text, the
// component digests and the final digest with the vector.
//
//   node tests/vectors/check.mjs [VECTORS_JSON]
//
// Prints one line per vector and "N vectors, M failed"; exits 0 only if all pass and N > 0.
// Node built-ins only.

import { createHash } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const FORMAT = 'weightcache.fingerprint/2';

// ---------------------------------------------------------------------------------------
// JCS (RFC 8785), reduced to what the spec says is hashed: objects, arrays, strings,
// non-negative integers below 2^53 and null.

function jcs(value) {
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

const sha256hex = (data) => createHash('sha256').update(data).digest('hex');
// JCS output is UTF-8 bytes; Buffer.from(string) encodes UTF-8.
const digestOf = (value) => sha256hex(Buffer.from(jcs(value), 'utf8'));

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
function shardsOf(ckpt) {
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
function recipeValue(recipe, placement) {
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
function componentValues(ckpt, level, recipe, placement) {
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

// ---------------------------------------------------------------------------------------
// Main.

function checkVector(vec, baseDir) {
  const problems = [];
  const level = vec.level ?? 'full';
  const values = componentValues(path.join(baseDir, vec.path), level, vec.recipe, vec.placement);
  const components = {};
  for (const [name, value] of Object.entries(values)) {
    const text = jcs(value);
    components[name] = sha256hex(Buffer.from(text, 'utf8'));
    const want = vec.components[name];
    if (!want) { problems.push(`extra component ${name}`); continue; }
    if (want.jcs !== text) problems.push(`${name} jcs: got ${text} want ${want.jcs}`);
    if (want.digest !== components[name]) problems.push(`${name} digest`);
  }
  for (const name of Object.keys(vec.components)) {
    if (!(name in values)) problems.push(`missing component ${name}`);
  }
  const digest = digestOf(components);
  if (digest !== vec.digest) problems.push(`digest: got ${digest} want ${vec.digest}`);
  return problems;
}

const here = path.dirname(fileURLToPath(import.meta.url));
const vectorsFile = path.resolve(process.argv[2] ?? path.join(here, 'vectors.json'));
const doc = JSON.parse(fs.readFileSync(vectorsFile, 'utf8'));
const baseDir = path.dirname(vectorsFile);
let failed = 0;
if (doc.format !== FORMAT) {
  console.log(`FAIL vectors file format ${doc.format}, expected ${FORMAT}`);
  failed++;
}
const vectors = doc.vectors ?? [];
for (const vec of vectors) {
  const label = `${vec.case} ${vec.level}`;
  let problems;
  try {
    problems = checkVector(vec, baseDir);
  } catch (err) {
    problems = [`error: ${err.message}`];
  }
  if (problems.length === 0) console.log(`ok ${label}`);
  else { failed++; console.log(`FAIL ${label}: ${problems.join('; ')}`); }
}
console.log(`${vectors.length} vectors, ${failed} failed`);
process.exit(failed === 0 && vectors.length > 0 ? 0 : 1);
