// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then the raw little-endian
// tensor bytes. The layout written here is the Python exporter's
// (onnx_training_ops/storage/safetensors.py): tensors ordered by element size (largest first)
// then name, compact JSON, the header padded with spaces to a multiple of 8. The same state
// gives the same bytes in both languages, so the exported inference model, which reads its
// weights from state.safetensors by offset, lines up with a state file written here.

import { TrainerError, show } from './errors.js';
import { sha256Sync } from './sha256.js';

/** safetensors dtype code -> [manifest dtype, TypedArray constructor]. */
export const DTYPES = {
  F64: ['float64', Float64Array],
  F32: ['float32', Float32Array],
  I64: ['int64', BigInt64Array],
  I32: ['int32', Int32Array],
  I16: ['int16', Int16Array],
  I8: ['int8', Int8Array],
  U64: ['uint64', BigUint64Array],
  U32: ['uint32', Uint32Array],
  U16: ['uint16', Uint16Array],
  U8: ['uint8', Uint8Array],
  BOOL: ['bool', Uint8Array],
};
const CODES = Object.fromEntries(Object.entries(DTYPES).map(([code, [name]]) => [name, code]));

/** The safetensors code of a manifest dtype name ("float32" -> "F32"). */
export function dtypeCode(dtype, name) {
  const code = CODES[dtype];
  if (!code) throw new TrainerError(`tensor ${JSON.stringify(name)}: dtype ${dtype} has no safetensors code`);
  return code;
}

/** A TypedArray constructor for a manifest dtype name. */
export function arrayType(dtype) {
  return DTYPES[dtypeCode(dtype, '')][1];
}

function byteLength(t) {
  return t.data.byteLength;
}

/** The storage order: element size descending, then name (as the Python writer). */
export function layout(tensors) {
  const size = (name) => tensors[name].data.BYTES_PER_ELEMENT;
  return Object.keys(tensors).sort((a, b) => size(b) - size(a) || (a < b ? -1 : a > b ? 1 : 0));
}

/**
 * Encode tensors ({name: {dtype, dims, data}}: ORT tensors qualify) as safetensors bytes. With
 * `{sha256: true}` in `options`, the metadata gains "sha256": the SHA-256 of the data section.
 * @returns {Uint8Array}
 */
export function encode(tensors, metadata, options = {}) {
  const order = layout(tensors);
  const entries = {};
  let offset = 0;
  for (const name of order) {
    const t = tensors[name];
    const size = byteLength(t);
    entries[name] = { dtype: dtypeCode(t.type ?? t.dtype, name), shape: Array.from(t.dims, Number), data_offsets: [offset, offset + size] };
    offset += size;
  }
  const data = new Uint8Array(offset);
  let position = 0;
  for (const name of order) {
    const d = tensors[name].data;
    data.set(new Uint8Array(d.buffer, d.byteOffset, d.byteLength), position);
    position += d.byteLength;
  }
  const meta = { ...(metadata ?? {}) };
  if (options.sha256) meta.sha256 = sha256Sync(data);
  const header = Object.keys(meta).length
    ? { __metadata__: Object.fromEntries(Object.entries(meta).map(([k, v]) => [k, String(v)])), ...entries } : entries;
  const text = new TextEncoder().encode(JSON.stringify(header));
  const pad = (8 - ((text.length + 8) % 8)) % 8;
  const out = new Uint8Array(8 + text.length + pad + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(text.length + pad), true);
  out.set(text, 8);
  out.fill(0x20, 8 + text.length, 8 + text.length + pad);
  out.set(data, 8 + text.length + pad);
  return out;
}

const MAX_HEADER = 100 * 1024 * 1024;

function parseHeader(u8, where) {
  if (u8.length < 8) throw new TrainerError(`${where}: not a safetensors file (${u8.length} bytes, the header length alone takes 8)`);
  const n = new DataView(u8.buffer, u8.byteOffset, 8).getBigUint64(0, true);
  if (n > BigInt(MAX_HEADER) || 8 + Number(n) > u8.length) {
    throw new TrainerError(`${where}: not a safetensors file (header length ${n}, file ${u8.length} bytes): truncated or not safetensors`);
  }
  let table;
  try {
    table = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(u8.subarray(8, 8 + Number(n))));
  } catch (error) {
    throw new TrainerError(`${where}: the safetensors header is not JSON (${error.message})`);
  }
  if (table === null || typeof table !== 'object' || Array.isArray(table)) {
    throw new TrainerError(`${where}: the safetensors header is not a JSON object, found ${show(table)}`);
  }
  return [table, 8 + Number(n)];
}

