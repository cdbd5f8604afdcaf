// Faults a user or an attacker can hand the trainer (issue 29 items 1, 4, 5, 11-17; issue 32
// item 3): each gives a TrainerError naming the file, field or input, never a raw
// TypeError/SyntaxError/RangeError, never a hang, and nothing changes on failure. Manifests
// with the additive fields of notes/MANIFEST.md (sha256, classes, ignore_index) are written
// here with node:crypto from the fixtures Python wrote; a manifest without them still loads.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { cp, mkdtemp, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import * as ort from 'onnxruntime-node';
import { Trainer, TrainerError, decodeSafetensors, encodeSafetensors, readExport } from '../src/index.js';
import { sha256Plain } from '../src/sha256.js';
import { FIXTURES, read } from './helpers.js';
import { batchAt } from './parity.js';

const hex = (bytes) => createHash('sha256').update(bytes).digest('hex');
const work = await mkdtemp(join(tmpdir(), 'oto-fault-'));
let copies = 0;

/** The manifest without the files' sha256 (as an older export's): the checks behind the digest are reached. */
function withoutDigests(manifest) {
  for (const entry of Object.values(manifest.files)) delete entry.sha256;
  return manifest;
}

/** A copy of fixture `name`'s export, its manifest without digests (`withChecks` adds them);
 * `change(manifest, dir)` edits its manifest (and files) in place. */
async function exportCopy(name, change = () => {}) {
  const dir = join(work, `${name}-${copies++}`);
  await cp(join(FIXTURES, name, 'export'), dir, { recursive: true });
  const manifest = withoutDigests(JSON.parse(await readFile(join(dir, 'manifest.json'), 'utf8')));
  const changed = (await change(manifest, dir)) ?? manifest;
  await writeFile(join(dir, 'manifest.json'), typeof changed === 'string' ? changed : JSON.stringify(changed));
  return dir;
}

/** The manifest fields of notes/MANIFEST.md, computed here: each file's sha256, classes, ignore_index. */
async function withChecks(manifest, dir, { classes = 10, ignoreIndex = null } = {}) {
  for (const entry of Object.values(manifest.files)) entry.sha256 = hex(await readFile(join(dir, entry.path)));
  manifest.classes = classes;
  manifest.ignore_index = ignoreIndex;
  return manifest;
}

const mlpBatch = async () => batchAt(ort, decodeSafetensors(await read('mlp/batches.safetensors')).tensors, 0);

/** Loading `dir` fails with a TrainerError whose message matches `pattern`. */
async function refused(dir, pattern, options) {
  await assert.rejects(Trainer.load(ort, dir, options), (error) => {
    assert.ok(error instanceof TrainerError, `a TrainerError, found ${error?.name}: ${error?.message}`);
    assert.match(error.message, pattern);
    return true;
  });
}

after(() => rm(work, { recursive: true, force: true }));

