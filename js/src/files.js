// Reading an export directory: from the file system in Node, over fetch() in a browser.

async function readBytes(location, name) {
  const isURL = typeof location === 'string' && /^(https?|file|blob|data):/.test(location);
  const inNode = typeof process !== 'undefined' && process.versions?.node && !isURL && !(location instanceof URL);
  if (inNode) {
    const { readFile } = await import('node:fs/promises');
    const { join } = await import('node:path');
    return new Uint8Array(await readFile(join(String(location), name)));
  }
  const url = new URL(name, String(location).endsWith('/') ? String(location) : `${location}/`);
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

/**
 * {manifest, step, stepPacked, eval, inference, state, stepWebgpu, evalWebgpu} of an export
 * directory (a path in Node, a URL in the browser); the WebGPU models only with `{ webgpu: true }`.
 */
export async function readExport(location, { webgpu = false } = {}) {
  const manifest = JSON.parse(new TextDecoder().decode(await readBytes(location, 'manifest.json')));
  const f = manifest.files;  // eval and inference are absent for a model without a loss or outputs
  const [step, stepPacked, evalModel, inference, state, stepWebgpu, evalWebgpu] = await Promise.all(
    [f.step, f.step_packed, f.eval, f.inference, f.state, webgpu && f.step_webgpu, webgpu && f.eval_webgpu]
      .map((entry) => (entry ? readBytes(location, entry.path) : null)));
  return { manifest, step, stepPacked, eval: evalModel, inference, state, stepWebgpu, evalWebgpu };
}
