// One contender of benchmarks/bench_js_trainer.py: the JavaScript trainer in onnxruntime-node.
//   node js/bench/step.js EXPORT_DIR BATCHES.safetensors THREADS WARMUP STEPS [packed] [WARMUP_SECONDS]
// prints {"us_per_step", "bare_us", "rss_mb"}: the median of 5 blocks of STEPS/5 trainer steps,
// after at least WARMUP steps and WARMUP_SECONDS (default 0), cycling through the stacked batches; bare_us: the same for onnxruntime-node's
// session.run alone on fixed feeds (what the binding costs without the trainer).
import { readFile } from 'node:fs/promises';
import * as ort from 'onnxruntime-node';
import { Trainer, decodeSafetensors } from '../src/index.js';
import { batchAt } from '../test/parity.js';

const [dir, batchFile, threads, warmup, steps, layout, warmupSeconds = '0'] = process.argv.slice(2);
const trainer = await Trainer.load(ort, dir, {
  packed: layout === 'packed', sessionOptions: { intraOpNumThreads: Number(threads), interOpNumThreads: 1 },
});
const { tensors } = decodeSafetensors(await readFile(batchFile));
const cycle = Object.values(tensors)[0].dims[0];
const batches = Array.from({ length: cycle }, (_, i) => batchAt(ort, tensors, i));
let i = 0;
const warmStart = process.hrtime.bigint();
const warmNs = BigInt(Math.round(Number(warmupSeconds) * 1e9));
for (; i < Number(warmup) || process.hrtime.bigint() - warmStart < warmNs; i++) await trainer.step(batches[i % cycle]);
const blocks = [];
const per = Math.max(1, Math.floor(Number(steps) / 5));
for (let b = 0; b < 5; b++) {
  const start = process.hrtime.bigint();
  for (let k = 0; k < per; k++, i++) await trainer.step(batches[i % cycle]);
  blocks.push(Number(process.hrtime.bigint() - start) / 1000 / per);
}
blocks.sort((a, b) => a - b);
const feeds = { ...batches[0], ...trainer._rateFeeds(), ...trainer.stepState };
const bare = [];
for (let b = 0; b < 5; b++) {
  const start = process.hrtime.bigint();
  for (let k = 0; k < per; k++) await trainer.stepSession.run(feeds);
  bare.push(Number(process.hrtime.bigint() - start) / 1000 / per);
}
bare.sort((a, b) => a - b);
console.log(JSON.stringify({ us_per_step: blocks[2], bare_us: bare[2], rss_mb: process.memoryUsage().rss / 2 ** 20 }));
