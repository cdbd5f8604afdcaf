// Where the Node tests find what Python wrote (OTO_FIXTURES), and how they read it.
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';

export const FIXTURES = process.env.OTO_FIXTURES;
if (!FIXTURES) {
  throw new Error('OTO_FIXTURES is not set: write the fixtures first, e.g. `python tests/js_fixtures.py /tmp/fixtures` '
    + 'then `OTO_FIXTURES=/tmp/fixtures node --test js/test/` (make test-js does both)');
}
export const read = async (path) => new Uint8Array(await readFile(join(FIXTURES, path)));
