// Checks of what the trainer is handed: the manifest (its fields, its paths, its schedule),
// the models against the manifest, batches, labels and learning rates. Each failure is a
// TrainerError naming the file, field or input, what was expected and what was found.

import { TrainerError, show } from './errors.js';
import { DTYPES } from './safetensors.js';
import { SCHEDULES } from './schedules.js';
import { dataFlow, metadataValue } from './onnx_graph.js';
import { Damaged } from './protobuf.js';

const DTYPE_NAMES = Object.values(DTYPES).map(([name]) => name);
const isObject = (v) => v !== null && typeof v === 'object' && !Array.isArray(v);
const isCount = (v) => Number.isSafeInteger(v) && v >= 0;
const count = (shape) => shape.reduce((a, b) => a * b, 1);

/** The arguments each schedule takes (numbers unless listed), as the Python package's. */
const SCHEDULE_ARGS = {
  StepLR: { step_size: 'count', gamma: 'number' },
  MultiStepLR: { milestones: 'counts', gamma: 'number' },
  ExponentialLR: { gamma: 'number' },
  CosineAnnealingLR: { T_max: 'positive', eta_min: 'number' },
  LinearLR: { start_factor: 'number', end_factor: 'number', total_iters: 'positive' },
  OneCycleLR: { max_lr: 'rates', total_steps: 'positive', pct_start: 'number', anneal_strategy: ['cos', 'linear'],
    div_factor: 'number', final_div_factor: 'number', three_phase: 'boolean' },
  WarmupCosineLR: { warmup_steps: 'nonneg', total_steps: 'positive', num_cycles: 'number' },
  WarmupLinearLR: { warmup_steps: 'nonneg', total_steps: 'positive', allow_warmup_past_total: 'boolean' },
};
const REQUIRED_ARGS = { StepLR: ['step_size'], MultiStepLR: ['milestones'], ExponentialLR: ['gamma'], CosineAnnealingLR: ['T_max'],
  OneCycleLR: ['max_lr', 'total_steps'], WarmupCosineLR: ['warmup_steps', 'total_steps'], WarmupLinearLR: ['warmup_steps', 'total_steps'] };

function argFits(kind, v) {
  if (Array.isArray(kind)) return kind.includes(v);
  switch (kind) {
    case 'count': return Number.isSafeInteger(v) && v > 0;
    case 'positive': return Number.isSafeInteger(v) && v > 0;
    case 'nonneg': return isCount(v);
    case 'counts': return Array.isArray(v) && v.every(isCount);
    case 'boolean': return typeof v === 'boolean';
    case 'rates': return (typeof v === 'number' && Number.isFinite(v) && v >= 0)
      || (isObject(v) && Object.values(v).every((r) => typeof r === 'number' && Number.isFinite(r) && r >= 0));
    default: return typeof v === 'number' && Number.isFinite(v);
  }
}

const KIND_TEXT = { count: 'a positive integer', positive: 'a positive integer', nonneg: 'a non-negative integer', counts: 'a list of non-negative integers',
  boolean: 'true or false', rates: 'a rate >= 0 or {input: rate}', number: 'a finite number' };

/**
 * A relative path inside the export location: not absolute, no "..", no URL scheme.
 * @throws {TrainerError} naming the manifest field
 */
export function checkRelativePath(path, field, where = 'manifest.json') {
  if (typeof path !== 'string' || path === '') throw new TrainerError(`${where}: ${field} must be a file name, found ${show(path)}`);
  const parts = path.split(/[/\\]/);
  if (/^[/\\]/.test(path) || /^[A-Za-z][A-Za-z0-9+.-]*:/.test(path) || parts.includes('..') || path.includes('\0')) {
    throw new TrainerError(`${where}: ${field} ${show(path)} must be a relative path inside the export directory `
      + '(not absolute, no "..", no URL)');
  }
  return path;
}

function need(condition, where, field, expected, found) {
  if (!condition) throw new TrainerError(`${where}: ${field} must be ${expected}, found ${show(found)}`);
}

