// LoRA on a tiny int4 Llama from onnxruntime-genai's builder (tests/js_fixtures.py, "lora_int4"):
// its exported step keeps onnxruntime's contrib ops (MatMulNBits, GroupQueryAttention,
// SkipSimplifiedLayerNormalization, GatherBlockQuantized in the backward), which onnxruntime-node
// and onnxruntime-web's wasm build both have. Trained in Node and in headless Chromium (wasm), each
// step's loss within 1e-5 of Python's TrainingSession. Set OTO_SKIP_BROWSER=1 to leave Chromium out.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { FIXTURES, read, servedChromium } from './helpers.js';
import { TOLERANCE, trainFixture } from './parity.js';

const NAME = 'lora_int4';

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
