// The npm package as a user receives it (issue 32 item 5): `npm pack`, install the tarball into
// an empty folder (it has no dependencies of its own: --offline works), and run the README's
// loop, as the tarball's README writes it, against that install: it trains the digits MLP in
// Node; and a page importing the installed package (an import map, as a user without a bundler
// writes it) trains it in headless Chromium with onnxruntime-web.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, readdir, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import * as ort from 'onnxruntime-node';
import { FIXTURES, launchChromium, serve } from './helpers.js';

const run = promisify(execFile);
const JS = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const NPM = process.env.NPM ?? 'npm';
let work;
let installed;
let app;

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'oto-pack-'));
  await run(NPM, ['pack', '--pack-destination', work], { cwd: JS, timeout: 120000 });
  const tarball = (await readdir(work)).find((f) => f.endsWith('.tgz'));
  app = join(work, 'app');
  await mkdir(app);
  await writeFile(join(app, 'package.json'), JSON.stringify({ name: 'app', private: true, type: 'module' }));
  await run(NPM, ['install', '--offline', '--no-audit', '--no-fund', '--ignore-scripts', join(work, tarball)], { cwd: app, timeout: 120000 });
  // the user's own onnxruntime (a peer dependency): the one this repository tests with
  await symlink(join(JS, 'node_modules', 'onnxruntime-node'), join(app, 'node_modules', 'onnxruntime-node'));
  installed = join(app, 'node_modules', 'onnx-training-ops');
});

after(() => rm(work, { recursive: true, force: true }));

test('the tarball holds the LICENSE, the types, and every file its README links to', async () => {
  assert.equal(await readFile(join(installed, 'LICENSE'), 'utf8'), await readFile(join(JS, '..', 'LICENSE'), 'utf8'));
  assert.ok(existsSync(join(installed, 'src', 'index.d.ts')));
  const readme = await readFile(join(installed, 'README.md'), 'utf8');
  const links = [...readme.matchAll(/\]\(([^)\s]+)\)/g)].map((m) => m[1]).filter((l) => !/^(https?:|#|mailto:)/.test(l));
  assert.ok(links.length > 0);
  for (const link of links) assert.ok(existsSync(join(installed, link.split('#')[0])), `README links to ${link}, missing from the tarball`);
  assert.ok(!existsSync(join(JS, 'docs')), 'postpack removed the copied docs');
});

test('installed from the tarball, the README\'s loop trains the digits MLP in Node', async () => {
  const readme = await readFile(join(installed, 'README.md'), 'utf8');
  const code = /```js\n([\s\S]*?)```/.exec(readme)[1];
  const source = code.replace("'examples/browser/model/'", JSON.stringify(join(FIXTURES, 'example') + '/'));
  await writeFile(join(app, 'train.mjs'), source);
  const { stdout } = await run(process.execPath, ['train.mjs'], { cwd: app, timeout: 120000 });
  const lines = stdout.trim().split('\n');
  assert.equal(lines.length, 3, stdout);
  const losses = lines.map((line) => Number(/loss (\S+)/.exec(line)[1]));
  assert.ok(losses.every(Number.isFinite) && losses[1] < losses[0], stdout);
  // the trained model it wrote runs in onnxruntime and scores better than chance on the held-out digits
  const { decodeSafetensors } = await import(join(installed, 'src', 'index.js'));
  const data = decodeSafetensors(await readFile(join(FIXTURES, 'example', 'data.safetensors'))).tensors;
  const session = await ort.InferenceSession.create(join(app, 'trained.onnx'));
  const n = data.test_y.data.length;
  const out = await session.run({ [session.inputNames[0]]: new ort.Tensor('float32', data.test_x.data, data.test_x.dims) });
  const logits = out[session.outputNames[0]].data;
  const classes = logits.length / n;
  let right = 0;
  for (let i = 0; i < n; i++) {
    const row = logits.subarray(i * classes, (i + 1) * classes);
    if (row.indexOf(Math.max(...row)) === Number(data.test_y.data[i])) right += 1;
  }
  assert.ok(right / n > 0.8, `held-out accuracy ${right / n}`);
});

const PAGE = `<!doctype html>
<meta charset="utf-8">
<script type="importmap">{"imports": {"onnx-training-ops": "./node_modules/onnx-training-ops/src/index.js"}}</script>
<script type="module">
import * as ort from './node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { Trainer, decodeSafetensors } from 'onnx-training-ops';
ort.env.wasm.wasmPaths = new URL('./node_modules/onnxruntime-web/dist/', location.href).href;
ort.env.wasm.numThreads = 1;
window.result = { done: false, error: null };
try {
  const trainer = await Trainer.load(ort, 'model/');
  const data = decodeSafetensors(new Uint8Array(await (await fetch('model/data.safetensors')).arrayBuffer())).tensors;
  const [x, y, B] = [data.train_x.data, data.train_y.data, 32];
  const losses = [];
  for (let i = 0; i + B <= y.length; i += B) {
    losses.push((await trainer.step({ input: new ort.Tensor('float32', x.subarray(i * 64, (i + B) * 64), [B, 64]),
      labels: new ort.Tensor('int64', y.subarray(i, i + B), [B]) })).loss);
  }
  const { loss } = await trainer.evaluate({ input: data.test_x, labels: data.test_y });
  Object.assign(window.result, { losses, heldOut: loss, model: trainer.inferenceModel().length });
} catch (error) {
  window.result.error = String(error?.stack ?? error);
}
window.result.done = true;
</script>`;

// OTO_SKIP_BROWSER=1 (make test SKIP_BROWSER=1): no Chromium on this machine
const skipBrowser = !['', '0', undefined].includes(process.env.OTO_SKIP_BROWSER) && 'OTO_SKIP_BROWSER is set: no headless Chromium';

test('installed from the tarball, a page that imports it trains the digits MLP in Chromium (onnxruntime-web)', { skip: skipBrowser }, async () => {
  await symlink(join(JS, 'node_modules', 'onnxruntime-web'), join(app, 'node_modules', 'onnxruntime-web'));
  await symlink(join(FIXTURES, 'example'), join(app, 'model'));
  await writeFile(join(app, 'index.html'), PAGE);
  const server = await serve(app);
  let chromium;
  try {
    chromium = await launchChromium('oto-pack', ['--disable-gpu']);
    const { browser } = chromium;
    const page = await browser.newPage();
    const errors = [];
    page.on('pageerror', (e) => errors.push(String(e)));
    await page.goto(`${server.origin}/index.html`, { waitUntil: 'load' });
    await page.waitForFunction('window.result && window.result.done', { timeout: 120000, polling: 200 });
    const result = await page.evaluate('window.result');
    assert.equal(result.error, null, result.error);
    assert.deepEqual(errors, []);
    assert.ok(result.losses.length > 40 && result.losses.every(Number.isFinite), JSON.stringify(result.losses));
    const mean = (a) => a.reduce((s, v) => s + v, 0) / a.length;
    assert.ok(mean(result.losses.slice(-10)) < mean(result.losses.slice(0, 10)), `the loss fell: ${result.losses}`);
    assert.ok(Number.isFinite(result.heldOut) && result.model > 0);
  } finally {
    await chromium?.close();
    server.child.kill();
  }
});
