// Browser side of js/test/browser.test.js: trains every fixture (or those of ?models=a,b) with
// onnxruntime-web (wasm) and leaves the reports in window.parity (state as plain arrays of bytes).
import * as ort from '../../node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { MODELS, TOLERANCE, trainFixture } from '../parity.js';

ort.env.wasm.wasmPaths = new URL('../../node_modules/onnxruntime-web/dist/', import.meta.url).href;
ort.env.wasm.numThreads = 1; // no cross-origin isolation under a plain static server

const params = new URLSearchParams(location.search);
const models = params.get('models')?.split(',') ?? MODELS;
const fixtures = new URL(params.get('fixtures') ?? '/fixtures/', location.href).href;
const read = async (path) => {
  const response = await fetch(new URL(path, fixtures));
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
};

const table = document.getElementById('results');
const status = document.getElementById('status');
window.parity = { done: false, reports: [], error: null };
try {
  for (const name of models) {
    status.textContent = `training ${name}…`;
    const r = await trainFixture(ort, read, new URL(`${name}/export/`, fixtures).href, name);
    const row = table.insertRow();
    const ok = r.worstLoss <= TOLERANCE ? 'ok' : 'bad';
    for (const [text, cls] of [[name], [r.steps], [r.worstLoss.toExponential(2), ok], [r.evalLoss.toExponential(2)],
      [r.stepsPerSecond.toFixed(1)], [`${r.losses[0].toFixed(4)} → ${r.losses.at(-1).toFixed(4)}`]]) {
      const cell = row.insertCell();
      cell.textContent = text;
      if (cls) cell.className = cls;
    }
    window.parity.reports.push({ ...r, state: Array.from(r.state), inference: undefined, losses: undefined });
  }
  status.textContent = `done: ${models.length} models, onnxruntime-web ${ort.env.versions?.web ?? ''} (wasm, 1 thread)`;
} catch (error) {
  window.parity.error = String(error?.stack ?? error);
  status.textContent = `failed: ${error}`;
}
window.parity.done = true;
