// LoRA on a tiny int4 Llama from onnxruntime-genai's builder (tests/js_fixtures.py, "lora_int4"):
// its exported step keeps onnxruntime's contrib ops (MatMulNBits, GroupQueryAttention,
// SkipSimplifiedLayerNormalization, GatherBlockQuantized in the backward), which onnxruntime-node
// and onnxruntime-web's wasm build both have. Trained in Node and in headless Chromium (wasm), each
// step's loss within 1e-5 of Python's TrainingSession; its WebGPU step in Chromium on WebGPU.
// Set OTO_SKIP_BROWSER=1 to leave Chromium out.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { FIXTURES, read, servedChromium } from './helpers.js';
import { TOLERANCE, trainFixture } from './parity.js';

const NAME = 'lora_int4';
// WebGPU steps (tests/js_fixtures.py LORA_WEBGPU_STEPS): SwiftShader compiles each session's shaders for ~10 s
const WEBGPU_STEPS = 3;

function check(r) {
  assert.equal(r.losses.length, r.steps);
  assert.ok(r.worstLoss <= TOLERANCE, `worst relative loss difference ${r.worstLoss}`);
  assert.ok(r.evalLoss <= TOLERANCE, `eval loss after training differs by ${r.evalLoss}`);
  assert.equal(r.worstRate, 0, 'the learning rates fed (float32) equal Python\'s');
}

test('the int4 Llama\'s adapters train in onnxruntime-node like in Python', async () => {
  const r = await trainFixture(ort, read, join(FIXTURES, NAME, 'export'), NAME);
  check(r);
  await writeFile(join(FIXTURES, NAME, 'node_state.safetensors'), r.state);
});

const skipBrowser = !['', '0', undefined].includes(process.env.OTO_SKIP_BROWSER);
test('the int4 Llama\'s adapters train in onnxruntime-web (wasm) in Chromium like in Python', { skip: skipBrowser && 'OTO_SKIP_BROWSER is set' }, async () => {
  const { browser, origin, close } = await servedChromium('oto-lora', ['--disable-gpu']);
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on('pageerror', (e) => errors.push(String(e)));
    await page.goto(`${origin}/js/test/browser/index.html?fixtures=/fixtures/&models=${NAME}`, { waitUntil: 'load' });
    await page.waitForFunction('window.parity && window.parity.done', { timeout: 180000, polling: 200 });
    const parity = await page.evaluate('window.parity');
    assert.equal(parity.error, null, parity.error);
    assert.deepEqual(errors, []);
    assert.deepEqual(parity.reports.map((r) => r.name), [NAME]);
    const [r] = parity.reports;
    assert.ok(r.worstLoss <= TOLERANCE, `worst relative loss difference ${r.worstLoss}`);
    assert.ok(r.evalLoss <= TOLERANCE, `eval loss after training differs by ${r.evalLoss}`);
    await writeFile(join(FIXTURES, NAME, 'browser_state.safetensors'), Uint8Array.from(r.state));
  } finally {
    await close();
  }
});

// The WebGPU step of the same model (export_step(target="webgpu")): onnxruntime-web's WebGPU provider
// runs its contrib ops (MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization), the
// gradient's dequantization as DequantizeLinear and float arithmetic (GatherBlockQuantized of uint8
// data has no WebGPU kernel), the attention mask's lengths in int32. Every node on WebGPU (onnxruntime's
// verbose log), each step within 1e-4 of wasm and of Python. Skipped, with the reason, without an adapter.
// The state checks of js/test/webgpu.test.js (its own fixtures) are left out (state=0).
test('the int4 Llama\'s adapters train on WebGPU in Chromium, every node on WebGPU', { skip: skipBrowser && 'OTO_SKIP_BROWSER is set' }, async (t) => {
  const { browser, origin, close } = await servedChromium('oto-lora-webgpu', ['--enable-unsafe-webgpu']);
  let result;
  const lines = [];
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on('pageerror', (e) => errors.push(String(e)));
    page.on('console', (m) => lines.push(m.text()));
    await page.goto(`${origin}/js/test/browser/webgpu.html?fixtures=/fixtures/&models=${NAME}&steps=${WEBGPU_STEPS}&state=0`, { waitUntil: 'load' });
    await page.waitForFunction('window.webgpu && window.webgpu.done', { timeout: 240000, polling: 500 });
    result = await page.evaluate('window.webgpu');
    assert.deepEqual(errors, []);
  } finally {
    await close();
  }
  if (!result.adapter && !result.error) {
    t.skip('this Chromium offers no WebGPU adapter (navigator.gpu.requestAdapter() returned null)');
    return;
  }
  assert.equal(result.error, null, result.error);
  const placement = [];
  let inside = false;
  for (const line of lines) {
    if (line.includes(`=== placement ${NAME} begin`)) inside = true;
    else if (line.includes(`=== placement ${NAME} end`)) inside = false;
    else if (inside && /VerifyEachNodeIsAssignedToAnEp|MemcpyFromHost|MemcpyToHost/.test(line)) placement.push(line);
  }
  const [r] = result.reports;
  await writeFile(join(FIXTURES, NAME, 'webgpu_report.json'), JSON.stringify({ adapter: result.adapter, placement,
    report: { ...r, state: undefined, losses: undefined, wasmLosses: undefined } }, null, 1));
  assert.ok(placement.some((l) => /All nodes placed on \[WebGpuExecutionProvider\]/.test(l)), `not every node on WebGPU:\n${placement.join('\n')}`);
  assert.equal(r.backend, 'webgpu');
  assert.ok(r.worstVsWasm <= 1e-4, `WebGPU vs wasm ${r.worstVsWasm}`);
  assert.ok(r.worstVsPython <= 1e-4, `WebGPU vs Python ${r.worstVsPython}`);
  await writeFile(join(FIXTURES, NAME, 'webgpu_state.safetensors'), Uint8Array.from(r.state));
});
