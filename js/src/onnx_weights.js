// The exported inference model reads its weights from state.safetensors as ONNX external data.
// embedWeights() writes a self-contained copy with the given weights inside: it walks the
// protobuf (ModelProto.graph = field 7, GraphProto.initializer = 5, TensorProto.name = 8,
// raw_data = 9, external_data = 13, data_location = 14) and re-encodes only what it changes.

function readVarint(buf, pos) {
  let value = 0;
  let scale = 1;
  for (;;) {
    const byte = buf[pos++];
    value += (byte & 0x7f) * scale;
    if (byte < 0x80) return [value, pos];
    scale *= 128;
  }
}

function varint(value) {
  const bytes = [];
  while (value >= 0x80) {
    bytes.push((value % 128) | 0x80);
    value = Math.floor(value / 128);
  }
  bytes.push(value);
  return Uint8Array.from(bytes);
}

/** The fields of a message: [{field, wire, start, end, body: [from, to] for length-delimited}]. */
function fields(buf) {
  const out = [];
  let pos = 0;
  while (pos < buf.length) {
    const start = pos;
    let key;
    [key, pos] = readVarint(buf, pos);
    const field = Math.floor(key / 8);
    const wire = key & 7;
    let body = null;
    if (wire === 0) [, pos] = readVarint(buf, pos);
    else if (wire === 1) pos += 8;
    else if (wire === 5) pos += 4;
    else if (wire === 2) {
      let length;
      [length, pos] = readVarint(buf, pos);
      body = [pos, pos + length];
      pos += length;
    } else throw new Error(`onnx: unsupported protobuf wire type ${wire}`);
    out.push({ field, wire, start, end: pos, body });
  }
  return out;
}

function concat(parts) {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let pos = 0;
  for (const p of parts) {
    out.set(p, pos);
    pos += p.length;
  }
  return out;
}

function lengthDelimited(field, payload) {
  return concat([varint(field * 8 + 2), varint(payload.length), payload]);
}

/** Rewrite the submessages `field` of `buf` with `rewrite(bytes)` (null: keep). */
function rewriteField(buf, field, rewrite) {
  const parts = [];
  for (const f of fields(buf)) {
    const replaced = f.field === field && f.wire === 2 ? rewrite(buf.subarray(...f.body)) : null;
    parts.push(replaced ? lengthDelimited(field, replaced) : buf.subarray(f.start, f.end));
  }
  return concat(parts);
}

function tensorWithData(tensor, weights, used) {
  const all = fields(tensor);
  const nameField = all.find((f) => f.field === 8);
  if (!nameField) return null;
  const name = new TextDecoder().decode(tensor.subarray(...nameField.body));
  const location = all.find((f) => f.field === 14);
  if (!location || readVarint(tensor, readVarint(tensor, location.start)[1])[0] !== 1) return null; // not EXTERNAL
  const value = weights[name];
  if (!value) throw new Error(`embedWeights: initializer ${JSON.stringify(name)} reads external data and is not in the state`);
  const data = value.data;
  const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  used.add(name);
  const kept = all.filter((f) => f.field !== 9 && f.field !== 13 && f.field !== 14).map((f) => tensor.subarray(f.start, f.end));
  return concat([...kept, lengthDelimited(9, raw)]);
}

/**
 * A copy of ONNX model bytes whose external-data initializers hold `weights` ({name: tensor
 * with .data}) as raw data.
 * @returns {Uint8Array}
 */
export function embedWeights(modelBytes, weights) {
  const used = new Set();
  const model = rewriteField(modelBytes, 7, (graph) => rewriteField(graph, 5, (t) => tensorWithData(t, weights, used)));
  if (!used.size) throw new Error('embedWeights: no external-data initializer of the model is in the state');
  return model;
}
