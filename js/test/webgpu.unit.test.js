// The WebGPU trainer's parts that run without a GPU, in Node: the host program (the update
// count and the bias corrections, in float64) against Python's evaluation of the same program
// bit for bit, and the fallback when WebGPU is asked for where there is none.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import * as ort from 'onnxruntime-node';
import { Trainer } from '../src/index.js';
import { runHost } from '../src/host_program.js';
import { FIXTURES, read } from './helpers.js';
import { MODELS, batchAt } from './parity.js';
import { decodeSafetensors } from '../src/index.js';
import { join } from 'node:path';

const json = async (path) => JSON.parse(new TextDecoder().decode(await read(path)));

test('the host program computes what Python computes, bit for bit, for each model', async () => {
  for (const name of MODELS) {
    const manifest = await json(`${name}/export/manifest.json`);
    const dtypes = Object.fromEntries([...manifest.state, ...manifest.learning_rates].map((e) => [e.name, e.dtype]));
    for (const { inputs, values } of await json(`${name}/host_expected.json`)) {
      const got = runHost(manifest.webgpu.host, inputs, dtypes);
      for (const [key, value] of Object.entries(values)) {
        assert.equal(got[key].value, value, `${name} ${key} at ${JSON.stringify(inputs)}`);
      }
    }
  }
});

test('the host program refuses an op it does not evaluate and a missing input', () => {
  const program = { inputs: ['T'], constants: {}, nodes: [{ op: 'Softmax', inputs: ['T'], outputs: ['y'], attrs: {} }], outputs: ['y'], feeds: [] };
  assert.throws(() => runHost(program, { T: 1 }, { T: 'int64' }), /Softmax is not evaluated on the host/);
  assert.throws(() => runHost(program, {}, { T: 'int64' }), /no value for input "T"/);
});

test('asked for WebGPU where there is none (Node), the trainer runs on the CPU and says why', async () => {
  const trainer = await Trainer.load(ort, join(FIXTURES, 'mlp', 'export'), { executionProviders: ['webgpu'] });
  assert.equal(trainer.backend, 'cpu');
  assert.match(trainer.backendReason, /navigator\.gpu is absent|no adapter/);
  const { tensors } = decodeSafetensors(await read('mlp/batches.safetensors'));
  const expected = await json('mlp/expected.json');
  const { loss } = await trainer.step(batchAt(ort, tensors, 0));
  assert.ok(Math.abs(loss - expected.losses[0]) <= 1e-5 * expected.losses[0]);
  await trainer.release();
});
