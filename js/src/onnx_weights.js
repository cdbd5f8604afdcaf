// The exported inference model reads its weights from state.safetensors as ONNX external data.
// embedWeights() writes a self-contained copy with the given weights inside: it walks the
// protobuf (ModelProto.graph = field 7, GraphProto.initializer = 5, TensorProto.dims = 1,
// data_type = 2, name = 8, raw_data = 9, external_data = 13, data_location = 14) and re-encodes
// only what it changes. Every read is bounded by the buffer: damaged bytes are an error
// naming the file, never a hang.

import { TrainerError } from './errors.js';
import { Damaged, readVarint, fields, concat, lengthDelimited } from './protobuf.js';

/** TensorProto.DataType -> [manifest dtype, bytes per element]. */
const ONNX_TYPES = { 1: ['float32', 4], 2: ['uint8', 1], 3: ['int8', 1], 4: ['uint16', 2], 5: ['int16', 2], 6: ['int32', 4],
  7: ['int64', 8], 9: ['bool', 1], 11: ['float64', 8], 12: ['uint32', 4], 13: ['uint64', 8] };

/** Rewrite the submessages `field` of `buf` with `rewrite(bytes)` (null: keep). */
function rewriteField(buf, field, rewrite) {
  const parts = [];
  for (const f of fields(buf)) {
    const replaced = f.field === field && f.wire === 2 ? rewrite(buf.subarray(...f.body)) : null;
    parts.push(replaced ? lengthDelimited(field, replaced) : buf.subarray(f.start, f.end));
  }
  return concat(parts);
}

/** TensorProto.dims: repeated int64, packed or not. */
function dimsOf(tensor, all) {
  const dims = [];
  for (const f of all.filter((x) => x.field === 1)) {
    if (f.wire === 0) dims.push(readVarint(tensor, readVarint(tensor, f.start)[1])[0]);
    else if (f.wire === 2) {
      for (let pos = f.body[0]; pos < f.body[1];) {
        let d;
        [d, pos] = readVarint(tensor.subarray(0, f.body[1]), pos);
        dims.push(d);
      }
    }
  }
  return dims;
}

function tensorWithData(tensor, weights, used, where) {
  const all = fields(tensor);
  const nameField = all.find((f) => f.field === 8 && f.wire === 2);
  if (!nameField) return null;
  const name = new TextDecoder().decode(tensor.subarray(...nameField.body));
  const location = all.find((f) => f.field === 14 && f.wire === 0);
  if (!location || readVarint(tensor, readVarint(tensor, location.start)[1])[0] !== 1) return null; // not EXTERNAL
  const value = weights[name];
  if (!value) throw new TrainerError(`${where}: initializer ${JSON.stringify(name)} reads external data and is not in the state`);
  const typeField = all.find((f) => f.field === 2 && f.wire === 0);
  const [dtype, size] = ONNX_TYPES[typeField ? readVarint(tensor, readVarint(tensor, typeField.start)[1])[0] : 0] ?? [];
  const dims = dimsOf(tensor, all);
  const data = value.data;
  const found = value.type ?? value.dtype;
  const elements = dims.reduce((a, b) => a * b, 1);
  if (!dtype || (found && found !== dtype) || elements * size !== data.byteLength) {
    throw new TrainerError(`${where}: initializer ${JSON.stringify(name)} is ${dtype ?? 'of an unknown type'} [${dims}] `
      + `(${elements * (size ?? 0)} bytes); the state holds ${found ?? ''} of ${data.byteLength} bytes: `
      + 'the inference model is not this export\'s');
  }
  const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  used.add(name);
  const kept = all.filter((f) => f.field !== 9 && f.field !== 13 && f.field !== 14).map((f) => tensor.subarray(f.start, f.end));
  return concat([...kept, lengthDelimited(9, raw)]);
}

/**
 * A copy of ONNX model bytes whose external-data initializers hold `weights` ({name: tensor
 * with .data}) as raw data. Each initializer's dtype and dims must fit its weight.
 * @param where the file's name for errors
 * @returns {Uint8Array}
 * @throws {TrainerError} on damaged or foreign bytes, naming `where`
 */
export function embedWeights(modelBytes, weights, where = 'inference.onnx') {
  if (!(modelBytes instanceof Uint8Array)) throw new TrainerError(`${where}: expected the model's bytes (a Uint8Array)`);
  const used = new Set();
  let model;
  try {
    const top = fields(modelBytes);
    // what onnxruntime needs of a ModelProto: ir_version (1), graph (7), opset_import (8)
    for (const [field, wire, what] of [[1, 0, 'ir_version'], [7, 2, 'graph'], [8, 2, 'opset_import']]) {
      if (!top.some((f) => f.field === field && f.wire === wire)) throw new Damaged(`no ${what} (ModelProto field ${field})`);
    }
    model = rewriteField(modelBytes, 7, (graph) => rewriteField(graph, 5, (t) => tensorWithData(t, weights, used, where)));
  } catch (error) {
    if (error instanceof Damaged) throw new TrainerError(`${where}: not a valid ONNX model (${error.message}): truncated or damaged`);
    throw error;
  }
  if (!used.size) throw new TrainerError(`${where}: no external-data initializer of the model is in the state`);
  return model;
}
