// onnx-training-ops for JavaScript: train an exported step model in onnxruntime-node or onnxruntime-web.
export { Trainer } from './trainer.js';
export { TrainerError, NonFiniteLossError } from './errors.js';
export * as schedules from './schedules.js';
export { encode as encodeSafetensors, decode as decodeSafetensors } from './safetensors.js';
export { embedWeights } from './onnx_weights.js';
export { readExport } from './files.js';
