// Train a fixture written by Python (tests/js_fixtures.py) and compare with what Python's
// TrainingSession did: shared by the Node test and the browser harness.
import { Trainer, decodeSafetensors } from '../src/index.js';

export const MODELS = ['mlp', 'bert', 'cnn', 'gpt2'];
export const TOLERANCE = 1e-5; // relative, per step

/** Step `i`'s batch: views into the stacked fixture tensors. */
export function batchAt(ort, tensors, i) {
  return Object.fromEntries(Object.entries(tensors).map(([name, t]) => {
    const per = t.data.length / t.dims[0];
    return [name, new ort.Tensor(t.dtype, t.data.subarray(i * per, (i + 1) * per), t.dims.slice(1))];
  }));
}

const relative = (a, b) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

/**
 * Train fixture `name` for its steps. `read(path)` gives the bytes of a fixture file,
 * `location` is what Trainer.load takes for its export directory.
 */
export async function trainFixture(ort, read, location, name, options = {}) {
  const { steps: stepLimit, warmup = 0, ...trainerOptions } = options; // warmup: first steps left out of the timing
  const expected = JSON.parse(new TextDecoder().decode(await read(`${name}/expected.json`)));
  const { tensors } = decodeSafetensors(await read(`${name}/batches.safetensors`));
  const trainer = await Trainer.load(ort, location, trainerOptions);
  const steps = stepLimit ?? expected.steps;
  let worstLoss = 0;
  let worstReturned = 0;
  let worstRate = 0;
  const losses = [];
  let started = performance.now();
  for (let i = 0; i < steps; i++) {
    if (i === warmup) started = performance.now();
    const rates = trainer.learningRates;
    for (const [input, rate] of Object.entries(expected.learning_rates[i])) {
      worstRate = Math.max(worstRate, relative(Math.fround(rates[input]), Math.fround(rate)));
    }
    const result = await trainer.step(batchAt(ort, tensors, i % expected.cycle));
    losses.push(result.loss);
    worstLoss = Math.max(worstLoss, relative(result.loss, expected.losses[i]));
    for (const [output, value] of Object.entries(expected.returned[i])) worstReturned = Math.max(worstReturned, relative(result[output], value));
  }
  const seconds = (performance.now() - started) / 1000;
  const evaluation = await trainer.evaluate(batchAt(ort, tensors, 0));
  const report = {
    name, steps, worstLoss, worstReturned, worstRate, backend: trainer.backend,
    evalLoss: relative(evaluation.loss, expected.eval_loss), evaluation: evaluation.loss, stepsPerSecond: (steps - warmup) / seconds,
    losses, state: await trainer.exportState(), inference: await trainer.inferenceModel(),
  };
  await trainer.release();
  return report;
}
