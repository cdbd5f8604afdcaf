// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then the raw little-endian
// tensor bytes. The layout written here is the Python exporter's
// (onnx_training_ops/export/safetensors.py): tensors ordered by element size (largest first)
// then name, compact JSON, the header padded with spaces to a multiple of 8. The same state
// gives the same bytes in both languages, so the exported inference model, which reads its
// weights from state.safetensors by offset, lines up with a state file written here.

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
  if (!code) throw new Error(`tensor ${JSON.stringify(name)}: dtype ${dtype} has no safetensors code`);
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
 * Encode tensors ({name: {dtype, dims, data}}: ORT tensors qualify) as safetensors bytes.
 * @returns {Uint8Array}
 */
export function encode(tensors, metadata) {
  const entries = {};
  if (metadata && Object.keys(metadata).length) {
    entries.__metadata__ = Object.fromEntries(Object.entries(metadata).map(([k, v]) => [k, String(v)]));
  }
  const order = layout(tensors);
  let offset = 0;
  for (const name of order) {
    const t = tensors[name];
    const size = byteLength(t);
    entries[name] = { dtype: dtypeCode(t.type ?? t.dtype, name), shape: Array.from(t.dims, Number), data_offsets: [offset, offset + size] };
    offset += size;
  }
  let text = new TextEncoder().encode(JSON.stringify(entries));
  const pad = (8 - ((text.length + 8) % 8)) % 8;
  const out = new Uint8Array(8 + text.length + pad + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(text.length + pad), true);
  out.set(text, 8);
  out.fill(0x20, 8 + text.length, 8 + text.length + pad);
  let position = 8 + text.length + pad;
  for (const name of order) {
    const data = tensors[name].data;
    out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), position);
    position += data.byteLength;
  }
  return out;
}

/**
 * Decode safetensors bytes: {tensors: {name: {dtype, dims, data}}, metadata}. Each data is a
 * fresh, aligned TypedArray (little-endian hosts: every platform onnxruntime-web runs on).
 */
export function decode(bytes, where = 'safetensors data') {
  // a plain Uint8Array view (a Node Buffer's slice() would not copy)
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
  if (u8.length < 8) throw new Error(`${where}: not a safetensors file (${u8.length} bytes)`);
  const n = Number(new DataView(u8.buffer, u8.byteOffset, 8).getBigUint64(0, true));
  if (8 + n > u8.length) throw new Error(`${where}: not a safetensors file (header length ${n}, file ${u8.length} bytes)`);
  const table = JSON.parse(new TextDecoder().decode(u8.subarray(8, 8 + n)));
  const metadata = table.__metadata__ ?? {};
  delete table.__metadata__;
  const start = 8 + n;
  const body = u8.length - start;
  const tensors = {};
  for (const [name, entry] of Object.entries(table)) {
    const spec = DTYPES[entry.dtype];
    if (!spec) throw new Error(`${where}: tensor ${JSON.stringify(name)}: unknown dtype ${entry.dtype}`);
    const [dtype, Type] = spec;
    const [begin, end] = entry.data_offsets;
    const count = entry.shape.reduce((a, b) => a * b, 1);
    if (!(begin >= 0 && begin <= end && end <= body && end - begin === count * Type.BYTES_PER_ELEMENT)) {
      throw new Error(`${where}: tensor ${JSON.stringify(name)}: ${entry.dtype} [${entry.shape}] does not fit data_offsets [${begin}, ${end}]`);
    }
    const copy = u8.slice(start + begin, start + end);
    tensors[name] = { dtype, dims: entry.shape.slice(), data: new Type(copy.buffer, 0, count) };
  }
  return { tensors, metadata };
}
