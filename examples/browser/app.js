// The browser example: load an export, fine-tune it with a live loss chart, download the result.
// Query parameters: model (export directory URL, default ./model/), steps (default 300),
// autostart (train at once: the screenshot test uses it), backend=webgpu (the WebGPU toggle:
// the export's WebGPU step on onnxruntime-web's WebGPU provider, wasm where there is none).
import * as ortWasm from '../../js/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import * as ortWebgpu from '../../js/node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs';
import { Trainer, decodeSafetensors } from '../../js/src/index.js';

for (const module of [ortWasm, ortWebgpu]) {
  module.env.wasm.wasmPaths = new URL('../../js/node_modules/onnxruntime-web/dist/', import.meta.url).href;
  module.env.wasm.numThreads = 1;
}
let ort = ortWasm; // the module of the backend that trains (its Tensor class)

const params = new URLSearchParams(location.search);
const wantWebgpu = params.get('backend') === 'webgpu';
const modelURL = new URL(params.get('model') ?? './model/', location.href).href;
const steps = Number(params.get('steps') ?? 300);
const BATCH = 32;
const $ = (id) => document.getElementById(id);
window.example = { done: false, losses: [], accuracyBefore: null, accuracyAfter: null, error: null, backend: null };

function drawChart(losses) {
  const canvas = $('chart');
  const g = canvas.getContext('2d');
  const [w, h, pad] = [canvas.width, canvas.height, 40];
  g.clearRect(0, 0, w, h);
  g.strokeStyle = '#888';
  g.strokeRect(pad, 10, w - pad - 10, h - pad - 10);
  g.fillStyle = '#333';
  g.font = '12px sans-serif';
  g.fillText('loss', 4, 20);
  g.fillText(`step ${losses.length} / ${steps}`, w - 110, h - 12);
  if (!losses.length) return;
  const top = Math.max(...losses);
  g.fillText(top.toFixed(2), 4, 36);
  g.fillText('0', 24, h - pad);
  g.strokeStyle = '#1565c0';
  g.lineWidth = 2;
  g.beginPath();
  losses.forEach((loss, i) => {
    const x = pad + (i / Math.max(1, steps - 1)) * (w - pad - 10);
    const y = h - pad - (loss / top) * (h - pad - 20);
    if (i === 0) g.moveTo(x, y);
    else g.lineTo(x, y);
  });
  g.stroke();
}

async function accuracy(trainer, data) {
  const n = data.test_y.dims[0];
  const { logits } = await trainer.evaluate({
    input: new ort.Tensor('float32', data.test_x.data, data.test_x.dims),
    labels: new ort.Tensor('int64', data.test_y.data, data.test_y.dims),
  });
  let right = 0;
  for (let i = 0; i < n; i++) {
    const row = logits.data.subarray(i * 10, i * 10 + 10);
    if (row.indexOf(Math.max(...row)) === Number(data.test_y.data[i])) right += 1;
  }
  return right / n;
}

function download(bytes, name) {
  const url = URL.createObjectURL(new Blob([bytes], { type: 'application/octet-stream' }));
  const a = Object.assign(document.createElement('a'), { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function train(trainer, data) {
  $('train').disabled = true;
  const n = data.train_y.dims[0];
  for (let i = 0; i < steps; i++) {
    const start = (i * BATCH) % (n - BATCH);
    const rate = Object.values(trainer.learningRates)[0];
    const { loss } = await trainer.step({
      input: new ort.Tensor('float32', data.train_x.data.subarray(start * 64, (start + BATCH) * 64), [BATCH, 64]),
      labels: new ort.Tensor('int64', data.train_y.data.subarray(start, start + BATCH), [BATCH]),
    });
    window.example.losses.push(loss);
    $('step').textContent = `step ${i + 1}`;
    $('loss').textContent = `loss ${loss.toFixed(4)}`;
    $('lr').textContent = `lr ${rate.toExponential(2)}`;
    if (i % 5 === 4 || i === steps - 1) {
      drawChart(window.example.losses);
      await new Promise(requestAnimationFrame);
    }
  }
  window.example.accuracyAfter = await accuracy(trainer, data);
  $('accuracy').textContent = `test accuracy ${(100 * window.example.accuracyBefore).toFixed(1)}% → ${(100 * window.example.accuracyAfter).toFixed(1)}%`;
  $('status').textContent = `done: ${steps} steps in onnxruntime-web on ${trainer.backend === 'webgpu' ? 'WebGPU' : 'WebAssembly (CPU)'}`;
  $('download').disabled = false;
  $('state').disabled = false;
}

try {
  $('webgpu').checked = wantWebgpu;
  $('webgpu').onchange = () => {
    params.set('backend', $('webgpu').checked ? 'webgpu' : 'wasm');
    location.search = params.toString();
  };
  const trainer = wantWebgpu
    ? await Trainer.load(ortWebgpu, modelURL, { executionProviders: ['webgpu'], fallback: ortWasm })
    : await Trainer.load(ortWasm, modelURL);
  ort = trainer.ort;
  window.example.backend = trainer.backend;
  $('backend').textContent = trainer.backend === 'webgpu' ? 'training on: WebGPU'
    : `training on: WebAssembly (CPU)${trainer.backendReason ? ` (WebGPU: ${trainer.backendReason})` : ''}`;
  const response = await fetch(new URL('data.safetensors', modelURL));
  const data = decodeSafetensors(new Uint8Array(await response.arrayBuffer())).tensors;
  window.example.accuracyBefore = await accuracy(trainer, data);
  $('accuracy').textContent = `test accuracy ${(100 * window.example.accuracyBefore).toFixed(1)}%`;
  $('status').textContent = `ready: ${data.train_y.dims[0]} training digits, ${data.test_y.dims[0]} held out`;
  drawChart([]);
  $('train').disabled = false;
  $('train').onclick = () => train(trainer, data).catch(fail).finally(() => { window.example.done = true; });
  // on WebGPU these download the state from the GPU first: Promises (await works for both)
  $('download').onclick = async () => download(await trainer.inferenceModel(), 'digits-trained.onnx');
  $('state').onclick = async () => download(await trainer.exportState(), 'state.safetensors');
  if (params.has('autostart')) $('train').click();
} catch (error) {
  fail(error);
  window.example.done = true;
}

function fail(error) {
  window.example.error = String(error?.stack ?? error);
  $('status').textContent = `failed: ${error}`;
}
