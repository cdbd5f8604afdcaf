// The README's training loop, run as written (its export directory pointed at the fixtures').
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, writeFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { FIXTURES } from './helpers.js';

const HERE = dirname(fileURLToPath(import.meta.url));

test('the README\'s 20-line loop trains, evaluates and writes the state and the trained model', async () => {
  const readme = await readFile(join(HERE, '..', 'README.md'), 'utf8');
  const code = /```js\n([\s\S]*?)```/.exec(readme)[1];
  assert.ok(code.split('\n').length <= 24, 'about 20 lines');
  const work = await mkdtemp(join(tmpdir(), 'oto-readme-'));
  const script = join(HERE, `.readme-${process.pid}.mjs`);  // inside js/: the package resolves itself by name
  const source = code.replace("'examples/browser/model/'", JSON.stringify(join(FIXTURES, 'example') + '/'))
    .replaceAll("writeFile('", `writeFile(${JSON.stringify(work + '/')} + '`);
  const logged = [];
  const log = console.log;
  console.log = (...args) => logged.push(args.join(' '));
  try {
    await writeFile(script, source);
    await import(script);
  } finally {
    console.log = log;
    await rm(script, { force: true });
  }
  assert.equal(logged.length, 3, logged.join('\n'));
  const losses = logged.map((line) => Number(/loss (\S+)/.exec(line)[1]));
  assert.ok(losses.every(Number.isFinite) && losses[1] < losses[0], logged.join('\n'));
  assert.ok((await readFile(join(work, 'state.safetensors'))).length > 0);
  assert.ok((await readFile(join(work, 'trained.onnx'))).length > 0);
  await rm(work, { recursive: true, force: true });
});
