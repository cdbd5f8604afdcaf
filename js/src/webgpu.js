// The trainer on onnxruntime-web's WebGPU execution provider: runs the export's WebGPU step
// (`export-step --target webgpu`: step.webgpu.onnx, every node on WebGPU) and keeps the
// parameters and optimizer state on the GPU between steps: the state outputs stay GPU buffers
// (`preferredOutputLocation: 'gpu-buffer'`) and are fed back as the next step's inputs; only
// the returned outputs (the loss...) are read back. The update count and what depends on it
// alone (the bias corrections) are the host program's (host_program.js), evaluated on the CPU
// in float64. evaluate() runs the export's WebGPU eval model on the state where it lies;
// exportState() and inferenceModel() download the state first: on this backend they return
// Promises (`await` works for both backends).
//
// Not used: graph capture (`enableGraphCapture`): it needs every input and output to be a GPU
// buffer, the batch and the loss included, and turns int64 arithmetic into 32-bit arithmetic.

import { Trainer, fileName, openSession } from './trainer.js';
import { TrainerError, NonFiniteLossError } from './errors.js';
import { checkBatch, checkRates } from './validate.js';
import { encode } from './safetensors.js';
import { embedWeights } from './onnx_weights.js';
import { runHost } from './host_program.js';

const INT32_MIN = -(2 ** 31);
const INT32_MAX = 2 ** 31 - 1;

/** Why WebGPU cannot run here (a sentence), or null when it can: navigator.gpu, an adapter, the export's WebGPU step. */
export async function webgpuUnavailable(files) {
  if (!files.manifest?.webgpu || !files.stepWebgpu) return 'the export has no WebGPU step (export-step --target webgpu)';
  const gpu = globalThis.navigator?.gpu;
  if (!gpu) return 'navigator.gpu is absent (no WebGPU in this runtime)';
  try {
    if (!(await gpu.requestAdapter())) return 'navigator.gpu.requestAdapter() returned no adapter';
  } catch (error) {
    return `navigator.gpu.requestAdapter() failed: ${error}`;
  }
  return null;
}

function int32Data(name, tensorOrData) {
  const data = tensorOrData.data ?? tensorOrData;
  const out = new Int32Array(data.length);
  for (let i = 0; i < data.length; i++) {
    const v = Number(data[i]);
    if (!Number.isInteger(v) || v < INT32_MIN || v > INT32_MAX) {
      throw new TrainerError(`step: input ${JSON.stringify(name)} holds ${data[i]} at ${i}; the WebGPU step reads it as int32`);
    }
    out[i] = v;
  }
  return out;
}

/**
 * WGSL does not propagate NaN as IEEE arithmetic does (on SwiftShader, Relu of NaN gave 0 and the
 * step's loss stayed finite): a NaN or infinity in a float input need not reach the loss, where
 * onNonFinite would catch it. The WebGPU trainer refuses such a batch before it reaches the GPU.
 */
function finiteData(name, data) {
  for (let i = 0; i < data.length; i++) {
    if (!Number.isFinite(data[i])) throw new TrainerError(`step: input ${JSON.stringify(name)} holds ${data[i]} at ${i}; the WebGPU trainer refuses non-finite inputs (WGSL need not carry a NaN to the loss)`);
  }
}

export class WebGpuTrainer extends Trainer {
  /** Create the WebGPU trainer from the files of an export (readExport) and Trainer options. */
  static async createWebGpu(ort, files, options = {}) {
    const { manifest } = files;
    const trainer = new WebGpuTrainer(ort, manifest, { ...options, packed: false });
    const gpu = manifest.webgpu;
    const location = {};
    for (const output of Object.values(gpu.feedback)) location[output] = 'gpu-buffer';
    for (const output of gpu.returned) location[output] = 'cpu';
    const provider = { name: 'webgpu', preferredLayout: 'NCHW' }; // NHWC Conv is wrong for some channel counts (1.30)
    const sessionOptions = { ...(options.sessionOptions ?? {}), executionProviders: [provider], preferredOutputLocation: location };
    trainer.stepSession = await openSession(ort, files.stepWebgpu, sessionOptions, fileName(manifest, 'stepWebgpu'));
    try {
      // evaluate(): the export's WebGPU eval model, fed the state where it lies (on the GPU)
      const evalOptions = { ...(options.sessionOptions ?? {}), executionProviders: [provider] };
      trainer.evalSession = files.evalWebgpu ? await openSession(ort, files.evalWebgpu, evalOptions, fileName(manifest, 'evalWebgpu')) : null;
      trainer.inferenceBytes = files.inference ?? null;
      trainer.loadState(files.state, { verify: options.verify ?? true, where: fileName(manifest, 'state') });
    } catch (error) {
      await trainer.release();
      throw error;
    }
    return trainer;
  }

  constructor(ort, manifest, options) {
    super(ort, manifest, options);
    const gpu = manifest.webgpu;
    this.backend = 'webgpu';
    this.backendReason = null;
    this.gpu = gpu;
    this.inputs = Object.fromEntries(gpu.inputs.map((e) => [e.name, e]));
    this.evalInputs = Object.fromEntries((gpu.eval_inputs ?? manifest.eval_inputs).map((e) => [e.name, e]));
    this.stepFeedback = { ...gpu.feedback };
    this.host = {}; // host state: the update count, a number
    this.dtypes = Object.fromEntries([...manifest.state, ...manifest.learning_rates].map((e) => [e.name, e.dtype]));
  }