function checkSpecs(list, field, where, { shapeNumbers = false } = {}) {
  need(Array.isArray(list), where, field, 'a list', list);
  const names = new Set();
  list.forEach((e, i) => {
    const at = `${field}[${i}]`;
    need(isObject(e), where, at, 'an object', e);
    need(typeof e.name === 'string' && e.name !== '', where, `${at}.name`, 'a string', e.name);
    if (names.has(e.name)) throw new TrainerError(`${where}: ${at}.name ${show(e.name)} appears twice in ${field}`);
    names.add(e.name);
    need(DTYPE_NAMES.includes(e.dtype), where, `${at}.dtype`, `one of ${DTYPE_NAMES.join(', ')}`, e.dtype);
    if (shapeNumbers) need(Array.isArray(e.shape) && e.shape.every(isCount), where, `${at}.shape`, 'a list of non-negative integers', e.shape);
    else {
      need(e.shape === null || (Array.isArray(e.shape) && e.shape.every((d) => isCount(d) || typeof d === 'string')),
        where, `${at}.shape`, 'null or a list of integers and dimension names', e.shape);
    }
  });
  return names;
}

function checkPacks(m, stateByName, where) {
  need(Array.isArray(m.packs), where, 'packs', 'null or a list', m.packs);
  const packed = new Set();
  m.packs.forEach((p, i) => {
    const at = `packs[${i}]`;
    need(isObject(p), where, at, 'an object', p);
    need(DTYPE_NAMES.includes(p.dtype), where, `${at}.dtype`, `one of ${DTYPE_NAMES.join(', ')}`, p.dtype);
    need(typeof p.input === 'string' && typeof p.output === 'string', where, `${at}.input/output`, 'strings', [p.input, p.output]);
    need(isCount(p.size), where, `${at}.size`, 'a non-negative integer', p.size);
    need(Array.isArray(p.members) && p.members.length > 0, where, `${at}.members`, 'a non-empty list', p.members);
    let end = 0;
    p.members.forEach((member, j) => {
      const mat = `${at}.members[${j}]`;
      need(isObject(member) && typeof member.name === 'string', where, mat, 'an object with a name', member);
      const spec = stateByName.get(member.name);
      if (!spec) throw new TrainerError(`${where}: ${mat}.name ${show(member.name)} is not a state variable`);
      if (packed.has(member.name)) throw new TrainerError(`${where}: ${mat}.name ${show(member.name)} is packed twice`);
      packed.add(member.name);
      need(spec.dtype === p.dtype, where, `${mat} (${member.name}) dtype`, `the pack's ${p.dtype}`, spec.dtype);
      need(Array.isArray(member.shape) && member.shape.length === spec.shape.length && member.shape.every((d, k) => d === spec.shape[k]),
        where, `${mat}.shape`, `the state's [${spec.shape}]`, member.shape);
      need(member.offset === end, where, `${mat}.offset`, `${end} (the end of the member before: no gap, no overlap)`, member.offset);
      end += count(spec.shape);
    });
    need(end === p.size, where, `${at}.size`, `${end} (the members' elements)`, p.size);
  });
  return packed;
}

function checkSchedule(m, stateByName, where) {
  const s = m.schedule;
  need(isObject(s), where, 'schedule', 'null or an object', s);
  need(s.type in SCHEDULES, where, 'schedule.type', `one of ${Object.keys(SCHEDULES).join(', ')}`, s.type);
  need(isObject(s.args), where, 'schedule.args', 'an object', s.args);
  const kinds = SCHEDULE_ARGS[s.type];
  for (const [key, value] of Object.entries(s.args)) {
    if (!(key in kinds)) throw new TrainerError(`${where}: schedule.args has ${show(key)}, which ${s.type} does not take; it takes ${Object.keys(kinds).join(', ')}`);
    need(argFits(kinds[key], value), where, `schedule.args.${key}`, KIND_TEXT[kinds[key]] ?? `one of ${show(kinds[key])}`, value);
  }
  for (const key of REQUIRED_ARGS[s.type] ?? []) need(key in s.args, where, `schedule.args.${key}`, `given (${s.type} needs it)`, undefined);
  need(typeof s.counter === 'string' && stateByName.has(s.counter), where, 'schedule.counter', 'the name of a state variable', s.counter);
  need(Number.isSafeInteger(s.step_offset), where, 'schedule.step_offset', 'an integer', s.step_offset);
}

