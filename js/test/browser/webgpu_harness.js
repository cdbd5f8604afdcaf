// Browser side of js/test/webgpu.test.js: for each fixture, the WebGPU step's node placement
// (onnxruntime's verbose session log, read by the test from the console), then the same steps on WebGPU and on wasm (the same
// onnxruntime-web bundle), compared with each other and with Python's losses. Reports in
// window.webgpu; `?steps=N` (default 50); `?state=0` leaves out the state checks (run on the first model
// otherwise: several more WebGPU sessions, each compiling its shaders). Two bundles: ort.webgpu.min.mjs has the native
// WebGpuExecutionProvider (ort.min.mjs's WebGPU is the older JSEP provider, whose MatMul fails on
// the transformer's step), but its wasm backend runs no float64 op, which the portable step has:
// wasm runs from ort.wasm.min.mjs.
import * as ort from '../../node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs';
import * as ortWasm from '../../node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { MODELS, trainFixture, batchAt } from '../parity.js';
import { Trainer, decodeSafetensors } from '../../src/index.js';

ort.env.wasm.wasmPaths = new URL('../../node_modules/onnxruntime-web/dist/', import.meta.url).href;
ort.env.wasm.numThreads = 1; // no cross-origin isolation under a plain static server
ortWasm.env.wasm.wasmPaths = ort.env.wasm.wasmPaths;
ortWasm.env.wasm.numThreads = 1;

const params = new URLSearchParams(location.search);
const fixtures = new URL(params.get('fixtures') ?? '/fixtures/', location.href).href;
const steps = Number(params.get('steps') ?? 50);
const warmup = Math.min(5, steps - 1); // shader compilation: the first steps are left out of steps/s
const models = (params.get('models') ?? MODELS.join(',')).split(',');
const checkState = params.get('state') !== '0';
const read = async (path) => {
  const response = await fetch(new URL(path, fixtures));
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
};

/**
 * Create (and release) a WebGPU session of the model with onnxruntime's verbose log on, between
 * two marker lines: onnxruntime logs the node placement to the console (its wasm module holds
 * its own reference to console, so the page cannot intercept it; the test reads the console).
 */
async function logPlacement(name, bytes) {
  const level = ort.env.logLevel;
  ort.env.logLevel = 'verbose';
  console.log(`=== placement ${name} begin`);
  try {
    const session = await ort.InferenceSession.create(bytes, {
      executionProviders: [{ name: 'webgpu', preferredLayout: 'NCHW' }], logSeverityLevel: 0, logVerbosityLevel: 0 });
    await session.release();
  } finally {
    console.log(`=== placement ${name} end`);
    ort.env.logLevel = level;
  }
}

/** IsNaN as the WebGPU step lowers it, on WebGPU: [0, NaN, inf, -inf, -0, 1] -> which are NaN. */
async function isNanOnWebGpu() {
  const session = await ort.InferenceSession.create(await read('probes/is_nan.onnx'), { executionProviders: ['webgpu'] });
  const out = await session.run({ x: new ort.Tensor('float32', Float32Array.of(0, NaN, Infinity, -Infinity, -0, 1), [6]) });
  await session.release();
  return Array.from(out.y.data, Boolean);
}

/**
 * The state on the GPU: after a step every state tensor is a GPU buffer; exportState()
 * downloads it, and a wasm trainer loaded with it evaluates what the WebGPU trainer evaluates;
 * loadState() on the WebGPU trainer takes a state back (the next steps equal the wasm trainer's).
 */
async function stateChecks(name) {
  const where = new URL(`${name}/export/`, fixtures).href;
  const { tensors } = decodeSafetensors(await read(`${name}/batches.safetensors`));
  const gpu = await Trainer.load(ort, where, { executionProviders: ['webgpu'] });
  const wasm = await Trainer.load(ortWasm, where);
  for (let i = 0; i < 3; i++) await gpu.step(batchAt(ort, tensors, i));
  const locations = [...new Set(Object.values(gpu.state).map((t) => t.location))];
  wasm.loadState(await gpu.exportState());
  const evalGpu = (await gpu.evaluate(batchAt(ort, tensors, 0))).loss;
  const evalWasm = (await wasm.evaluate(batchAt(ortWasm, tensors, 0))).loss;
  const counters = [gpu.scheduleStep, wasm.scheduleStep];
  for (let i = 3; i < 6; i++) await wasm.step(batchAt(ortWasm, tensors, i));
  gpu.loadState(wasm.exportState());
  const next = [(await gpu.step(batchAt(ort, tensors, 6))).loss, (await wasm.step(batchAt(ortWasm, tensors, 6))).loss];
  const inference = (await gpu.inferenceModel()).length;
  await gpu.release();
  await wasm.release();
  // a build without WebGPU (the wasm bundle) asked for WebGPU: the wasm trainer, with the reason
  const fallback = await Trainer.load(ortWasm, where, { executionProviders: ['webgpu'] });
  const fellBack = { backend: fallback.backend, reason: fallback.backendReason, loss: (await fallback.step(batchAt(ortWasm, tensors, 0))).loss };
  await fallback.release();
  return { locations, evalGpu, evalWasm, counters, next, inference, fellBack, refusals: await refusals(where, tensors) };
}

