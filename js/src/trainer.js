// The trainer: runs the exported step model (standard ONNX ops, written by
// `onnx-training-ops export-step`) in whichever onnxruntime binding it is handed. The state
// lives as ORT tensors between steps: each step feeds them, and the step's outputs named in
// the manifest's feedback map become the next state, with no copy. With a packed step
// (`export-step --packed`), the state of each dtype is one flat tensor (the manifest's
// `packs`), and the named state variables are views into it.

import { decode, encode, arrayType } from './safetensors.js';
import { fromJSON } from './schedules.js';
import { readExport } from './files.js';
import { embedWeights } from './onnx_weights.js';
import { TrainerError, NonFiniteLossError, show } from './errors.js';
import { sha256 } from './sha256.js';
import {
  validateManifest, validateModels, checkFeedbackFlow, checkFeedbackRecord, checkRates, checkLabels, checkBatch, checkPlainValue, checkTensor,
} from './validate.js';

export { TrainerError, NonFiniteLossError };

const FORMAT = 'onnx-training-ops/export';

/** The file names of an export's parts, for messages. */
const FILE_KEYS = {
  step: 'step', stepPacked: 'step_packed', eval: 'eval', inference: 'inference', state: 'state',
  stepWebgpu: 'step_webgpu', evalWebgpu: 'eval_webgpu',
};
/** The name of an export's part (a FILE_KEYS key) in messages: its path in the manifest. */
export const fileName = (manifest, key) => manifest.files?.[FILE_KEYS[key]]?.path ?? key;

/** Each file's bytes against manifest.json's files.<key>.sha256, where the manifest has one. */
export async function verifyFiles(manifest, files) {
  for (const [key, entry] of Object.entries(FILE_KEYS)) {
    const expected = manifest.files[entry]?.sha256;
    if (!expected || !files[key]) continue;
    const found = await sha256(files[key]);
    if (found !== expected) {
      throw new TrainerError(`${fileName(manifest, key)}: the SHA-256 of the file differs from manifest.json's files.${entry}.sha256 `
        + `(expected ${expected}, found ${found}): the file is damaged or not this export's`);
    }
  }
}

/** An onnxruntime session of a model file; onnxruntime's refusal becomes an error naming the file. */
export async function openSession(ort, bytes, options, name) {
  if (!(bytes instanceof Uint8Array)) throw new TrainerError(`${name}: expected the model's bytes (a Uint8Array), found ${show(bytes)}`);
  try {
    return await ort.InferenceSession.create(bytes, options);
  } catch (error) {
    throw new TrainerError(`${name}: onnxruntime cannot load the model (${error.message})`);
  }
}

/** Calls of `fn` one after another, in call order (steps and evaluations never interleave). */
function serialized(owner, fn) {
  const run = owner.queue.then(fn);
  owner.queue = run.then(() => undefined, () => undefined);
  return run;
}

function scalarOf(tensor) {
  const v = tensor.data[0];
  return typeof v === 'bigint' ? Number(v) : v;
}

/** The execution providers asked for: options.executionProviders, else sessionOptions'. */
function providersOf(options) {
  return options.executionProviders ?? options.sessionOptions?.executionProviders ?? null;
}

/**
 * `executionProviders` containing 'webgpu': the WebGPU trainer (js/src/webgpu.js) when the
 * runtime has an adapter and the export a WebGPU step; otherwise the remaining providers
 * (default: onnxruntime's, wasm in a browser), with the reason WebGPU was not used.
 */