/**
 * Check manifest.json's fields (types, names that refer to each other, paths, packs, schedule).
 * Fields added later (files' sha256, classes, ignore_index) are checked when present.
 * @throws {TrainerError} naming the field, what was expected and what was found
 */
export function validateManifest(m, where = 'manifest.json') {
  need(isObject(m), where, 'the manifest', 'a JSON object', m);
  need(m.format === 'onnx-training-ops/export', where, 'format', '"onnx-training-ops/export"', m.format);
  need(m.version === 1, where, 'version', '1 (the version this trainer reads)', m.version);
  need(isObject(m.files), where, 'files', 'an object', m.files);
  for (const key of ['step', 'state']) need(isObject(m.files[key]), where, `files.${key}`, 'an object with a path', m.files[key]);
  for (const [key, entry] of Object.entries(m.files)) {
    need(isObject(entry), where, `files.${key}`, 'an object with a path', entry);
    checkRelativePath(entry.path, `files.${key}.path`, where);
    if (entry.external_data !== undefined) checkRelativePath(entry.external_data, `files.${key}.external_data`, where);
    if (entry.sha256 !== undefined) need(typeof entry.sha256 === 'string' && /^[0-9a-f]{64}$/.test(entry.sha256), where, `files.${key}.sha256`, '64 lowercase hex digits', entry.sha256);
  }
  const inputs = checkSpecs(m.inputs, 'inputs', where);
  checkSpecs(m.eval_inputs ?? [], 'eval_inputs', where);
  checkSpecs(m.state, 'state', where, { shapeNumbers: true });
  const stateByName = new Map(m.state.map((e) => [e.name, e]));
  const rates = checkSpecs(m.learning_rates, 'learning_rates', where, { shapeNumbers: true });
  m.learning_rates.forEach((e, i) => {
    need(e.dtype === 'float32' || e.dtype === 'float64', where, `learning_rates[${i}].dtype`, 'float32 or float64', e.dtype);
    need(count(e.shape) === 1, where, `learning_rates[${i}].shape`, 'one element', e.shape);
    need(typeof e.base === 'number' && Number.isFinite(e.base) && e.base >= 0, where, `learning_rates[${i}].base`, 'a finite number >= 0', e.base);
  });
  if (m.defaults !== undefined && m.defaults !== null) {
    need(isObject(m.defaults), where, 'defaults', 'an object', m.defaults);
    for (const [name, d] of Object.entries(m.defaults)) {
      if (!inputs.has(name)) throw new TrainerError(`${where}: defaults.${name} names no input; inputs: ${[...inputs].join(', ')}`);
      need(isObject(d) && Array.isArray(d.shape) && d.shape.every(isCount) && Array.isArray(d.values) && d.values.length === count(d.shape),
        where, `defaults.${name}`, '{shape, values} with as many values as the shape holds', d);
    }
  }
  need(isObject(m.feedback), where, 'feedback', 'an object {state input: step output}', m.feedback);
  const outputs = new Set();
  for (const [name, output] of Object.entries(m.feedback)) {
    if (!stateByName.has(name)) throw new TrainerError(`${where}: feedback names ${show(name)}, which is not a state variable`);
    need(typeof output === 'string' && output !== '', where, `feedback[${show(name)}]`, 'the name of a step output', output);
    if (outputs.has(output)) throw new TrainerError(`${where}: feedback feeds output ${show(output)} to two state variables`);
    outputs.add(output);
  }
  const fed = m.state.filter((e) => !(e.name in m.feedback)).map((e) => e.name);
  if (fed.length) throw new TrainerError(`${where}: feedback has no entry for state ${fed.map(show).join(', ')} (each state variable is fed back once)`);
  for (const name of [...inputs, ...rates]) {
    if (stateByName.has(name)) throw new TrainerError(`${where}: ${show(name)} is both a data or rate input and a state variable`);
  }
  need(Array.isArray(m.returned) && m.returned.every((r) => typeof r === 'string'), where, 'returned', 'a list of output names', m.returned);
  need(m.eval_outputs === undefined || (Array.isArray(m.eval_outputs) && m.eval_outputs.every((r) => typeof r === 'string')),
    where, 'eval_outputs', 'a list of output names', m.eval_outputs);
  need(m.loss === null || m.loss === undefined || (typeof m.loss === 'string' && m.returned.includes(m.loss)), where, 'loss', `null or one of returned (${m.returned.join(', ')})`, m.loss);
  need(m.labels === null || m.labels === undefined || inputs.has(m.labels), where, 'labels', 'null or the name of an input', m.labels);
  if (m.counter !== null && m.counter !== undefined) {
    const c = stateByName.get(m.counter);
    need(c && c.dtype === 'int64' && count(c.shape) === 1, where, 'counter', 'null or the name of a one-element int64 state variable', m.counter);
  }
  if (m.packs !== null && m.packs !== undefined) checkPacks(m, stateByName, where);
  if (m.schedule !== null && m.schedule !== undefined) {
    checkSchedule(m, stateByName, where);
    need(m.schedule.counter === m.counter, where, 'schedule.counter', `the manifest's counter ${show(m.counter)}`, m.schedule.counter);
  }
  if (m.classes !== undefined && m.classes !== null) need(Number.isSafeInteger(m.classes) && m.classes > 0, where, 'classes', 'null or a positive integer', m.classes);
  if (m.ignore_index !== undefined && m.ignore_index !== null) need(Number.isSafeInteger(m.ignore_index), where, 'ignore_index', 'null or an integer', m.ignore_index);
  return m;
}

