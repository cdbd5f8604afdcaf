// The three test models trained in onnxruntime-node against Python's per-step losses.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { decodeSafetensors } from '../src/index.js';
import { FIXTURES, read } from './helpers.js';
import { MODELS, TOLERANCE, trainFixture } from './parity.js';

for (const name of MODELS) {
  test(`${name}: every step's loss matches Python's TrainingSession in onnxruntime-node`, async () => {
    const r = await trainFixture(ort, read, join(FIXTURES, name, 'export'), name);
    // the per-variable step and the packed one (the default when exported) step alike. Not always
    // bit for bit: onnxruntime may fuse the two graphs differently (the CNN's BatchNorm running
    // mean differs in its last bit after a few steps), so within float32 rounding
    const plain = await trainFixture(ort, read, join(FIXTURES, name, 'export'), name, { packed: false });
    assert.equal(plain.losses.length, r.losses.length);
    plain.losses.forEach((loss, i) => assert.ok(Math.abs(loss - r.losses[i]) <= 1e-6 * Math.abs(r.losses[i]),
      `step ${i}: per-variable loss ${loss}, packed ${r.losses[i]}`));
    const [a, b] = [plain.state, r.state].map((bytes) => decodeSafetensors(bytes).tensors);
    assert.deepEqual(Object.keys(a), Object.keys(b));
    for (const [tensor, { data }] of Object.entries(a)) {
      data.forEach((v, i) => assert.ok(Math.abs(Number(v) - Number(b[tensor].data[i])) <= 1e-6 * Math.max(1, Math.abs(Number(v))),
        `${tensor}[${i}]: per-variable ${v}, packed ${b[tensor].data[i]}`));
    }
    assert.equal(r.losses.length, r.steps);
    assert.ok(r.worstLoss <= TOLERANCE, `worst relative loss difference ${r.worstLoss}`);
    assert.ok(r.worstReturned <= TOLERANCE, `worst relative difference of the returned outputs ${r.worstReturned}`);
    assert.equal(r.worstRate, 0, 'the learning rates fed (float32) equal Python\'s');
    assert.ok(r.evalLoss <= TOLERANCE, `eval loss after training differs by ${r.evalLoss}`);
    // for the Python side (tests/test_export_js.py): the trained state, the trained inference model
    await writeFile(join(FIXTURES, name, 'node_state.safetensors'), r.state);
    await writeFile(join(FIXTURES, name, 'node_inference.onnx'), r.inference);
    await writeFile(join(FIXTURES, name, 'node_report.json'), JSON.stringify({ ...r, state: undefined, inference: undefined, losses: undefined }));
  });
}