async function chooseBackend(ort, files, options) {
  const providers = providersOf(options);
  const nameOf = (p) => (typeof p === 'string' ? p : p.name);
  const inNode = typeof process !== 'undefined' && Boolean(process.versions?.node) && typeof window === 'undefined';
  let reason = null;
  let rest = providers;
  if (providers?.some((p) => nameOf(p) === 'webgpu')) {
    const { WebGpuTrainer, webgpuUnavailable } = await import('./webgpu.js');
    reason = await webgpuUnavailable(files);
    if (!reason) {
      try {
        return { trainer: await WebGpuTrainer.createWebGpu(ort, files, options) };
      } catch (error) {  // a build without WebGPU (ort.wasm.min.mjs, onnxruntime-node): fall back
        if (!/backend not found|not supported|unsupported/i.test(String(error?.message ?? error))) throw error;
        reason = `this onnxruntime build cannot run WebGPU: ${error?.message ?? error}`;
      }
    }
    rest = providers.filter((p) => nameOf(p) !== 'webgpu');
  }
  const sessionOptions = { ...(options.sessionOptions ?? {}) };
  if (rest?.length) sessionOptions.executionProviders = rest;
  else delete sessionOptions.executionProviders;
  const name = rest?.length ? nameOf(rest[0]) : (inNode ? 'cpu' : 'wasm');
  // the fallback may need another build: ort.webgpu.min.mjs's wasm runs no float64 op (the portable step has some)
  const runtime = reason && options.fallback ? options.fallback : ort;
  return { options: { ...options, sessionOptions }, name, reason, ort: runtime };
}

export class Trainer {
  /**
   * @param ort the onnxruntime module (onnxruntime-node or onnxruntime-web)
   * @param files {manifest, step, stepPacked, eval, inference, state}: the manifest object, model bytes, state bytes
   * @param options {sessionOptions, onNonFinite: "raise" | "skip" | "ignore", packed: use the packed
   *   step (default: when the export has one), verify: check each file's SHA-256 (default true),
   *   executionProviders: e.g. ['webgpu', 'wasm'] (WebGPU when the runtime has an adapter and the
   *   export a WebGPU step; `trainer.backend` says which one runs, `trainer.backendReason` why
   *   WebGPU did not), fallback: the onnxruntime module to use when WebGPU is not (e.g.
   *   ort.wasm.min.mjs beside ort.webgpu.min.mjs, whose wasm backend runs no float64 op)}
   * @throws {TrainerError} naming the file and field that do not fit
   */
  static async create(ort, files, options = {}) {
    if (typeof ort?.InferenceSession?.create !== 'function' || typeof ort?.Tensor !== 'function') {
      throw new TrainerError('Trainer: the first argument must be the onnxruntime module (onnxruntime-node or onnxruntime-web)');
    }
    if (files === null || typeof files !== 'object') throw new TrainerError(`Trainer.create: expected {manifest, step, state, ...}, found ${show(files)}`);
    const manifest = validateManifest(files.manifest);
    const verify = options.verify ?? true;
    if (verify) await verifyFiles(manifest, files);
    const backend = await chooseBackend(ort, { ...files, manifest }, options);  // WebGPU (js/src/webgpu.js) when asked for and possible
    if (backend.trainer) return backend.trainer;
    options = backend.options;
    ort = backend.ort;
    const packed = options.packed ?? Boolean(manifest.packs && files.stepPacked);
    if (packed && !(manifest.packs && files.stepPacked)) throw new TrainerError('packed: the export has no packed step (export-step --packed)');
    const trainer = new Trainer(ort, manifest, { ...options, packed });
    const sessionOptions = options.sessionOptions ?? {};
    trainer.backend = backend.name;
    trainer.backendReason = backend.reason;
    const stepFile = fileName(manifest, packed ? 'stepPacked' : 'step');
    trainer.stepSession = await openSession(ort, packed ? files.stepPacked : files.step, sessionOptions, stepFile);
    trainer.evalSession = files.eval ? await openSession(ort, files.eval, sessionOptions, fileName(manifest, 'eval')) : null;
    try {
      validateModels(manifest, trainer.stepSession, trainer.evalSession, {
        feedback: trainer.stepFeedback, shapes: trainer.stepShapes(), stepFile, evalFile: fileName(manifest, 'eval'),
      });
      if (files.step) checkFeedbackFlow(manifest, files.step, fileName(manifest, 'step'));
      const stepBytes = packed ? files.stepPacked : files.step;
      if (stepBytes) checkFeedbackRecord(trainer.stepFeedback, stepBytes, stepFile);
      trainer.inferenceBytes = files.inference ?? null;
      trainer.loadState(files.state, { verify, where: fileName(manifest, 'state') });
    } catch (error) {
      await trainer.release();
      throw error;
    }
    return trainer;
  }