const sameShape = (a, b) => Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((d, i) => d === b[i]);

function metadataOf(session, which) {
  const list = session[`${which}Metadata`];
  if (!Array.isArray(list)) return new Map();
  return new Map(list.filter((e) => e && typeof e.name === 'string').map((e) => [e.name, e]));
}

/**
 * Check the step (and eval) model against the manifest: the step's inputs are exactly the data,
 * rate and state inputs, its outputs hold `returned` and every feedback output, and each state
 * input and its feedback output have the manifest's dtype and shape.
 * @param feedback {state input: output} of the step run (packs in place of their members)
 * @param shapes {state input: {dtype, shape}} of the step run
 * @throws {TrainerError} naming the file and the input or output
 */
export function validateModels(m, stepSession, evalSession, { feedback, shapes, stepFile, evalFile }) {
  const expected = new Set([...m.inputs.map((e) => e.name), ...m.learning_rates.map((e) => e.name), ...Object.keys(feedback)]);
  const given = new Set(stepSession.inputNames);
  const missing = [...expected].filter((n) => !given.has(n));
  const extra = [...given].filter((n) => !expected.has(n));
  if (missing.length || extra.length) {
    throw new TrainerError(`${stepFile}: the model's inputs do not fit manifest.json: `
      + `${missing.length ? `the manifest's ${missing.map(show).join(', ')} missing from the model` : ''}`
      + `${missing.length && extra.length ? '; ' : ''}${extra.length ? `the model's ${extra.map(show).join(', ')} unknown to the manifest` : ''}`
      + ' (is it the step model of this export?)');
  }
  const outputs = new Set(stepSession.outputNames);
  for (const name of m.returned) {
    if (!outputs.has(name)) throw new TrainerError(`${stepFile}: manifest.json returned names ${show(name)}, which is not an output of the step model`);
  }
  const ins = metadataOf(stepSession, 'input');
  const outs = metadataOf(stepSession, 'output');
  for (const [input, output] of Object.entries(feedback)) {
    if (!outputs.has(output)) throw new TrainerError(`${stepFile}: manifest.json feedback feeds ${show(input)} from ${show(output)}, which is not an output of the step model`);
    const want = shapes[input];
    for (const [meta, what] of [[ins.get(input), `input ${show(input)}`], [outs.get(output), `output ${show(output)} (fed back to ${show(input)})`]]) {
      if (!meta || !Array.isArray(meta.shape)) continue;
      if (meta.type !== want.dtype || !sameShape(meta.shape, want.shape)) {
        throw new TrainerError(`${stepFile}: ${what} is ${meta.type} [${meta.shape}] in the model, manifest.json says ${want.dtype} [${want.shape}]`);
      }
    }
  }
  for (const e of [...m.inputs, ...m.learning_rates]) {
    const meta = ins.get(e.name);
    if (meta && meta.type && meta.type !== e.dtype) throw new TrainerError(`${stepFile}: input ${show(e.name)} is ${meta.type} in the model, manifest.json says ${e.dtype}`);
  }
  if (evalSession) {
    const known = new Set([...(m.eval_inputs ?? []).map((e) => e.name), ...m.state.map((e) => e.name)]);
    const unknown = evalSession.inputNames.filter((n) => !known.has(n));
    if (unknown.length) throw new TrainerError(`${evalFile}: the model's inputs ${unknown.map(show).join(', ')} are neither eval_inputs nor state in manifest.json`);
    const evalOutputs = new Set(evalSession.outputNames);
    const absent = (m.eval_outputs ?? []).filter((n) => !evalOutputs.has(n));
    if (absent.length) throw new TrainerError(`${evalFile}: manifest.json eval_outputs ${absent.map(show).join(', ')} are not outputs of the eval model`);
  }
}

