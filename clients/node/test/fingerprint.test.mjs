// The library's fingerprint passes every test vector of docs/fingerprint.md.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { FORMAT, computeFingerprint } from '../src/index.mjs';

const VECTORS = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../../tests/vectors');
const doc = JSON.parse(fs.readFileSync(path.join(VECTORS, 'vectors.json'), 'utf8'));

test('the vectors are of the format the library computes', () => {
  assert.equal(doc.format, FORMAT);
  assert.ok(doc.vectors.length > 0);
});

for (const vector of doc.vectors) {
  test(`vector ${vector.case} ${vector.level}`, () => {
    const fp = computeFingerprint(path.join(VECTORS, vector.path), {
      level: vector.level,
      recipe: vector.recipe,
      placement: vector.placement,
    });

    assert.equal(fp.digest, vector.digest);
    assert.equal(fp.level, vector.level);
    assert.deepEqual(
      Object.fromEntries(fp.components.map((c) => [c.name, c.digest])),
      Object.fromEntries(Object.entries(vector.components).map(([n, c]) => [n, c.digest])),
    );
  });
}

test('an unknown level is refused', () => {
  assert.throws(() => computeFingerprint(VECTORS, { level: 'most' }), /unknown fingerprint level: most/);
});