  /**
   * Load an export and create the trainer. `location`: in Node a directory path or a file: URL
   * (string or URL); in a browser a URL, absolute or relative to the page ('model/', '/model/').
   * @throws {TrainerError} naming a missing, damaged or refused file
   */
  static async load(ort, location, options = {}) {
    const webgpu = (providersOf(options) ?? []).some((p) => (typeof p === 'string' ? p : p.name) === 'webgpu');
    return Trainer.create(ort, await readExport(location, { webgpu }), options);
  }

  constructor(ort, manifest, options) {
    this.ort = ort;
    this.manifest = manifest;
    this.onNonFinite = options.onNonFinite ?? 'raise';
    if (!['raise', 'skip', 'ignore'].includes(this.onNonFinite)) throw new TrainerError(`onNonFinite must be raise, skip or ignore, found ${show(this.onNonFinite)}`);
    this.queue = Promise.resolve();
    this.inputs = Object.fromEntries(manifest.inputs.map((e) => [e.name, e]));
    this.evalInputs = Object.fromEntries((manifest.eval_inputs ?? []).map((e) => [e.name, e]));
    this.schedule = manifest.schedule ? fromJSON(manifest.schedule) : null;  // validateManifest checked it
    this.scheduleOffset = manifest.schedule ? manifest.schedule.step_offset : 0;
    this.counter = manifest.counter;
    this.skippedSteps = 0;
    this.rateTensors = {};
    this.packs = options.packed ? manifest.packs : [];
    const packed = new Set(this.packs.flatMap((p) => p.members.map((m) => m.name)));
    // what the step model takes and gives back for the state: the packs, and any variable outside them
    this.stepFeedback = Object.fromEntries([
      ...this.packs.map((p) => [p.input, p.output]),
      ...Object.entries(manifest.feedback).filter(([name]) => !packed.has(name)),
    ]);
    this.stepState = {};
    this.views = null; // the named state over the packs, made when asked for
  }

  /** {state input of the step run: {dtype, shape}}: the packs and the variables outside them. */
  stepShapes() {
    const shapes = Object.fromEntries(this.manifest.state.map((e) => [e.name, { dtype: e.dtype, shape: e.shape }]));
    for (const p of this.packs) shapes[p.input] = { dtype: p.dtype, shape: [p.size] };
    return shapes;
  }

  /** The state variables by name, as ORT tensors (views into the packs of a packed step). */
  get state() {
    if (!this.packs.length) return this.stepState;
    if (!this.views) {
      this.views = { ...this.stepState };
      for (const p of this.packs) {
        const flat = this.stepState[p.input].data;
        delete this.views[p.input];
        for (const m of p.members) {
          const size = m.shape.reduce((a, b) => a * b, 1);
          this.views[m.name] = new this.ort.Tensor(p.dtype, flat.subarray(m.offset, m.offset + size), m.shape);
        }
      }
    }
    return this.views;
  }

  _counterValue() {
    for (const p of this.packs) {
      const m = p.members.find((member) => member.name === this.counter);
      if (m) return Number(this.stepState[p.input].data[m.offset]);
    }
    return scalarOf(this.stepState[this.counter]);
  }

  /** A tensor for input `name` of the step (or eval) model from plain data: numbers or a TypedArray, converted to the manifest's dtype (labels become BigInt64Array). */
  tensor(name, data, dims) {
    const spec = this.inputs[name] ?? this.evalInputs[name];
    if (!spec) throw new TrainerError(`${JSON.stringify(name)} is not an input; inputs: ${Object.keys(this.inputs).join(', ')}`);
    checkPlainValue(name, { data, dims }, spec.dtype, 'tensor');
    const Type = arrayType(spec.dtype);
    let values = data;
    if (!(data instanceof Type)) {
      values = Type === BigInt64Array || Type === BigUint64Array ? Type.from(data, (v) => BigInt(v)) : Type.from(data, Number);
    }
    return new this.ort.Tensor(spec.dtype, values, Array.from(dims, Number));
  }