/**
 * The learning rates of one step from the caller's `lr` (a number, {input: rate}, or undefined
 * for `defaults`): finite numbers >= 0, one per rate input, no unknown names.
 * @throws {TrainerError}
 */
export function checkRates(lr, specs, defaults, what = 'step') {
  const names = specs.map((e) => e.name);
  let rates;
  if (lr === undefined) rates = defaults;
  else if (typeof lr === 'number') rates = Object.fromEntries(names.map((n) => [n, lr]));
  else if (isObject(lr)) {
    rates = lr;
    const unknown = Object.keys(lr).filter((n) => !names.includes(n));
    if (unknown.length) throw new TrainerError(`${what}: lr names ${unknown.map(show).join(', ')}, which is no learning-rate input; inputs: ${names.join(', ')}`);
  } else throw new TrainerError(`${what}: lr must be a number or {input: rate}, found ${show(lr)}`);
  for (const n of names) {
    if (!(n in rates)) throw new TrainerError(`${what}: no learning rate for ${show(n)}`);
    const v = rates[n];
    if (typeof v !== 'number' || !Number.isFinite(v) || v < 0) {
      throw new TrainerError(`${what}: the learning rate for ${show(n)} must be a finite number >= 0, found ${show(v)}`
        + `${lr === undefined ? ' (from the schedule in manifest.json)' : ''}`);
    }
  }
  return rates;
}

/**
 * Labels within [0, classes) or equal to ignore_index (when the manifest records classes).
 * @throws {TrainerError} naming the input, the value and the range
 */
export function checkLabels(m, feeds, what) {
  if (!m.labels || m.classes === undefined || m.classes === null) return;
  const t = feeds[m.labels];
  if (!t) return;
  const C = m.classes;
  const ignore = m.ignore_index ?? null;
  const data = t.data;
  for (let i = 0; i < data.length; i++) {
    const v = Number(data[i]);
    if (!(Number.isInteger(v) && ((v >= 0 && v < C) || v === ignore))) {
      throw new TrainerError(`${what}: input ${show(m.labels)} holds ${data[i]} at index ${i}; expected class indices in [0, ${C})`
        + `${ignore === null ? '' : ` or ignore_index ${ignore}`}`);
    }
  }
}

/**
 * The batch as an object of inputs: not null, not an array.
 * @throws {TrainerError}
 */
export function checkBatch(batch, what) {
  if (!isObject(batch)) throw new TrainerError(`${what}: the batch must be an object {input name: tensor or {data, dims}}, found ${show(batch)}`);
}

/**
 * Plain data for input `name`: {data: an array of numbers or a TypedArray, dims: non-negative
 * integers whose product is data's length}; integer inputs take integers only.
 * @throws {TrainerError} naming the input
 */
