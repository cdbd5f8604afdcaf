// Steps per second of the JavaScript trainer on WebGPU against wasm (onnxruntime-web 1.30) in
// headless Chromium, for the test models (tests/js_fixtures.py), through the test page
// js/test/browser/webgpu.html: each model trains N steps on each backend, the first 5 left out
// of the timing (shader compilation, wasm warm-up).
//
//   python tests/js_fixtures.py /tmp/fixtures
//   OTO_FIXTURES=/tmp/fixtures node js/bench/webgpu.mjs [steps=100] [rounds=1]
//
// On a machine without a GPU, Chromium's WebGPU adapter is SwiftShader: Vulkan on the CPU. Its
// numbers say nothing about a real GPU; they show what runs, not how fast a GPU runs it.
import { spawn } from 'node:child_process';
import { mkdtemp, rm, symlink } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import puppeteer from 'puppeteer-core';

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const FIXTURES = process.env.OTO_FIXTURES;
if (!FIXTURES) throw new Error('OTO_FIXTURES is not set: python tests/js_fixtures.py /tmp/fixtures first');
const steps = Number(process.argv[2] ?? 100);
const rounds = Number(process.argv[3] ?? 1);

const root = await mkdtemp(join(tmpdir(), 'oto-bench-'));
await symlink(join(REPO, 'js'), join(root, 'js'));
await symlink(resolve(FIXTURES), join(root, 'fixtures'));
const server = spawn(process.env.PYTHON ?? 'python3', ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1', '--directory', root],
  { stdio: ['ignore', 'pipe', 'ignore'] });
const port = await new Promise((ok) => server.stdout.on('data', (c) => { const m = /port (\d+)/.exec(String(c)); if (m) ok(Number(m[1])); }));
const profile = await mkdtemp(join(tmpdir(), 'oto-bench-chromium-'));
const browser = await puppeteer.launch({
  executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true,
  args: ['--headless', '--no-sandbox', '--enable-unsafe-webgpu', '--disable-quic', '--no-first-run', `--user-data-dir=${profile}`],
});
try {
  const rows = {};
  let adapter = null;
  for (let round = 0; round < rounds; round++) {
    const page = await browser.newPage();
    await page.goto(`http://127.0.0.1:${port}/js/test/browser/webgpu.html?fixtures=/fixtures/&steps=${steps}`);
    await page.waitForFunction('window.webgpu && window.webgpu.done', { timeout: 1800000, polling: 500 });
    const result = await page.evaluate('window.webgpu');
    await page.close();
    if (result.error) throw new Error(result.error);
    adapter = result.adapter;
    for (const r of result.reports) (rows[r.name] ??= []).push(r);
  }
  console.log(`adapter: ${JSON.stringify(adapter)}; ${steps} steps per model and backend (5 warm-up), ${rounds} round(s)`);
  console.log('| model | WebGPU steps/s | wasm steps/s | WebGPU / wasm | worst rel. loss WebGPU vs wasm |');
  console.log('| --- | --- | --- | --- | --- |');
  const median = (xs) => xs.slice().sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  for (const [name, rs] of Object.entries(rows)) {
    const gpu = median(rs.map((r) => r.gpuStepsPerSecond));
    const wasm = median(rs.map((r) => r.wasmStepsPerSecond));
    console.log(`| ${name} | ${gpu.toFixed(1)} | ${wasm.toFixed(1)} | ${(gpu / wasm).toFixed(3)} | ${Math.max(...rs.map((r) => r.worstVsWasm)).toExponential(1)} |`);
  }
} finally {
  await browser.close();
  server.kill();
  await rm(root, { recursive: true, force: true });
  await rm(profile, { recursive: true, force: true });
}