const isCount = (v) => Number.isSafeInteger(v) && v >= 0;

/**
 * Decode safetensors bytes: {tensors: {name: {dtype, dims, data}}, metadata}. Each data is a
 * fresh, aligned TypedArray (little-endian hosts: every platform onnxruntime-web runs on).
 * The tensors must tile the data section exactly (no overlap, no gap, in any order of names);
 * a "sha256" in the metadata must be the data section's (skipped with `{verify: false}`).
 * @throws {TrainerError} naming `where` and the tensor or field that does not fit
 */
export function decode(bytes, where = 'safetensors data', { verify = true } = {}) {
  if (!(bytes instanceof ArrayBuffer) && !ArrayBuffer.isView(bytes)) {
    throw new TrainerError(`${where}: expected the bytes of a safetensors file (Uint8Array or ArrayBuffer), found ${show(bytes)}`);
  }
  // a plain Uint8Array view (a Node Buffer's slice() would not copy)
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
  const [table, start] = parseHeader(u8, where);
  const metadata = table.__metadata__ ?? {};
  delete table.__metadata__;
  if (metadata === null || typeof metadata !== 'object' || Array.isArray(metadata)
      || Object.values(metadata).some((v) => typeof v !== 'string')) {
    throw new TrainerError(`${where}: __metadata__ must be an object of strings, found ${show(metadata)}`);
  }
  const body = u8.length - start;
  const spans = [];
  for (const [name, entry] of Object.entries(table)) {
    const spec = DTYPES[entry?.dtype];
    if (!spec || !Array.isArray(entry.shape) || !entry.shape.every(isCount) || !Array.isArray(entry.data_offsets)
        || entry.data_offsets.length !== 2 || !entry.data_offsets.every(isCount)) {
      throw new TrainerError(`${where}: tensor ${JSON.stringify(name)}: a malformed header entry ${show(entry)} `
        + `(expected dtype in ${Object.keys(DTYPES).join('/')}, shape and data_offsets of non-negative integers)`);
    }
    const [begin, end] = entry.data_offsets;
    const size = entry.shape.reduce((a, b) => a * b, 1) * spec[1].BYTES_PER_ELEMENT;
    if (!(begin <= end && end <= body && end - begin === size)) {
      throw new TrainerError(`${where}: tensor ${JSON.stringify(name)}: ${entry.dtype} [${entry.shape}] needs ${size} bytes, `
        + `data_offsets [${begin}, ${end}] (the data holds ${body} bytes)`);
    }
    spans.push([begin, end, name]);
  }
  let position = 0;
  for (const [begin, end, name] of spans.slice().sort((a, b) => a[0] - b[0] || a[1] - b[1])) {
    if (begin !== position) {
      throw new TrainerError(`${where}: tensor ${JSON.stringify(name)} starts at byte ${begin} of the data, expected ${position}: `
        + 'tensors must not overlap or leave gaps');
    }
    position = end;
  }
  if (position !== body) throw new TrainerError(`${where}: ${body - position} bytes after the last tensor`);
  if (verify && metadata.sha256 !== undefined) {
    const found = sha256Sync(u8.subarray(start));
    if (found !== metadata.sha256) {
      throw new TrainerError(`${where}: the SHA-256 of the tensor data differs from __metadata__.sha256 `
        + `(expected ${metadata.sha256}, found ${found}): the file is damaged`);
    }
  }
  const tensors = {};
  for (const [begin, end, name] of spans) {
    const entry = table[name];
    const [dtype, Type] = DTYPES[entry.dtype];
    const copy = u8.slice(start + begin, start + end);
    tensors[name] = { dtype, dims: entry.shape.slice(), data: new Type(copy.buffer, 0, (end - begin) / Type.BYTES_PER_ELEMENT) };
  }
  return { tensors, metadata };
}