  _counterValue() {
    const t = this.stepState?.[this.counter];  // during loadState, before it moves to the host
    if (t && t.location !== 'gpu-buffer') return Number(t.data[0]);
    return this.host[this.counter] ?? 0;
  }

  _batch(batch, specs = this.inputs, what = 'step') {
    checkBatch(batch, what);
    const converted = { ...batch };
    for (const [name, spec] of Object.entries(specs)) {
      const value = batch[name];
      if (spec.dtype.startsWith('float') && value?.data) finiteData(name, value.data);
      if (spec.dtype === 'int32' && value !== undefined && value.type !== 'int32') {
        converted[name] = new this.ort.Tensor('int32', int32Data(name, value), value.dims);
      }
    }
    return converted;
  }

  /** One training step on the GPU (step() serializes the calls); returns the returned outputs (numbers for one-element ones). */
  async _step(batch, options = {}) {
    if (options === null || typeof options !== 'object') throw new TrainerError(`step: options must be {lr}, found ${options}`);
    const { lr } = options;
    const rates = checkRates(lr, this.manifest.learning_rates, lr === undefined ? this.learningRates : undefined);
    const feeds = this._feeds(this._batch(batch), this.inputs, 'step');
    const host = runHost(this.gpu.host, { ...this.host, ...rates }, this.dtypes);
    for (const f of this.gpu.host.feeds) {
      if (f.dtype !== 'float32') throw new TrainerError(`step: host value ${f.name} is ${f.dtype}; the WebGPU step reads float32`);
      feeds[f.name] = new this.ort.Tensor('float32', Float32Array.of(host[f.name].value), f.shape);
    }
    const rateFeeds = this._rateFeeds(rates);
    for (const name of this.gpu.rates) feeds[name] = rateFeeds[name];
    for (const name of Object.keys(this.stepFeedback)) feeds[name] = this.stepState[name];
    const out = await this.stepSession.run(feeds);
    const result = {};
    for (const name of this.gpu.returned) result[name] = out[name].size === 1 ? Number(out[name].data[0]) : out[name];
    const loss = this.manifest.loss;
    const fresh = Object.values(this.stepFeedback).map((o) => out[o]);
    if (this.onNonFinite !== 'ignore' && loss && !Number.isFinite(result[loss])) {
      for (const t of fresh) t.dispose?.();
      if (this.onNonFinite === 'raise') throw new NonFiniteLossError(`step: the loss is ${result[loss]}; the state is unchanged`);
      this.skippedSteps += 1;
      return result;
    }
    for (const [name, output] of Object.entries(this.stepFeedback)) {
      const old = this.stepState[name];
      this.stepState[name] = out[output];
      if (old?.location === 'gpu-buffer') old.dispose();
    }
    for (const name of this.gpu.host_state) this.host[name] = host[this.manifest.feedback[name]].value;
    this.views = null;
    return result;
  }

  /** The state variables by name as CPU tensors (downloaded from the GPU). */
  async downloadState() {
    const state = {};
    for (const e of this.manifest.state) {
      if (this.gpu.host_state.includes(e.name)) {
        const Type = e.dtype === 'int64' ? BigInt64Array : Float64Array;
        const value = this.host[e.name];
        state[e.name] = new this.ort.Tensor(e.dtype, Type.of(e.dtype === 'int64' ? BigInt(value) : value), e.shape);
        continue;
      }
      const t = this.stepState[e.name];
      state[e.name] = t.location === 'gpu-buffer' ? new this.ort.Tensor(e.dtype, await t.getData(), e.shape) : t;
    }
    return state;
  }

  /** The state as safetensors bytes (a Promise on this backend). */
  async exportState() {
    return encode(await this.downloadState(), { format: 'onnx-training-ops/export' }, { sha256: true });
  }

  /** Replace the state (Trainer.loadState); the previous GPU buffers are released. */
  loadState(bytes, options) {
    const previous = this.stepState;
    super.loadState(bytes, options);
    for (const name of this.gpu.host_state) {
      this.host[name] = Number(this.stepState[name].data[0]);
      delete this.stepState[name];
    }
    for (const t of Object.values(previous ?? {})) if (t?.location === 'gpu-buffer') t.dispose();
  }

  /** The inference model with the current weights embedded (a Promise on this backend). */
  async inferenceModel() {
    if (!this.inferenceBytes) throw new TrainerError('inferenceModel: the export was loaded without inference.onnx');
    return embedWeights(this.inferenceBytes, await this.downloadState(), fileName(this.manifest, 'inference'));
  }

  /** The loss and eval outputs (eval mode) on WebGPU with the current state (evaluate() serializes the calls); nothing changes. */
  async _evaluate(batch) {
    if (!this.evalSession) throw new TrainerError('evaluate: the export has no WebGPU eval model (eval.webgpu.onnx)');
    const feeds = this._feeds(this._batch(batch, this.evalInputs, 'evaluate'), this.evalInputs, 'evaluate');
    const state = this.stepState;
    for (const name of this.evalSession.inputNames) if (name in state) feeds[name] = state[name];
    const out = await this.evalSession.run(feeds);
    return Object.fromEntries((this.manifest.eval_outputs ?? []).map((n) => [n, out[n].size === 1 ? Number(out[n].data[0]) : out[n]]));
  }

  get state() {
    return this.stepState;
  }

  async release() {
    for (const t of Object.values(this.stepState)) if (t?.location === 'gpu-buffer') t.dispose();
    await super.release();
  }
}
