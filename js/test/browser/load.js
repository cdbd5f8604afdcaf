// Browser side of js/test/browser.test.js's loading test (issue 32 item 3): Trainer.load with a
// page-relative, a root-relative and an absolute URL (each trained one step), and a missing
// export (a TrainerError naming the file's URL). Results in window.loading.
import * as ort from '../../node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { Trainer, TrainerError, decodeSafetensors } from '../../src/index.js';
import { batchAt } from '../parity.js';

ort.env.wasm.wasmPaths = new URL('../../node_modules/onnxruntime-web/dist/', import.meta.url).href;
ort.env.wasm.numThreads = 1;

const params = new URLSearchParams(location.search);
const root = params.get('fixtures') ?? '/fixtures/';  // root-relative, as served by the test
const log = document.getElementById('log');
window.loading = { done: false, loaded: [], missing: null, error: null };
try {
  const response = await fetch(`${root}mlp/batches.safetensors`);
  const batch = batchAt(ort, decodeSafetensors(new Uint8Array(await response.arrayBuffer())).tensors, 0);
  const depth = location.pathname.split('/').length - 2;  // from this page's folder up to the server root
  const locations = [
    `${'../'.repeat(depth)}${root.replace(/^\//, '')}mlp/export/`,  // page-relative
    `${root}mlp/export`,                                          // root-relative, no trailing slash
    new URL(`${root}mlp/export/`, location.origin).href,          // absolute
  ];
  for (const where of locations) {
    const trainer = await Trainer.load(ort, where);
    const { loss } = await trainer.step(batch);
    window.loading.loaded.push({ location: where, loss, step: trainer.scheduleStep });
  }
  try {
    await Trainer.load(ort, `${root}nowhere/`);
  } catch (error) {
    window.loading.missing = { isTrainerError: error instanceof TrainerError, message: error.message };
  }
  log.textContent = JSON.stringify(window.loading, null, 1);
} catch (error) {
  window.loading.error = String(error?.stack ?? error);
  log.textContent = window.loading.error;
}
window.loading.done = true;
