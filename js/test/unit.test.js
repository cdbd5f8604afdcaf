// The trainer's own behaviour: the state file's bytes, resume, schedules against Python, errors.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { createHash } from 'node:crypto';
import * as ort from 'onnxruntime-node';
import { Trainer, NonFiniteLossError, decodeSafetensors, encodeSafetensors, schedules } from '../src/index.js';
import { FIXTURES, read } from './helpers.js';
import { batchAt } from './parity.js';

const load = (name, options) => Trainer.load(ort, join(FIXTURES, name, 'export'), options);
const batches = async (name) => decodeSafetensors(await read(`${name}/batches.safetensors`)).tensors;

test('the state exported untouched is the exported file, byte for byte (same layout as Python)', async () => {
  for (const name of ['mlp', 'bert', 'cnn']) {
    const trainer = await load(name);
    const file = await read(`${name}/export/state.safetensors`);
    const { tensors, metadata } = decodeSafetensors(file);
    assert.deepEqual(encodeSafetensors(tensors, metadata), file);
    // exportState adds the data section's SHA-256 to the metadata (after "format"); an export
    // written with it (MANIFEST.md item 2) is reproduced byte for byte
    const { format } = metadata;
    assert.deepEqual(trainer.exportState(), encodeSafetensors(tensors, { format }, { sha256: true }), name);
    if (metadata.sha256) assert.deepEqual(trainer.exportState(), file, name);
    const exported = decodeSafetensors(trainer.exportState());
    assert.equal(exported.metadata.sha256, createHash('sha256').update(file.subarray(8 + Number(new DataView(file.buffer, file.byteOffset).getBigUint64(0, true)))).digest('hex'));
  }
});

test('resume: 60 steps, export, load in a new trainer, 60 more = 120 uninterrupted steps, bit for bit', async () => {
  const data = await batches('bert');
  const whole = await load('bert');
  const first = await load('bert');
  const losses = [];
  for (let i = 0; i < 120; i++) losses.push((await whole.step(batchAt(ort, data, i % 8))).loss);
  for (let i = 0; i < 60; i++) assert.equal((await first.step(batchAt(ort, data, i % 8))).loss, losses[i]);
  const second = await load('bert');
  second.loadState(first.exportState());
  assert.equal(second.scheduleStep, 60);
  for (let i = 60; i < 120; i++) assert.equal((await second.step(batchAt(ort, data, i % 8))).loss, losses[i]);
  assert.deepEqual(second.exportState(), whole.exportState());
});

test('every schedule gives Python\'s rate at every step (the float32 fed exactly; float64 within 1e-12)', async () => {
  const table = JSON.parse(new TextDecoder().decode(await read('schedules.json')));
  assert.equal(new Set(table.map((s) => s.type)).size, Object.keys(schedules.SCHEDULES).length);
  for (const { type, args, bases, rates } of table) {
    const schedule = schedules.fromJSON({ type, args });
    assert.deepEqual(schedules.toJSON(schedule).type, type);
    for (const [name, expected] of Object.entries(rates)) {
      expected.forEach((rate, k) => {
        const got = schedule.lr(bases[name], k, name);
        // libm's and V8's cos differ in the last bits; 1 + cos(x) near its zero magnifies that
        assert.ok(Math.abs(got - rate) <= Math.abs(rate) * 1e-12, `${type} ${name} step ${k}: ${got} vs ${rate}`);
        assert.equal(Math.fround(got), Math.fround(rate), `${type} ${name} step ${k} (the float32 fed)`);
      });
    }
  }
});

test('a NaN loss raises and leaves the state as it was; "skip" counts it', async () => {
  const data = await batches('mlp');
  const batch = batchAt(ort, data, 0);
  const input = new ort.Tensor('float32', Float32Array.from(batch.input.data, (v, i) => (i === 3 ? NaN : v)), batch.input.dims);
  const trainer = await load('mlp');
  const before = trainer.exportState();
  await assert.rejects(trainer.step({ ...batch, input }), NonFiniteLossError);
  assert.deepEqual(trainer.exportState(), before);
  const skipping = await load('mlp', { onNonFinite: 'skip' });
  await skipping.step({ ...batch, input });
  assert.equal(skipping.skippedSteps, 1);
  assert.equal(skipping.scheduleStep, 0);
  assert.deepEqual(skipping.exportState(), before);
});

test('bad batches are named: a missing input, a wrong dtype, a wrong static dim, an unknown input', async () => {
  const trainer = await load('mlp');
  const batch = batchAt(ort, await batches('mlp'), 0);
  await assert.rejects(trainer.step({ input: batch.input }), /batch has no "labels"/);
  await assert.rejects(trainer.step({ ...batch, labels: new ort.Tensor('int32', new Int32Array(32), [32]) }), /"labels" must be int64, found int32/);
  await assert.rejects(trainer.step({ ...batch, input: new ort.Tensor('float32', new Float32Array(32 * 63), [32, 63]) }), /"input" must have shape \[N,64\], found \[32,63\]/);
  await assert.rejects(trainer.step({ ...batch, extra: batch.input }), /unknown input "extra"/);
  // plain data is converted to the input's dtype (labels to BigInt64Array)
  const labels = trainer.tensor('labels', Array.from(batch.labels.data, Number), [32]);
  assert.equal(labels.type, 'int64');
  const a = await (await load('mlp')).step(batch);
  const b = await trainer.step({ input: { data: batch.input.data, dims: batch.input.dims }, labels });
  assert.equal(a.loss, b.loss);
});

test('the learning rate is fed: lr 0 leaves the weights, an explicit lr overrides the schedule', async () => {
  const trainer = await load('cnn');
  const batch = batchAt(ort, await batches('cnn'), 0);
  const weights = trainer.state['conv1.w'].data.slice();
  await trainer.step(batch, { lr: 0 });
  assert.deepEqual(trainer.state['conv1.w'].data, weights);
  await trainer.step(batch, { lr: 0.5 });
  assert.notDeepEqual(trainer.state['conv1.w'].data, weights);
  assert.equal(trainer.scheduleStep, 2);
  await assert.rejects(trainer.step(batch, { lr: { nope: 1 } }), /lr names "nope", which is no learning-rate input; inputs: learning_rate/);
});

test('loadState names what does not fit', async () => {
  const trainer = await load('mlp');
  await assert.rejects(async () => trainer.loadState(await read('cnn/export/state.safetensors')), /loadState: missing \["W0"/);
  const { tensors } = decodeSafetensors(await read('mlp/export/state.safetensors'));
  tensors.W0 = { dtype: 'float32', dims: [2, 2], data: new Float32Array(4) };
  assert.throws(() => trainer.loadState(encodeSafetensors(tensors)), /W0 must be float32 \[64,128\], found float32 \[2,2\]/);
});
