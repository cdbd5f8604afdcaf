// The host program of a WebGPU step (manifest.webgpu.host, written by
// onnx_training_ops/passes/split_host_scalars.py): the few scalar ops that depend only on the
// update count and the learning rates (the float64 bias corrections, T + 1), evaluated here
// on the CPU each step as onnx_training_ops/export/host_program.py evaluates them: float64
// for doubles, float32 rounding for floats, integers exact (as JavaScript numbers, to 2^53).

const ONNX_TYPES = { 1: 'float32', 2: 'uint8', 3: 'int8', 5: 'int16', 6: 'int32', 7: 'int64', 9: 'bool', 10: 'float16', 11: 'float64', 12: 'uint32', 13: 'uint64' };
const INTEGER = new Set(['uint8', 'int8', 'int16', 'int32', 'int64', 'uint32', 'uint64']);

function round(value, dtype) {
  if (dtype === 'float32') return Math.fround(value);
  if (dtype === 'bool') return value ? 1 : 0;
  if (INTEGER.has(dtype)) return Math.trunc(value);
  return value;
}

const BINARY = {
  Add: (a, b) => a + b, Sub: (a, b) => a - b, Mul: (a, b) => a * b, Pow: (a, b) => a ** b,
  Max: (a, b) => (Number.isNaN(a) || Number.isNaN(b) ? NaN : Math.max(a, b)),
  Min: (a, b) => (Number.isNaN(a) || Number.isNaN(b) ? NaN : Math.min(a, b)),
};
const COMPARE = {
  Greater: (a, b) => a > b, Less: (a, b) => a < b, GreaterOrEqual: (a, b) => a >= b, LessOrEqual: (a, b) => a <= b,
  Equal: (a, b) => a === b, And: (a, b) => Boolean(a && b), Or: (a, b) => Boolean(a || b),
};
const UNARY = {
  Sqrt: Math.sqrt, Neg: (x) => -x, Abs: Math.abs, Exp: Math.exp, Log: Math.log, Floor: Math.floor, Ceil: Math.ceil,
  Reciprocal: (x) => 1 / x, Identity: (x) => x,
};

/**
 * Evaluate `program` on `inputs` ({name: number}; `dtypes` gives each input's dtype).
 * Returns {name: {value, dtype}} for every value it computes.
 */
export function runHost(program, inputs, dtypes) {
  const values = {};
  for (const name of program.inputs) {
    if (!(name in inputs)) throw new Error(`host program: no value for input ${JSON.stringify(name)}`);
    values[name] = { value: Number(inputs[name]), dtype: dtypes[name] };
  }
  for (const [name, c] of Object.entries(program.constants)) values[name] = { value: Number(c.values[0]), dtype: c.dtype };
  for (const node of program.nodes) {
    const args = node.inputs.map((n) => values[n]);
    const dtype = args[0].dtype;
    let value;
    let type = dtype;
    if (node.op in BINARY) {
      value = args.slice(1).reduce((acc, b) => round(BINARY[node.op](acc, b.value), dtype), args[0].value);
    } else if (node.op === 'Div') {
      value = INTEGER.has(dtype) ? Math.trunc(args[0].value / args[1].value) : args[0].value / args[1].value;
    } else if (node.op in COMPARE) {
      value = COMPARE[node.op](args[0].value, args[1].value) ? 1 : 0;
      type = 'bool';
    } else if (node.op === 'Not') {
      value = args[0].value ? 0 : 1;
    } else if (node.op in UNARY) {
      value = UNARY[node.op](args[0].value);
    } else if (node.op === 'Where') {
      value = args[0].value ? args[1].value : args[2].value;
      type = args[1].dtype;
    } else if (node.op === 'Cast') {
      type = ONNX_TYPES[node.attrs.to];
      if (!type) throw new Error(`host program: Cast to ONNX type ${node.attrs.to} is not evaluated on the host`);
      value = args[0].value;
    } else {
      throw new Error(`host program: op ${node.op} is not evaluated on the host`);
    }
    values[node.outputs[0]] = { value: round(value, type), dtype: type };
  }
  return values;
}
