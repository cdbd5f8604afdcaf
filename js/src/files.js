// Reading an export: from the file system in Node (a path, or a file: URL as a string or a URL
// object), over fetch() otherwise (an absolute URL, or in a browser one relative to the page).
// Every file the manifest names must lie inside the export location.

import { TrainerError, show } from './errors.js';
import { validateManifest } from './validate.js';

const inNode = typeof process !== 'undefined' && Boolean(process.versions?.node);
const SCHEME = /^[A-Za-z][A-Za-z0-9+.-]*:/;

/** Where an export lives: {kind: 'fs', dir} or {kind: 'url', base: URL ending in '/'}. */
async function resolveLocation(location) {
  if (location instanceof URL || (typeof location === 'string' && location !== '')) {
    const text = String(location);
    if (inNode && (location instanceof URL ? location.protocol === 'file:' : /^file:/i.test(text) || /^[A-Za-z]:[\\/]/.test(text) || !SCHEME.test(text))) {
      const { fileURLToPath } = await import('node:url');
      const { resolve } = await import('node:path');
      return { kind: 'fs', dir: resolve(/^file:/i.test(text) ? fileURLToPath(text) : text) };
    }
    const page = globalThis.document?.baseURI ?? globalThis.location?.href;
    let base;
    try {
      base = new URL(text, page);
    } catch {
      throw new TrainerError(`Trainer.load: location ${show(text)} is not a URL${page ? ` (resolved against ${page})` : ' (no page to resolve it against)'}`);
    }
    if (!base.pathname.endsWith('/')) base.pathname += '/';
    return { kind: 'url', base };
  }
  throw new TrainerError(`Trainer.load: location must be a path or URL (string or URL), found ${show(location)}`);
}

/** The bytes of `name` (a manifest path, already checked as relative) inside the location. */
async function readBytes(where, name) {
  if (where.kind === 'fs') {
    const { readFile, realpath } = await import('node:fs/promises');
    const { join, sep } = await import('node:path');
    const path = join(where.dir, name);
    let real;
    let root;
    try {
      [root, real] = await Promise.all([realpath(where.dir), realpath(path)]);
      if (real !== root && !real.startsWith(root.endsWith(sep) ? root : root + sep)) {
        throw new TrainerError(`${path}: the file lies outside the export directory ${root} (a link to ${real}); refused`);
      }
      return new Uint8Array(await readFile(real));
    } catch (error) {
      if (error instanceof TrainerError) throw error;
      throw new TrainerError(`${path}: cannot read the file (${error.code ?? error.message})`);
    }
  }
  const url = new URL(name, where.base);
  if (!url.href.startsWith(where.base.href)) throw new TrainerError(`${url}: outside the export location ${where.base}; refused`);
  let response;
  try {
    response = await fetch(url);
  } catch (error) {
    throw new TrainerError(`${url}: cannot fetch the file (${error.message})`);
  }
  if (!response.ok) throw new TrainerError(`${url}: cannot fetch the file (HTTP ${response.status})`);
  return new Uint8Array(await response.arrayBuffer());
}

/** Parse and check manifest.json's bytes. */
export function parseManifest(bytes, where = 'manifest.json') {
  let manifest;
  try {
    manifest = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch (error) {
    throw new TrainerError(`${where}: not valid JSON (${error.message}): truncated or not a manifest`);
  }
  return validateManifest(manifest, where);
}

/**
 * {manifest, step, stepPacked, eval, inference, state, stepWebgpu, evalWebgpu} of an export
 * location: a directory path or file: URL in Node, a URL in a browser (absolute, or relative to
 * the page); the WebGPU models (export-step --target webgpu) only with `{ webgpu: true }`.
 * @throws {TrainerError} naming the file that is missing, unreadable, malformed or outside the location
 */
export async function readExport(location, { webgpu = false } = {}) {
  const where = await resolveLocation(location);
  const manifest = parseManifest(await readBytes(where, 'manifest.json'),
    where.kind === 'fs' ? `${where.dir}/manifest.json` : String(new URL('manifest.json', where.base)));
  const f = manifest.files;  // eval and inference are absent for a model without a loss or outputs
  if (f.constants) {  // a model past protobuf's 2 GB: its models read their weights from a separate file
    throw new TrainerError(`Trainer.load: this export keeps its weights in ${show(f.constants.path)} (a model past 2 GB, `
      + 'read as ONNX external data); the JavaScript trainer loads each model whole, which no onnxruntime binding for '
      + 'JavaScript does past 2 GB: train it in Python (session_from_export) or export a smaller model');
  }
  const [step, stepPacked, evalModel, inference, state, stepWebgpu, evalWebgpu] = await Promise.all(
    [f.step, f.step_packed, f.eval, f.inference, f.state, webgpu && f.step_webgpu, webgpu && f.eval_webgpu]
      .map((entry) => (entry ? readBytes(where, entry.path) : null)));
  return { manifest, step, stepPacked, eval: evalModel, inference, state, stepWebgpu, evalWebgpu };
}
