// Headless Chromium (Debian's chromium, driven by puppeteer-core: no browser download) runs
// the same parity check with onnxruntime-web (wasm), then the browser example; screenshots of
// both are saved. Pages are served by `python3 -m http.server` from a folder linking the
// repository's js/ and examples/ and the fixtures.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, readFile, writeFile, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { FIXTURES, REPO, servedChromium } from './helpers.js';
import { MODELS, TOLERANCE } from './parity.js';

const SCREENSHOTS = process.env.OTO_SCREENSHOTS ?? join(REPO, 'out', 'screenshots');

let browser;
let root;
let origin;
let close;

before(async () => {
  ({ browser, root, origin, close } = await servedChromium('oto', ['--disable-gpu']));
  await mkdir(SCREENSHOTS, { recursive: true });
});

after(async () => {
  await close?.();
});

async function open(path) {
  const page = await browser.newPage();
  await page.setViewport({ width: 1100, height: 720 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(`${origin}${path}`, { waitUntil: 'load' });
  return { page, errors };
}

test('the models train in onnxruntime-web (wasm) in Chromium, each step within 1e-5 of Python', async () => {
  const { page, errors } = await open('/js/test/browser/index.html?fixtures=/fixtures/');
  await page.waitForFunction('window.parity && window.parity.done', { timeout: 180000, polling: 200 });
  const parity = await page.evaluate('window.parity');
  await page.screenshot({ path: join(SCREENSHOTS, 'browser-parity.png') });
  assert.equal(parity.error, null, parity.error);
  assert.deepEqual(errors, []);
  assert.deepEqual(parity.reports.map((r) => r.name), MODELS);
  for (const r of parity.reports) {
    assert.ok(r.worstLoss <= TOLERANCE, `${r.name}: worst relative loss difference ${r.worstLoss}`);
    assert.ok(r.worstReturned <= TOLERANCE, `${r.name}: returned outputs differ by ${r.worstReturned}`);
    assert.equal(r.worstRate, 0, `${r.name}: learning rates`);
    await writeFile(join(FIXTURES, r.name, 'browser_state.safetensors'), Uint8Array.from(r.state));
    await writeFile(join(FIXTURES, r.name, 'browser_report.json'), JSON.stringify({ ...r, state: undefined }));
  }
  await page.close();
});

test('Trainer.load in the browser: page-relative, root-relative and absolute URLs; a missing export names the file', async () => {
  const { page, errors } = await open('/js/test/browser/load.html?fixtures=/fixtures/');
  await page.waitForFunction('window.loading && window.loading.done', { timeout: 60000, polling: 200 });
  const loading = await page.evaluate('window.loading');
  await page.close();
  assert.equal(loading.error, null, loading.error);
  assert.deepEqual(errors, []);
  assert.deepEqual(loading.loaded.map((l) => l.location), ['../../../fixtures/mlp/export/', '/fixtures/mlp/export', `${origin}/fixtures/mlp/export/`]);
  for (const l of loading.loaded) assert.ok(Number.isFinite(l.loss) && l.step === 1, JSON.stringify(l));
  assert.equal(new Set(loading.loaded.map((l) => l.loss)).size, 1, 'the same export, the same first step');
  assert.ok(loading.missing?.isTrainerError, JSON.stringify(loading.missing));
  assert.match(loading.missing.message, new RegExp(`^${origin}/fixtures/nowhere/manifest\\.json: cannot fetch the file \\(HTTP 404\\)$`));
});

test('examples/browser fine-tunes in the page, charts the loss and downloads the trained model', async () => {
  const downloads = join(root, 'downloads');
  await mkdir(downloads);
  const { page, errors } = await open('/examples/browser/index.html?model=/fixtures/example/&steps=120&autostart=1');
  const cdp = await page.createCDPSession();
  await cdp.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: downloads });
  await page.waitForFunction('window.example && window.example.done', { timeout: 120000, polling: 200 });
  const example = await page.evaluate('window.example');
  await page.screenshot({ path: join(SCREENSHOTS, 'browser-example.png') });
  assert.equal(example.error, null, example.error);
  assert.deepEqual(errors, []);
  assert.equal(example.losses.length, 120);
  assert.ok(example.losses.at(-1) < example.losses[0], `the loss fell: ${example.losses[0]} -> ${example.losses.at(-1)}`);
  await page.click('#download');
  let files = [];
  for (let i = 0; i < 100 && !files.some((f) => f.endsWith('.onnx')); i++) {
    await new Promise((r) => setTimeout(r, 100));
    files = await readdir(downloads);
  }
  const name = files.find((f) => f.endsWith('.onnx'));
  assert.ok(name, `a .onnx file was downloaded (found ${files})`);
  const bytes = await readFile(join(downloads, name));
  await writeFile(join(FIXTURES, 'example', 'downloaded.onnx'), bytes);
  await writeFile(join(FIXTURES, 'example', 'browser_example.json'), JSON.stringify(example));
  await page.close();
});