  _feeds(batch, specs, what) {
    checkBatch(batch, what);
    for (const name of Object.keys(batch)) {
      if (!(name in specs)) throw new TrainerError(`${what}: unknown input ${JSON.stringify(name)}; inputs: ${Object.keys(specs).join(', ')}`);
    }
    const feeds = {};
    for (const [name, spec] of Object.entries(specs)) {
      let value = batch[name];
      if (value === undefined) {
        const fallback = this.manifest.defaults?.[name];
        if (!fallback) throw new TrainerError(`${what}: batch has no ${JSON.stringify(name)}; needs ${Object.keys(specs).join(', ')}`);
        value = this.tensor(name, fallback.values, fallback.shape);
      } else if (!(value instanceof this.ort.Tensor)) {
        checkPlainValue(name, value, spec.dtype, what);
        value = this.tensor(name, value.data, value.dims);
      }
      checkTensor(name, value, spec, what);
      feeds[name] = value;
    }
    checkLabels(this.manifest, feeds, what);
    return feeds;
  }

  /** Optimizer steps taken under the schedule (torch's last_epoch): the update count plus the manifest's offset. */
  get scheduleStep() {
    return this.counter ? this._counterValue() + this.scheduleOffset : 0;
  }

  /** The learning rate of each input for the next step: the schedule's, else the base rate. */
  get learningRates() {
    const k = this.scheduleStep;
    return Object.fromEntries(this.manifest.learning_rates.map((e) => [e.name, this.schedule ? this.schedule.lr(e.base, k, e.name) : e.base]));
  }

  /** Attach a schedule (or null) from optimizer step `step` on. */
  setSchedule(schedule, step = 0) {
    if (schedule !== null && typeof schedule?.lr !== 'function') {
      throw new TrainerError(`setSchedule: expected a schedule (an object with lr(base, k)) or null, found ${show(schedule)}`);
    }
    if (!Number.isSafeInteger(step) || step < 0) throw new TrainerError(`setSchedule: step must be an integer >= 0, found ${show(step)}`);
    this.schedule = schedule;
    this.scheduleOffset = step - (this.counter ? this._counterValue() : 0);
  }

  _rateFeeds(lr) {
    const rates = checkRates(lr, this.manifest.learning_rates, lr === undefined ? this.learningRates : undefined);
    const feeds = {};
    for (const e of this.manifest.learning_rates) {
      let t = this.rateTensors[e.name];
      if (!t) {
        t = new this.ort.Tensor(e.dtype, new (arrayType(e.dtype))(1), e.shape);
        this.rateTensors[e.name] = t;
      }
      t.data[0] = rates[e.name];
      feeds[e.name] = t;
    }
    return feeds;
  }

  /**
   * One training step. `batch`: {input: ort.Tensor | {data, dims}}. `lr`: a number for every
   * group, or {input name: rate}; default: the schedule's. Returns the step's returned
   * outputs (loss, grad_norm...): one-element ones as numbers, others as ORT tensors.
   */
  step(batch, options) {
    return serialized(this, () => this._step(batch, options));
  }

  async _step(batch, options = {}) {
    if (options === null || typeof options !== 'object') throw new TrainerError(`step: options must be {lr}, found ${show(options)}`);
    const { lr } = options;
    const feeds = { ...this._feeds(batch, this.inputs, 'step'), ...this._rateFeeds(lr), ...this.stepState };
    const out = await this.stepSession.run(feeds);
    const result = {};
    for (const name of this.manifest.returned) result[name] = out[name].size === 1 ? scalarOf(out[name]) : out[name];
    const loss = this.manifest.loss;
    if (this.onNonFinite !== 'ignore' && loss && !Number.isFinite(result[loss])) {
      if (this.onNonFinite === 'raise') throw new NonFiniteLossError(`step: the loss is ${result[loss]}; the state is unchanged`);
      this.skippedSteps += 1;
      return result;
    }
    for (const [name, output] of Object.entries(this.stepFeedback)) this.stepState[name] = out[output];
    this.views = null;
    return result;
  }