test('1: manifest fields are validated, a truncated manifest or state header names the file', async () => {
  const cases = [
    [(m) => { delete m.files; }, /manifest\.json: files must be an object, found undefined/],
    [(m) => { delete m.files.state; }, /files\.state must be an object with a path, found undefined/],
    [(m) => { delete m.feedback; }, /feedback must be an object \{state input: step output\}, found undefined/],
    [(m) => { m.feedback = Object.entries(m.feedback); }, /feedback must be an object/],
    [(m) => { m.feedback.nosuch = 'W0.new'; }, /feedback names "nosuch", which is not a state variable/],
    [(m) => { delete m.schedule.counter; }, /schedule\.counter must be the name of a state variable, found undefined/],
    [(m) => { m.schedule.step_offset = '5'; }, /schedule\.step_offset must be an integer, found "5"/],
    [(m) => { m.schedule.step_offset = 1.5; }, /schedule\.step_offset must be an integer, found 1\.5/],
    [(m) => { m.schedule.args = { bogus: 2 }; }, /schedule\.args has "bogus", which StepLR does not take/],
    [(m) => { m.schedule.args.gamma = 'half'; }, /schedule\.args\.gamma must be a finite number, found "half"/],
    [(m) => { m.schedule.type = 'FastLR'; }, /schedule\.type must be one of StepLR/],
    [(m) => { m.inputs = 'input'; }, /inputs must be a list, found "input"/],
    [(m) => { m.state[0].shape = ['N']; }, /state\[0\]\.shape must be a list of non-negative integers/],
    [(m) => { m.returned = 'loss'; }, /returned must be a list of output names/],
    [(m) => { m.version = 2; }, /version must be 1/],
    [(m) => { m.files.constants = { path: 'constants.data' }; }, /keeps its weights in "constants\.data" \(a model past 2 GB/],
    [(m) => JSON.stringify(m).slice(0, 200), /manifest\.json: not valid JSON .*truncated/],
  ];
  for (const [change, pattern] of cases) await refused(await exportCopy('cnn', change), pattern);
  const truncated = await exportCopy('mlp', async (m, dir) => {
    const state = await readFile(join(dir, 'state.safetensors'));
    await writeFile(join(dir, 'state.safetensors'), state.subarray(0, 100));
  });
  await refused(truncated, /state\.safetensors: not a safetensors file \(header length \d+, file 100 bytes\)/);
  const garbled = await exportCopy('mlp', async (m, dir) => {
    const state = await readFile(join(dir, 'state.safetensors'));
    state[20] = 0xff;
    await writeFile(join(dir, 'state.safetensors'), state);
  });
  await refused(garbled, /state\.safetensors: the safetensors header is not JSON/);
});

test('4: paths in the manifest stay inside the export directory (relative, no "..", no link out)', async () => {
  const outside = await exportCopy('mlp');
  for (const path of ['../other/state.safetensors', join(outside, 'state.safetensors'), 'file:///etc/passwd', 'a/../../state.safetensors']) {
    await refused(await exportCopy('mlp', (m) => { m.files.state.path = path; }), /files\.state\.path .* must be a relative path inside the export directory/);
  }
  const linked = await exportCopy('mlp', async (m, dir) => {
    await rm(join(dir, 'state.safetensors'));
    await symlink(join(outside, 'state.safetensors'), join(dir, 'state.safetensors'));
  });
  await refused(linked, /state\.safetensors: the file lies outside the export directory/);
  // a link that stays inside is fine
  const inside = await exportCopy('mlp', async (m, dir) => {
    await cp(join(dir, 'state.safetensors'), join(dir, 'real.safetensors'));
    await rm(join(dir, 'state.safetensors'));
    await symlink('real.safetensors', join(dir, 'state.safetensors'));
  });
  await (await Trainer.load(ort, inside)).release();
});

test('5: labels are checked against the manifest\'s classes and ignore_index before a step', async () => {
  const dir = await exportCopy('mlp', (m, d) => withChecks(m, d));
  const trainer = await Trainer.load(ort, dir);
  const batch = await mlpBatch();
  const before = trainer.exportState();
  for (const bad of [99n, 10n, -1n]) {
    const labels = new ort.Tensor('int64', BigInt64Array.from(batch.labels.data, (v, i) => (i === 5 ? bad : v)), [32]);
    await assert.rejects(trainer.step({ ...batch, labels }), new RegExp(`step: input "labels" holds ${bad} at index 5; expected class indices in \\[0, 10\\)$`));
    await assert.rejects(trainer.evaluate({ ...batch, labels }), /evaluate: input "labels" holds/);
  }
  assert.deepEqual(trainer.exportState(), before);
  await trainer.step(batch);
  const ignoring = await Trainer.load(ort, await exportCopy('mlp', (m, d) => withChecks(m, d, { ignoreIndex: -1 })));
  const labels = new ort.Tensor('int64', BigInt64Array.from(batch.labels.data, (v, i) => (i === 5 ? -1n : v)), [32]);
  await ignoring.step({ ...batch, labels });  // the check lets ignore_index through
  await assert.rejects(ignoring.step({ ...batch, labels: new ort.Tensor('int64', BigInt64Array.from(batch.labels.data, (v, i) => (i === 5 ? -2n : v)), [32]) }),
    /holds -2 at index 5; expected class indices in \[0, 10\) or ignore_index -1/);
  // an older export (no classes in its manifest) is not checked
  const older = await Trainer.load(ort, await exportCopy('mlp', (m) => { delete m.classes; delete m.ignore_index; }));
  await older.step({ ...batch, labels });
  for (const bad of [0, 2.5, 'ten']) await refused(await exportCopy('mlp', (m) => { m.classes = bad; }), /manifest\.json: classes must be null or a positive integer/);
});

/** A safetensors file from a header object and data bytes. */
function rawSafetensors(header, data) {
  const text = new TextEncoder().encode(JSON.stringify(header));
  const out = new Uint8Array(8 + text.length + data.length);
  new DataView(out.buffer).setBigUint64(0, BigInt(text.length), true);
  out.set(text, 8);
  out.set(data, 8 + text.length);
  return out;
}

test('11: decode refuses overlapping, shifted, out-of-range, reversed offsets and sizes that do not fit', async () => {
  const data = new Uint8Array(32);
  const ok = { a: { dtype: 'F32', shape: [4], data_offsets: [0, 16] }, b: { dtype: 'F32', shape: [4], data_offsets: [16, 32] } };
  assert.deepEqual(Object.keys(decodeSafetensors(rawSafetensors(ok, data)).tensors), ['a', 'b']);
  // tensors listed out of offset order are fine when they tile the data (as Python reads them)
  assert.deepEqual(Object.keys(decodeSafetensors(rawSafetensors({ b: ok.b, a: ok.a }, data)).tensors), ['b', 'a']);
  const cases = [
    [{ a: ok.a, b: { ...ok.b, data_offsets: [8, 24] } }, data, /tensor "b" starts at byte 8 of the data, expected 16: tensors must not overlap or leave gaps/],
    [{ a: ok.a, b: { ...ok.b, data_offsets: [0, 16] } }, new Uint8Array(16), /tensor "b" starts at byte 0 .*expected 16/],
    [{ a: { ...ok.a, data_offsets: [4, 20] }, b: { ...ok.b, data_offsets: [20, 36] } }, new Uint8Array(36), /tensor "a" starts at byte 4 of the data, expected 0/],
    [{ a: ok.a, b: { ...ok.b, data_offsets: [16, 48] } }, data, /tensor "b": F32 \[4\] needs 16 bytes, data_offsets \[16, 48\] \(the data holds 32 bytes\)/],
    [{ a: ok.a, b: { ...ok.b, data_offsets: [32, 16] } }, data, /tensor "b": F32 \[4\] needs 16 bytes, data_offsets \[32, 16\]/],
    [{ a: ok.a, b: { ...ok.b, shape: [2, 3] } }, data, /tensor "b": F32 \[2,3\] needs 24 bytes/],
    [{ a: ok.a, b: { ...ok.b, dtype: 'F64' } }, data, /tensor "b": F64 \[4\] needs 32 bytes/],
    [{ a: ok.a, b: { ...ok.b, shape: [-4] } }, data, /tensor "b": a malformed header entry/],
    [{ a: ok.a, b: { ...ok.b, data_offsets: '16-32' } }, data, /tensor "b": a malformed header entry/],
    [{ a: ok.a }, data, /16 bytes after the last tensor/],
    [{ __metadata__: 'x', ...ok }, data, /__metadata__ must be an object of strings, found "x"/],
    [[1, 2], data, /the safetensors header is not a JSON object/],
  ];
  for (const [header, bytes, pattern] of cases) {
    assert.throws(() => decodeSafetensors(rawSafetensors(header, bytes), 'x.safetensors'), (e) => e instanceof TrainerError && pattern.test(e.message)
      && e.message.startsWith('x.safetensors: '), `${JSON.stringify(header)} -> ${pattern}`);
  }
  for (const bytes of [new Uint8Array(3), Uint8Array.of(255, 255, 255, 255, 255, 255, 255, 255, 1), null, 'text']) {
    assert.throws(() => decodeSafetensors(bytes, 'x.safetensors'), (e) => e instanceof TrainerError && e.message.startsWith('x.safetensors: '));
  }
});

test('12: the manifest is checked against the models it loads', async () => {
  const cases = [
    ['mlp', (m) => { m.feedback.W0 = 'nosuch.new'; }, /step\.packed\.onnx: manifest\.json feedback feeds .*"nosuch\.new", which is not an output|step\.onnx: manifest\.json feedback feeds "W0" from "nosuch\.new"/, { packed: false }],
    ['mlp', (m) => { m.files.step.path = 'eval.onnx'; }, /eval\.onnx: the model's inputs do not fit manifest\.json: the manifest's "learning_rate", "W0\.V".* missing from the model \(is it the step model of this export\?\)/, { packed: false }],
    ['mlp', (m) => { delete m.feedback.b1; }, /feedback has no entry for state "b1"/],
    ['mlp', (m) => { m.feedback.extra = 'W0.new'; }, /feedback names "extra", which is not a state variable/],
    ['mlp', (m) => { m.feedback.b0 = 'b1.new'; }, /feedback feeds output "b1\.new" to two state variables/],
    ['mlp', (m) => { [m.feedback.W0, m.feedback.b0] = [m.feedback.b0, m.feedback.W0]; }, /step\.onnx: output "b0\.new" \(fed back to "W0"\) is float32 \[128\] in the model, manifest\.json says float32 \[64,128\]/, { packed: false }],
    ['mlp', (m) => { m.state[1].shape = [127]; m.packs = null; }, /step\.onnx: input "b0" is float32 \[128\] in the model, manifest\.json says float32 \[127\]/],
    ['mlp', (m) => { m.state[0].dtype = 'float64'; m.packs = null; }, /input "W0" is float32 \[64,128\] in the model, manifest\.json says float64 \[64,128\]/, { packed: false }],
    // same shapes, told apart by the data flow of step.onnx (checked with the packed step too)
    ['mlp', (m) => { [m.feedback['W0.V'], m.feedback['W0.H']] = [m.feedback['W0.H'], m.feedback['W0.V']]; },
      /step\.onnx: manifest\.json feedback feeds "W0\.V" from "W0\.H\.new", which the step model does not compute from "W0\.V" \(swapped or foreign feedback entries\)/],
    // same shapes, each output computed from both inputs: told apart by the feedback step.onnx records
    ['mlp', (m) => { [m.feedback.W0, m.feedback['W0.V']] = [m.feedback['W0.V'], m.feedback.W0]; },
      /step\.onnx: manifest\.json feedback feeds "W0" from "W0\.V\.new", but the step model feeds it from "W0\.new"/, { packed: false }],
    ['cnn', (m) => { [m.feedback['bn.mean'], m.feedback['bn.var']] = [m.feedback['bn.var'], m.feedback['bn.mean']]; }, /feeds "bn\.mean" from "train\/n1\/Add_1", which the step model does not compute from "bn\.mean"/],
    ['mlp', (m) => { m.packs[0].members[1].offset += 1; }, /packs\[0\]\.members\[1\]\.offset must be 8192 \(the end of the member before: no gap, no overlap\), found 8193/],
    ['mlp', (m) => { m.packs[0].members[1].offset -= 1; }, /members\[1\]\.offset must be 8192 .*found 8191/],
    ['mlp', (m) => { m.packs[0].members[3].shape = [11]; }, /packs\[0\]\.members\[3\]\.shape must be the state's \[10\], found \[11\]/],
    ['mlp', (m) => { m.packs[0].size += 1; }, /packs\[0\]\.size must be 28830 \(the members' elements\), found 28831/],
    ['mlp', (m) => {
      m.packs[0].size += 10;
      m.packs[0].members[3].shape = [20];
      m.state[3].shape = [20];
      for (const member of m.packs[0].members.slice(4)) member.offset += 10;
    }, /step\.packed\.onnx: input "state\.float32" is float32 \[28830\] in the model, manifest\.json says float32 \[28840\]/],
  ];
  for (const [name, change, pattern, options] of cases) await refused(await exportCopy(name, change), pattern, options);
});

test('13: learning rates are validated: per step, and the manifest\'s base and schedule position at load', async () => {
  const trainer = await Trainer.load(ort, join(FIXTURES, 'cnn', 'export'));
  const batch = batchAt(ort, decodeSafetensors(await read('cnn/batches.safetensors')).tensors, 0);
  const before = trainer.exportState();
  for (const lr of [NaN, Infinity, -1, 'abc', null, { learning_rate: NaN }, { learning_rate: '0.1' }]) {
    await assert.rejects(trainer.step(batch, { lr }), (e) => e instanceof TrainerError && /step: (the learning rate for "learning_rate" must be a finite number >= 0|lr must be a number or \{input: rate\})/.test(e.message), String(lr));
  }
  assert.deepEqual(trainer.exportState(), before);
  assert.equal(trainer.scheduleStep, 0);
  await refused(await exportCopy('cnn', (m) => { m.learning_rates[0].base = 'fast'; }), /learning_rates\[0\]\.base must be a finite number >= 0, found "fast"/);
  await refused(await exportCopy('cnn', (m) => { m.learning_rates[0].base = -0.1; }), /learning_rates\[0\]\.base must be a finite number >= 0/);
  assert.throws(() => trainer.setSchedule({ lr: 5 }), /setSchedule: expected a schedule \(an object with lr\(base, k\)\) or null, found \{"lr":5\}/);
  assert.throws(() => trainer.setSchedule(null, -3), /setSchedule: step must be an integer >= 0, found -3/);
  await assert.rejects(Trainer.load({}, join(FIXTURES, 'cnn', 'export')), /the first argument must be the onnxruntime module/);
  await refused(await exportCopy('cnn', (m) => { m.schedule.step_offset = -1000; }), /state\.safetensors: the schedule's step is -1000 \(update count 0 \+ manifest\.json schedule\.step_offset -1000\); expected >= 0/);
});

test('14: inferenceModel() on a damaged or foreign inference.onnx is an error naming the file, never a hang', async () => {
  const bytes = await read('mlp/export/inference.onnx');
  const files = await readExport(join(FIXTURES, 'mlp', 'export'));
  withoutDigests(files.manifest);  // what the loader reads behind a digest that would refuse these first
  for (let cut = 1; cut <= 12; cut++) {
    const trainer = await Trainer.create(ort, { ...files, inference: bytes.subarray(0, bytes.length - cut) });
    assert.throws(() => trainer.inferenceModel(), (e) => e instanceof TrainerError && /^inference\.onnx: not a valid ONNX model \(.*\): truncated or damaged$/.test(e.message), `cut ${cut}`);
  }
  for (const foreign of [await read('cnn/export/inference.onnx'), await read('mlp/export/state.safetensors'), new Uint8Array(100).fill(0xff)]) {
    const trainer = await Trainer.create(ort, { ...files, inference: foreign });
    assert.throws(() => trainer.inferenceModel(), (e) => e instanceof TrainerError && e.message.startsWith('inference.onnx: '));
  }
  // another model's file whose initializer names fit but shapes do not
  const other = await Trainer.create(ort, { ...(await readExport(join(FIXTURES, 'example'))) });
  const mlp = await Trainer.create(ort, { ...files, inference: other.inferenceBytes });
  assert.throws(() => mlp.inferenceModel(), /inference\.onnx: initializer "\w+" is float32 \[[\d,]+\] \(\d+ bytes\); the state holds float32 of \d+ bytes/);
});

test('15: concurrent step() and evaluate() calls run one after another, in call order', async () => {
  const data = decodeSafetensors(await read('mlp/batches.safetensors')).tensors;
  const [b1, b2] = [batchAt(ort, data, 0), batchAt(ort, data, 1)];
  const together = await Trainer.load(ort, join(FIXTURES, 'mlp', 'export'));
  const one = await Trainer.load(ort, join(FIXTURES, 'mlp', 'export'));
  const [r1, e1, r2, bad, e2] = await Promise.allSettled([together.step(b1), together.evaluate(b2), together.step(b2), together.step(null), together.evaluate(b2)]);
  assert.equal(together.scheduleStep, 2);
  assert.equal(bad.status, 'rejected');  // a refused call does not stop the queue
  const s1 = await one.step(b1);
  const f1 = await one.evaluate(b2);
  const s2 = await one.step(b2);
  const f2 = await one.evaluate(b2);
  assert.deepEqual([r1.value.loss, e1.value.loss, r2.value.loss, e2.value.loss], [s1.loss, f1.loss, s2.loss, f2.loss]);
  assert.deepEqual(together.exportState(), one.exportState());
});

test('16: bad batches give a TrainerError naming the input', async () => {
  const trainer = await Trainer.load(ort, join(FIXTURES, 'mlp', 'export'));
  const batch = await mlpBatch();
  const before = trainer.exportState();
  const cases = [
    [null, /step: the batch must be an object \{input name: tensor or \{data, dims\}\}, found null/],
    [[batch.input], /step: the batch must be an object/],
    [{ ...batch, input: null }, /step: input "input" must be an onnxruntime Tensor or \{data, dims\}, found null/],
    [{ ...batch, input: 5 }, /step: input "input" must be an onnxruntime Tensor or \{data, dims\}, found 5/],
    [{ ...batch, input: { data: 'abc', dims: [1] } }, /step: input "input": data must be an array of numbers or a TypedArray, found "abc"/],
    [{ ...batch, input: { data: batch.input.data, dims: [32, 65] } }, /step: input "input": dims \[32,65\] hold 2080 elements, data has 2048/],
    [{ ...batch, input: { data: batch.input.data, dims: 'N' } }, /step: input "input": dims must be a list of non-negative integers/],
    [{ ...batch, labels: { data: [1.5, ...Array(31).fill(0)], dims: [32] } }, /step: input "labels": element 0 is 1\.5; int64 takes integers/],
    [{ ...batch, labels: { data: ['a', ...Array(31).fill(0)], dims: [32] } }, /step: input "labels": element 0 is "a"/],
    [{ input: batch.input }, /step: batch has no "labels"; needs input, labels/],
    [{ ...batch, labels: new ort.Tensor('int32', new Int32Array(32), [32]) }, /step: input "labels" must be int64, found int32/],
    [{ ...batch, input: new ort.Tensor('float32', new Float32Array(32 * 63), [32, 63]) }, /step: input "input" must have shape \[N,64\], found \[32,63\]/],
  ];
  for (const [b, pattern] of cases) {
    await assert.rejects(trainer.step(b), (e) => e instanceof TrainerError && pattern.test(e.message), String(pattern));
  }
  await assert.rejects(trainer.evaluate(undefined), /evaluate: the batch must be an object/);
  assert.deepEqual(trainer.exportState(), before);
});

test('17: each file\'s sha256 in the manifest and the state\'s sha256 metadata are checked; verify: false skips', async () => {
  const good = await exportCopy('mlp', (m, d) => withChecks(m, d));
  await (await Trainer.load(ort, good)).release();
  for (const [file, at] of [['step.packed.onnx', 1000], ['state.safetensors', -10], ['eval.onnx', 500], ['inference.onnx', 50]]) {
    const dir = await exportCopy('mlp', async (m, d) => {
      await withChecks(m, d);
      const bytes = await readFile(join(d, file));
      bytes[at < 0 ? bytes.length + at : at] ^= 0x01;
      await writeFile(join(d, file), bytes);
    });
    await refused(dir, new RegExp(`^${file.replace('.', '\\.')}: the SHA-256 of the file differs from manifest\\.json's files\\.\\w+\\.sha256 \\(expected [0-9a-f]{64}, found [0-9a-f]{64}\\)`));
    if (file === 'state.safetensors') await (await Trainer.load(ort, dir, { verify: false })).release();  // a flipped weight: loads unchecked
  }
  // the state's own digest: exportState writes it, loadState checks it
  const trainer = await Trainer.load(ort, good);
  await trainer.step(await mlpBatch());
  const state = trainer.exportState();
  const flipped = state.slice();
  flipped[flipped.length - 7] ^= 0x10;
  const before = trainer.exportState();
  assert.throws(() => trainer.loadState(flipped), /loadState: the SHA-256 of the tensor data differs from __metadata__\.sha256 \(expected [0-9a-f]{64}, found [0-9a-f]{64}\): the file is damaged/);
  assert.deepEqual(trainer.exportState(), before);
  trainer.loadState(flipped, { verify: false });
  trainer.loadState(state);
  assert.deepEqual(trainer.exportState(), state);
  // a state file without a digest (older writers) still loads
  const { tensors } = decodeSafetensors(state);
  trainer.loadState(encodeSafetensors(tensors, { format: 'onnx-training-ops/export' }));
  // for tests/test_fault_js.py: Python's hashlib checks the digest written here
  await writeFile(join(FIXTURES, 'mlp', 'js_exported_state.safetensors'), state);
});

test('17: the plain-JavaScript SHA-256 (browsers without crypto.subtle) equals node:crypto\'s', () => {
  for (const n of [0, 1, 55, 56, 63, 64, 65, 119, 120, 1000, 70001]) {
    const bytes = Uint8Array.from({ length: n }, (_, i) => (i * 7919 + n) % 251);
    assert.equal(sha256Plain(bytes), hex(bytes), `${n} bytes`);
  }
});

test('issue 32 #3: Trainer.load takes a path, a file: URL string or URL object; a missing or corrupt file is named', async () => {
  const dir = join(FIXTURES, 'mlp', 'export');
  for (const location of [dir, `${dir}/`, pathToFileURL(dir).href, pathToFileURL(`${dir}/`), new URL(`file://${dir}`)]) {
    const trainer = await Trainer.load(ort, location);
    assert.equal(trainer.manifest.files.step.path, 'step.onnx', String(location));
    await trainer.release();
  }
  await refused(join(work, 'nowhere'), /nowhere\/manifest\.json: cannot read the file \(ENOENT\)/);
  await refused(pathToFileURL(join(work, 'nowhere')), /nowhere\/manifest\.json: cannot read the file \(ENOENT\)/);
  for (const location of [null, 42, '', {}]) await refused(location, /Trainer\.load: location must be a path or URL \(string or URL\)/);
  await refused(await exportCopy('mlp', async (m, d) => rm(join(d, 'eval.onnx'))), /eval\.onnx: cannot read the file \(ENOENT\)/);
  await refused(await exportCopy('mlp', async (m, d) => writeFile(join(d, 'step.packed.onnx'), 'not a model')), /step\.packed\.onnx: onnxruntime cannot load the model/);
});
