// Which graph inputs each output of an ONNX model is computed from: enough of the protobuf
// (ModelProto.graph = 7; GraphProto.node = 1; NodeProto.input = 1, output = 2, attribute = 5;
// AttributeProto.g = 6, graphs = 11) to follow the data flow backwards. A node with subgraphs
// (If, Loop, Scan) reads, besides its inputs, every name its subgraphs' nodes read.

import { Damaged, fields, text } from './protobuf.js';

/** Every name the nodes of `graph` (bytes of a GraphProto) read, subgraphs included. */
function namesRead(graph, out) {
  for (const f of fields(graph)) {
    if (f.field === 1 && f.wire === 2) nodeReads(graph.subarray(...f.body), out);
  }
  return out;
}

function nodeReads(node, out) {
  for (const f of fields(node)) {
    if (f.field === 1 && f.wire === 2) out.push(text(node, f));
    else if (f.field === 5 && f.wire === 2) {
      const attribute = node.subarray(...f.body);
      for (const a of fields(attribute)) {
        if ((a.field === 6 || a.field === 11) && a.wire === 2) namesRead(attribute.subarray(...a.body), out);
      }
    }
  }
  return out;
}

/**
 * A function `(output, input) => boolean`: whether the model's `output` is computed from its
 * graph input `input` (an output that is the input itself counts).
 * @throws {Damaged} on bytes that are not a model
 */
export function dataFlow(modelBytes) {
  const graphField = fields(modelBytes).find((f) => f.field === 7 && f.wire === 2);
  if (!graphField) throw new Damaged('no graph (ModelProto field 7)');
  const graph = modelBytes.subarray(...graphField.body);
  const producers = new Map();  // value name -> the names its node reads
  for (const f of fields(graph)) {
    if (f.field !== 1 || f.wire !== 2) continue;
    const node = graph.subarray(...f.body);
    const reads = nodeReads(node, []);
    for (const o of fields(node)) if (o.field === 2 && o.wire === 2) producers.set(text(node, o), reads);
  }
  const reach = new Map();  // output -> the set of names it is computed from
  const sources = (output) => {
    if (!reach.has(output)) {
      const seen = new Set([output]);
      const stack = [output];
      while (stack.length) {
        for (const name of producers.get(stack.pop()) ?? []) {
          if (!seen.has(name)) {
            seen.add(name);
            stack.push(name);
          }
        }
      }
      reach.set(output, seen);
    }
    return reach.get(output);
  };
  return (output, input) => sources(output).has(input);
}

/**
 * The value of the model's metadata_props entry `key` (ModelProto field 14: key = 1, value = 2),
 * or null.
 * @throws {Damaged} on bytes that are not a model
 */
export function metadataValue(modelBytes, key) {
  for (const f of fields(modelBytes)) {
    if (f.field !== 14 || f.wire !== 2) continue;
    const entry = modelBytes.subarray(...f.body);
    let k = null;
    let v = null;
    for (const e of fields(entry)) {
      if (e.field === 1 && e.wire === 2) k = text(entry, e);
      else if (e.field === 2 && e.wire === 2) v = text(entry, e);
    }
    if (k === key) return v ?? '';
  }
  return null;
}
