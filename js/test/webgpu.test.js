// Headless Chromium with WebGPU (--enable-unsafe-webgpu, no --disable-gpu; on a machine
// without a GPU, Chromium's adapter is SwiftShader, a CPU implementation of Vulkan): the
// export's WebGPU step for each fixture places every node on WebGpuExecutionProvider
// (onnxruntime's verbose log), trains 50 steps within 1e-4 of wasm and of Python, keeps the
// state on the GPU, and exports/loads it. Skipped, with the reason, when the browser offers no
// adapter. Writes webgpu_report.json (placement, parity, steps/s) beside the fixtures.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { writeFile, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { FIXTURES, REPO, servedChromium } from './helpers.js';
import { MODELS } from './parity.js';

const SCREENSHOTS = process.env.OTO_SCREENSHOTS ?? join(REPO, 'out', 'screenshots');
const STEPS = 50;
const TOLERANCE = 1e-4; // relative, per step

let browser;
let origin;
let close;

before(async () => {
  ({ browser, origin, close } = await servedChromium('oto-webgpu', ['--enable-unsafe-webgpu']));
  await mkdir(SCREENSHOTS, { recursive: true });
});

after(async () => {
  await close?.();
});

/** Each model's node placement, from onnxruntime's verbose log between the harness's markers. */
function placements(lines) {
  const found = {};
  let current = null;
  for (const line of lines) {
    const marker = /=== placement (\S+) (begin|end)/.exec(line);
    if (marker) {
      current = marker[2] === 'begin' ? marker[1] : null;
      if (current) found[current] = [];
    } else if (current && /VerifyEachNodeIsAssignedToAnEp|MemcpyFromHost|MemcpyToHost/.test(line)) {
      found[current].push(line.replace(/^.*?(VerifyEachNodeIsAssignedToAnEp|AddCopyNode)\]\s*/, '').trim());
    }
  }
  return found;
}

test('the WebGPU step trains the models in Chromium, every node on WebGPU, within 1e-4 of wasm and Python', async (t) => {
  const page = await browser.newPage();
  await page.setViewport({ width: 1200, height: 720 });
  const errors = [];
  const lines = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => lines.push(m.text()));
  await page.goto(`${origin}/js/test/browser/webgpu.html?fixtures=/fixtures/&steps=${STEPS}`, { waitUntil: 'load' });
  await page.waitForFunction('window.webgpu && window.webgpu.done', { timeout: 480000, polling: 500 });
  const result = await page.evaluate('window.webgpu');
  await page.screenshot({ path: join(SCREENSHOTS, 'browser-webgpu.png') });
  await page.close();
  if (!result.adapter && !result.error) {
    t.skip('this Chromium offers no WebGPU adapter (navigator.gpu.requestAdapter() returned null)');
    return;
  }
  assert.equal(result.error, null, result.error);
  assert.deepEqual(errors, []);
  assert.deepEqual(result.isNan, [false, true, false, false, false, false], 'IsNaN lowered to Not(Equal(x, x)) on WebGPU');
  const state = result.state;
  assert.deepEqual(state.locations, ['gpu-buffer'], 'the state between steps is GPU buffers');
  assert.ok(Math.abs(state.evalGpu - state.evalWasm) <= 1e-5 * Math.abs(state.evalWasm), `exported state evaluates alike: ${state.evalGpu} vs ${state.evalWasm}`);
  assert.deepEqual(state.counters, [3, 3]);
  assert.ok(Math.abs(state.next[0] - state.next[1]) <= 1e-5 * Math.abs(state.next[1]), `loadState: ${state.next}`);
  assert.ok(state.inference > 0);
  assert.equal(state.fellBack.backend, 'wasm', `fallback: ${JSON.stringify(state.fellBack)}`);
  assert.match(state.fellBack.reason, /cannot run WebGPU/);
  assert.ok(Number.isFinite(state.fellBack.loss));
  const bad = state.refusals;
  assert.match(bad.nonFinite, /^TrainerError: step: input "input" holds NaN at 0; the WebGPU trainer refuses non-finite inputs/);
  assert.equal(bad.counter, 0, 'a refused step leaves the update count');
  assert.equal(bad.first, bad.expected, 'a refused step leaves the GPU state');
  assert.match(bad.wrongShape, /input "labels" must have shape \[\d+\], found \[\d+\]/);
  assert.match(bad.outOfRange, /input "labels" holds 2147483648 at 0; the WebGPU step reads it as int32/);
  const placed = placements(lines);
  for (const name of MODELS) {
    assert.ok((placed[name] ?? []).some((l) => /All nodes placed on \[WebGpuExecutionProvider\]/.test(l)),
      `${name}: not every node on WebGPU:\n${(placed[name] ?? []).join('\n')}`);
  }
  assert.deepEqual(result.reports.map((r) => r.name), MODELS);
  for (const r of result.reports) {
    assert.equal(r.backend, 'webgpu');
    assert.ok(r.worstVsWasm <= TOLERANCE, `${r.name}: WebGPU vs wasm ${r.worstVsWasm}`);
    assert.ok(r.worstVsPython <= TOLERANCE, `${r.name}: WebGPU vs Python ${r.worstVsPython}`);
    assert.ok(r.evalVsWasm <= TOLERANCE, `${r.name}: eval loss on WebGPU vs wasm ${r.evalVsWasm}`);
  }
  const report = {
    adapter: result.adapter, steps: STEPS, isNan: result.isNan, state,
    models: result.reports.map((r) => ({ ...r, state: undefined, losses: undefined, wasmLosses: undefined,
      placement: placed[r.name] })),
  };
  await writeFile(join(FIXTURES, 'webgpu_report.json'), JSON.stringify(report, null, 1));
});

test('examples/browser with the WebGPU toggle trains on WebGPU and says so', async (t) => {
  const page = await browser.newPage();
  await page.setViewport({ width: 1100, height: 720 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(`${origin}/examples/browser/index.html?model=/fixtures/example/&steps=40&autostart=1&backend=webgpu`, { waitUntil: 'load' });
  await page.waitForFunction('window.example && window.example.done', { timeout: 240000, polling: 200 });
  const example = await page.evaluate('window.example');
  const shown = await page.evaluate("document.getElementById('backend').textContent + ' | ' + document.getElementById('status').textContent");
  await page.screenshot({ path: join(SCREENSHOTS, 'browser-example-webgpu.png') });
  await page.close();
  if (example.backend !== 'webgpu' && /no adapter|navigator.gpu is absent/.test(shown)) {
    t.skip(`no WebGPU adapter: ${shown}`);
    return;
  }
  assert.equal(example.error, null, example.error);
  assert.deepEqual(errors, []);
  assert.equal(example.backend, 'webgpu', shown);
  assert.match(shown, /training on: WebGPU/);
  assert.match(shown, /on WebGPU/);
  assert.equal(example.losses.length, 40);
  assert.ok(example.losses.at(-1) < example.losses[0], `the loss fell: ${example.losses[0]} -> ${example.losses.at(-1)}`);
  assert.ok(example.accuracyAfter >= example.accuracyBefore, `accuracy ${example.accuracyBefore} -> ${example.accuracyAfter}`);
});