/** Bad batches on WebGPU: a NaN loss (state unchanged), a shape other than the export's static one, a label past int32. */
async function refusals(where, tensors) {
  const trainer = await Trainer.load(ort, where, { executionProviders: ['webgpu'] });
  const batch = batchAt(ort, tensors, 0);
  const message = async (run) => { try { await run(); return null; } catch (error) { return `${error.name}: ${error.message}`; } };
  const nanInput = Object.fromEntries(Object.entries(batch).map(([k, t]) => [k, t.type === 'float32'
    ? new ort.Tensor('float32', new Float32Array(t.data.length).fill(NaN), t.dims) : t]));
  const nonFinite = await message(() => trainer.step(nanInput));
  const counter = trainer.scheduleStep;
  const first = (await trainer.step(batch)).loss;  // as if the NaN step never happened
  const fresh = await Trainer.load(ort, where, { executionProviders: ['webgpu'] });
  const expected = (await fresh.step(batch)).loss;
  const labels = trainer.manifest.labels ?? 'labels';
  const wrongShape = await message(() => trainer.step({ ...batch, [labels]: new ort.Tensor(batch[labels].type, batch[labels].data.subarray(1), [batch[labels].dims[0] - 1]) }));
  const big = batch[labels].type === 'int64' ? BigInt64Array.from(batch[labels].data) : Float64Array.from(batch[labels].data);
  big[0] = batch[labels].type === 'int64' ? 2n ** 31n : 2 ** 31;
  const outOfRange = await message(() => trainer.step({ ...batch, [labels]: { data: big, dims: batch[labels].dims } }));
  await trainer.release();
  await fresh.release();
  return { nonFinite, counter, first, expected, wrongShape, outOfRange };
}

const table = document.getElementById('results');
const status = document.getElementById('status');
window.webgpu = { done: false, adapter: null, reports: [], error: null };
try {
  const adapter = navigator.gpu ? await navigator.gpu.requestAdapter() : null;
  const info = adapter?.info ?? {};
  window.webgpu.adapter = adapter ? { vendor: info.vendor, architecture: info.architecture, description: info.description, device: info.device } : null;
  document.getElementById('adapter').textContent = adapter ? `adapter: ${JSON.stringify(window.webgpu.adapter)}` : 'no WebGPU adapter';
  if (adapter) {
    window.webgpu.isNan = await isNanOnWebGpu();
    if (checkState) window.webgpu.state = await stateChecks(models[0]);
    for (const name of models) {
      status.textContent = `${name}: placement…`;
      const manifest = JSON.parse(new TextDecoder().decode(await read(`${name}/export/manifest.json`)));
      await logPlacement(name, await read(`${name}/export/${manifest.files.step_webgpu.path}`));
      const where = new URL(`${name}/export/`, fixtures).href;
      status.textContent = `${name}: training on WebGPU…`;
      const gpu = await trainFixture(ort, read, where, name, { steps, warmup, executionProviders: ['webgpu'] });
      status.textContent = `${name}: training on wasm…`;
      const wasm = await trainFixture(ortWasm, read, where, name, { steps, warmup });
      const worstVsWasm = Math.max(...gpu.losses.map((l, i) => Math.abs(l - wasm.losses[i]) / Math.abs(wasm.losses[i])));
      const report = { name, steps, backend: gpu.backend, wasmBackend: wasm.backend, worstVsWasm,
        worstVsPython: gpu.worstLoss, wasmVsPython: wasm.worstLoss,
        evalVsWasm: Math.abs(gpu.evaluation - wasm.evaluation) / Math.abs(wasm.evaluation),
        gpuStepsPerSecond: gpu.stepsPerSecond, wasmStepsPerSecond: wasm.stepsPerSecond,
        losses: gpu.losses, wasmLosses: wasm.losses, state: Array.from(gpu.state) };
      const row = table.insertRow();
      const ok = (x) => (x <= 1e-4 ? 'ok' : 'bad');
      for (const [text, cls] of [[name], [steps], ['in the console log'],
        [worstVsWasm.toExponential(2), ok(worstVsWasm)], [gpu.worstLoss.toExponential(2), ok(gpu.worstLoss)],
        [gpu.stepsPerSecond.toFixed(1)], [wasm.stepsPerSecond.toFixed(1)], [`${gpu.losses[0].toFixed(4)} → ${gpu.losses.at(-1).toFixed(4)}`]]) {
        const cell = row.insertCell();
        cell.textContent = text;
        if (cls) cell.className = cls;
      }
      window.webgpu.reports.push(report);
    }
  }
  status.textContent = `done: onnxruntime-web ${ort.env.versions?.web ?? ''}`;
} catch (error) {
  window.webgpu.error = String(error?.stack ?? error);
  status.textContent = `failed: ${error}`;
}
window.webgpu.done = true;
