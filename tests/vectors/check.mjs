// Check of the fingerprint test vectors (format weightcache.fingerprint/2) by the Node
// reference client's implementation (clients/node/src/fingerprint.mjs), which was written
// from docs/fingerprint.md alone, with no weightcache code: for every vector in
// vectors.json it opens the checkpoint, recomputes every component value, serializes it
// with its own RFC 8785 (JCS) serializer, hashes it, and compares the JCS text, the
// component digests and the final digest with the vector.
//
//   node tests/vectors/check.mjs [VECTORS_JSON]
//
// Prints one line per vector and "N vectors, M failed"; exits 0 only if all pass and N > 0.
// Node built-ins only (the fingerprint module needs no npm package).

import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import {
  FORMAT,
  componentValues,
  digestOf,
  jcs,
  sha256hex,
} from '../../clients/node/src/fingerprint.mjs';

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