  /** The loss and eval outputs with the current weights (eval mode); nothing changes. */
  evaluate(batch) {
    return serialized(this, () => this._evaluate(batch));
  }

  async _evaluate(batch) {
    if (!this.evalSession) throw new TrainerError('evaluate: the export was loaded without its eval model');
    const feeds = this._feeds(batch, this.evalInputs, 'evaluate');
    const state = this.state;
    for (const name of this.evalSession.inputNames) if (name in state) feeds[name] = state[name];
    const out = await this.evalSession.run(feeds);
    return Object.fromEntries((this.manifest.eval_outputs ?? []).map((n) => [n, out[n].size === 1 ? scalarOf(out[n]) : out[n]]));
  }

  /** The state as safetensors bytes (tensor names = state input names): resume here, in Python, or on another device. */
  exportState() {
    return encode(this.state, { format: FORMAT }, { sha256: true });
  }

  /**
   * Replace the state with safetensors bytes (every state variable, same dtype and shape); on
   * failure the state is unchanged.
   * @param options {verify: check __metadata__.sha256 (default true), where: the name in errors}
   * @throws {TrainerError}
   */
  loadState(bytes, { verify = true, where = 'loadState' } = {}) {
    const { tensors } = decode(bytes, where, { verify });
    const declared = this.manifest.state;
    const missing = declared.filter((e) => !(e.name in tensors)).map((e) => e.name);
    const unknown = Object.keys(tensors).filter((n) => !declared.some((e) => e.name === n));
    if (missing.length || unknown.length) throw new TrainerError(`${where}: missing ${JSON.stringify(missing)}, unknown ${JSON.stringify(unknown)}`);
    const state = {};
    for (const e of declared) {
      const t = tensors[e.name];
      if (t.dtype !== e.dtype || t.dims.length !== e.shape.length || t.dims.some((d, i) => d !== e.shape[i])) {
        throw new TrainerError(`${where}: ${e.name} must be ${e.dtype} [${e.shape}], found ${t.dtype} [${t.dims}]`);
      }
      state[e.name] = new this.ort.Tensor(e.dtype, t.data, e.shape);
    }
    for (const p of this.packs) {  // one copy into the flat buffer of each pack
      const flat = new (arrayType(p.dtype))(p.size);
      for (const m of p.members) {
        flat.set(state[m.name].data, m.offset);
        delete state[m.name];
      }
      state[p.input] = new this.ort.Tensor(p.dtype, flat, [p.size]);
    }
    this._checkSchedulePosition(state, where);
    this.stepState = state;
    this.views = null;
  }

  /** The schedule's step for `state` is >= 0 and gives finite rates >= 0. */
  _checkSchedulePosition(state, where) {
    if (!this.schedule || !this.counter) return;
    const previous = [this.stepState, this.views];
    this.stepState = state;
    this.views = null;
    try {
      const k = this.scheduleStep;
      if (k < 0) {
        throw new TrainerError(`${where}: the schedule's step is ${k} (update count ${this._counterValue()} + manifest.json `
          + `schedule.step_offset ${this.scheduleOffset}); expected >= 0`);
      }
      checkRates(undefined, this.manifest.learning_rates, this.learningRates, where);
    } catch (error) {
      if (!(error instanceof TrainerError)) throw new TrainerError(`${where}: manifest.json schedule: ${error.message}`);
      throw error;
    } finally {
      [this.stepState, this.views] = previous;
    }
  }

  /** The inference model with the current weights embedded: a self-contained .onnx file's bytes. */
  inferenceModel() {
    if (!this.inferenceBytes) throw new TrainerError('inferenceModel: the export was loaded without inference.onnx');
    return embedWeights(this.inferenceBytes, this.state, fileName(this.manifest, 'inference'));
  }

  async release() {
    await this.stepSession?.release?.();
    await this.evalSession?.release?.();
  }
}