export function checkPlainValue(name, value, dtype, what) {
  const where = `${what}: input ${show(name)}`;
  if (!isObject(value) || !('data' in value)) {
    throw new TrainerError(`${where} must be an onnxruntime Tensor or {data, dims}, found ${show(value)}`);
  }
  const { data, dims } = value;
  if (!(Array.isArray(data) || (ArrayBuffer.isView(data) && !(data instanceof DataView)))) {
    throw new TrainerError(`${where}: data must be an array of numbers or a TypedArray, found ${show(data)}`);
  }
  if (!Array.isArray(dims) && !(ArrayBuffer.isView(dims) && !(dims instanceof DataView))) {
    throw new TrainerError(`${where}: dims must be a list of non-negative integers, found ${show(dims)}`);
  }
  const shape = Array.from(dims, Number);
  if (!shape.every(isCount)) throw new TrainerError(`${where}: dims must be non-negative integers, found [${shape}]`);
  if (count(shape) !== data.length) throw new TrainerError(`${where}: dims [${shape}] hold ${count(shape)} elements, data has ${data.length}`);
  if (Array.isArray(data)) {
    const integral = !dtype.startsWith('float');
    const bad = data.findIndex((v) => !(typeof v === 'bigint' || (typeof v === 'number' && (integral ? Number.isInteger(v) : true))));
    if (bad >= 0) throw new TrainerError(`${where}: element ${bad} is ${show(data[bad])}; ${dtype} takes ${integral ? 'integers' : 'numbers'}`);
  }
}

/**
 * A tensor that fits the manifest's spec: its dtype, its rank and static dims.
 * @throws {TrainerError} naming the input
 */
export function checkTensor(name, value, spec, what) {
  if (value.type !== spec.dtype) throw new TrainerError(`${what}: input ${show(name)} must be ${spec.dtype}, found ${value.type}`);
  const dims = value.dims;
  if (spec.shape && (!dims || dims.length !== spec.shape.length || spec.shape.some((d, i) => typeof d === 'number' && d !== dims[i]))) {
    throw new TrainerError(`${what}: input ${show(name)} must have shape [${spec.shape}], found [${dims}]`);
  }
}

/**
 * Each feedback output of the (unpacked) step model is computed from the state input it is fed
 * back to: catches swapped entries that shapes cannot tell apart (Adam's V and H of a tensor).
 * @throws {TrainerError} naming the file and the entry
 */
export function checkFeedbackFlow(m, stepBytes, stepFile) {
  let flow;
  try {
    flow = dataFlow(stepBytes);
  } catch (error) {
    if (error instanceof Damaged) throw new TrainerError(`${stepFile}: not a valid ONNX model (${error.message}): truncated or damaged`);
    throw error;
  }
  for (const [input, output] of Object.entries(m.feedback)) {
    if (!flow(output, input)) {
      throw new TrainerError(`${stepFile}: manifest.json feedback feeds ${show(input)} from ${show(output)}, which the step model `
        + `does not compute from ${show(input)} (swapped or foreign feedback entries)`);
    }
  }
}

/** The metadata key under which export_step records a step model's own feedback map. */
export const FEEDBACK_KEY = 'onnx_training_ops.feedback';

/**
 * The feedback the trainer will use (state input -> step output) against the one the step model
 * records (export_step writes it): a swap of equal-shaped entries that each depend on both inputs
 * (a parameter and its V) passes every other check. A model without a record is not checked.
 * @throws {TrainerError} naming the file and the first entry that differs
 */
export function checkFeedbackRecord(feedback, stepBytes, stepFile) {
  let recorded;
  try {
    recorded = metadataValue(stepBytes, FEEDBACK_KEY);
  } catch (error) {
    if (error instanceof Damaged) throw new TrainerError(`${stepFile}: not a valid ONNX model (${error.message}): truncated or damaged`);
    throw error;
  }
  if (recorded === null) return;
  let expected;
  try {
    expected = JSON.parse(recorded);
  } catch {
    throw new TrainerError(`${stepFile}: its ${FEEDBACK_KEY} metadata is not JSON`);
  }
  if (!isObject(expected)) throw new TrainerError(`${stepFile}: its ${FEEDBACK_KEY} metadata is not an object`);
  const names = [...new Set([...Object.keys(feedback), ...Object.keys(expected)])].sort();
  const wrong = names.filter((n) => feedback[n] !== expected[n]);
  if (wrong.length) {
    const n = wrong[0];
    throw new TrainerError(`${stepFile}: manifest.json feedback feeds ${show(n)} from ${show(feedback[n])}, but the step model `
      + `feeds it from ${show(expected[n])} (${wrong.length} entr${wrong.length === 1 ? 'y' : 'ies'} differ: swapped, dropped or foreign feedback entries)`);
  }
}
