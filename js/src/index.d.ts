// Types of onnx-training-ops for JavaScript. The `ort` argument is the onnxruntime module you
// use (onnxruntime-node, onnxruntime-web): typed structurally, so either fits.

/** The part of an onnxruntime tensor the trainer uses. */
export interface OrtTensor {
  readonly type: string;
  readonly dims: readonly number[];
  readonly size: number;
  readonly data: ArrayBufferView | unknown;
}

/** The part of an onnxruntime module the trainer uses (onnxruntime-node or onnxruntime-web). */
export interface OrtModule {
  Tensor: new (type: any, data: any, dims?: readonly number[]) => OrtTensor;
  InferenceSession: { create(model: Uint8Array | string, options?: object): Promise<any> };
}

export type Dtype = 'float32' | 'float64' | 'int64' | 'int32' | 'int16' | 'int8' | 'uint64' | 'uint32' | 'uint16' | 'uint8' | 'bool';

export interface ValueSpec { name: string; dtype: Dtype; shape: (number | string)[] | null }
export interface StateSpec { name: string; dtype: Dtype; shape: number[]; role: 'parameter' | 'optimizer' | 'counter' | 'buffer' }
export interface RateSpec { name: string; dtype: Dtype; shape: number[]; base: number; group?: string; params?: string[] }

/** manifest.json, version 1 (docs/export.md). */
export interface Manifest {
  format: 'onnx-training-ops/export';
  version: 1;
  /** Paths relative to the export location (no "..", not absolute); `sha256`: the file's lowercase hex SHA-256, checked at load. */
  files: Record<string, { path: string; operators?: string[]; external_data?: string; sha256?: string }>;
  opset: Record<string, number>;
  ir_version: number;
  inputs: ValueSpec[];
  eval_inputs: ValueSpec[];
  defaults: Record<string, { name: string; dtype: Dtype; shape: number[]; values: number[] }>;
  learning_rates: RateSpec[];
  feedback: Record<string, string>;
  /** With a packed step: the state of each dtype as one flat input/output, each variable at its offset. */
  packs: { dtype: Dtype; input: string; output: string; size: number; members: { name: string; offset: number; shape: number[] }[] }[] | null;
  returned: string[];
  eval_outputs: string[];
  state: StateSpec[];
  loss: string | null;
  labels: string | null;
  optimizer: Record<string, unknown> | null;
  param_groups: Record<string, unknown>[] | null;
  schedule: { type: string; args: Record<string, unknown>; counter: string; step_offset: number } | null;
  counter: string | null;
  /** The class count C when the loss takes class labels (labels must be in [0, C) or equal ignore_index); absent in older exports. */
  classes?: number | null;
  ignore_index?: number | null;
  /** With `export-step --target webgpu`: the WebGPU step's interface (docs/export.md, "WebGPU"). */
  webgpu?: {
    inputs: ValueSpec[];
    eval_inputs?: ValueSpec[];
    rates: string[];
    feedback: Record<string, string>;
    host: { inputs: string[]; constants: Record<string, { dtype: Dtype; shape: number[]; values: number[] }>;
      nodes: { op: string; inputs: string[]; outputs: string[]; attrs: Record<string, unknown> }[];
      outputs: string[]; feeds: { name: string; dtype: Dtype; shape: number[] }[] };
    host_state: string[];
    returned: string[];
  } | null;
}

export interface ExportFiles {
  manifest: Manifest;
  step: Uint8Array;
  stepPacked?: Uint8Array | null;
  eval?: Uint8Array | null;
  inference?: Uint8Array | null;
  state: Uint8Array;
  stepWebgpu?: Uint8Array | null;
  evalWebgpu?: Uint8Array | null;
}

/** A batch: an onnxruntime tensor, or plain data converted to the input's dtype. */
export type Batch = Record<string, OrtTensor | { data: ArrayLike<number | bigint>; dims: readonly number[] }>;
/** One-element outputs as numbers (the loss, grad_norm), others as tensors. */
export type Outputs = Record<string, number | OrtTensor>;

export interface TrainerOptions {
  /** onnxruntime session options (intraOpNumThreads, executionProviders...). */
  sessionOptions?: object;
  /** A NaN or infinite loss: throw NonFiniteLossError (default), skip the step, or ignore it. */
  onNonFinite?: 'raise' | 'skip' | 'ignore';
  /** Run the packed step (one state tensor per dtype; default: when the export has one). */
  packed?: boolean;
  /** Check each file against manifest.json's sha256 and the state's __metadata__ sha256 (default true; false: skip, for speed). */
  verify?: boolean;
  /**
   * E.g. `['webgpu']`: the export's WebGPU step on onnxruntime-web's WebGPU provider, the state kept
   * on the GPU, when the runtime has an adapter and the export a WebGPU step (`export-step --target
   * webgpu`); otherwise the other providers listed (default: onnxruntime's). `trainer.backend` says which.
   */
  executionProviders?: (string | { name: string; [option: string]: unknown })[];
  /** The onnxruntime module to use when WebGPU is not (e.g. ort.wasm.min.mjs beside ort.webgpu.min.mjs). */
  fallback?: OrtModule;
}

/** Bad input (manifest, file, batch, learning rate, state): the message names the file, field or input, what was expected and what was found. */
export declare class TrainerError extends Error {}
/** A NaN or infinite loss (onNonFinite "raise"); the state is unchanged. */
export declare class NonFiniteLossError extends TrainerError {}

export interface Schedule { lr(base: number, k: number, name?: string): number }

export declare class Trainer {
  static create(ort: OrtModule, files: ExportFiles, options?: TrainerOptions): Promise<Trainer>;
  /**
   * An export location. Node: a directory path or a file: URL (string or URL). Browser: a URL,
   * absolute or relative to the page ('model/', '../model/', '/model/'). Throws a TrainerError
   * naming a missing, damaged or refused file.
   */
  static load(ort: OrtModule, location: string | URL, options?: TrainerOptions): Promise<Trainer>;
  readonly manifest: Manifest;
  /** What runs the step: 'webgpu', 'wasm', 'cpu' (onnxruntime-node) or the first provider asked for. */
  readonly backend: string;
  /** Why WebGPU was not used when it was asked for (null otherwise). */
  readonly backendReason: string | null;
  /** The state: one onnxruntime tensor per state variable (views into the packs of a packed step). */
  readonly state: Record<string, OrtTensor>;
  schedule: Schedule | null;
  skippedSteps: number;
  readonly scheduleStep: number;
  readonly learningRates: Record<string, number>;
  tensor(name: string, data: ArrayLike<number | bigint>, dims: readonly number[]): OrtTensor;
  setSchedule(schedule: Schedule | null, step?: number): void;
  /** Calls of step() and evaluate() run one after another in call order (a queue), as in Python. */
  step(batch: Batch, options?: { lr?: number | Record<string, number> }): Promise<Outputs>;
  evaluate(batch: Batch): Promise<Outputs>;
  /** safetensors bytes; __metadata__ holds "format" and "sha256" (of the data section). On WebGPU a Promise (the state is downloaded from the GPU): `await` works for both. */
  exportState(): Uint8Array | Promise<Uint8Array>;
  loadState(bytes: Uint8Array | ArrayBuffer, options?: { verify?: boolean; where?: string }): void;
  /** On WebGPU a Promise (the weights are downloaded from the GPU): `await` works for both. */
  inferenceModel(): Uint8Array | Promise<Uint8Array>;
  release(): Promise<void>;
}

export interface DecodedTensor { dtype: Dtype; dims: number[]; data: ArrayBufferView }
export declare function encodeSafetensors(tensors: Record<string, { type?: string; dtype?: string; dims: readonly number[]; data: ArrayBufferView }>, metadata?: Record<string, string>, options?: { sha256?: boolean }): Uint8Array;
export declare function decodeSafetensors(bytes: Uint8Array | ArrayBuffer, where?: string, options?: { verify?: boolean }): { tensors: Record<string, DecodedTensor>; metadata: Record<string, string> };
export declare function embedWeights(modelBytes: Uint8Array, weights: Record<string, { data: ArrayBufferView }>, where?: string): Uint8Array;
/** `webgpu`: also read the WebGPU step and eval models (what `Trainer.load` does when WebGPU is asked for). */
export declare function readExport(location: string | URL, options?: { webgpu?: boolean }): Promise<ExportFiles>;

export declare namespace schedules {
  class StepLR implements Schedule { constructor(a: { step_size: number; gamma?: number }); lr(base: number, k: number): number }
  class MultiStepLR implements Schedule { constructor(a: { milestones: number[]; gamma?: number }); lr(base: number, k: number): number }
  class ExponentialLR implements Schedule { constructor(a: { gamma: number }); lr(base: number, k: number): number }
  class CosineAnnealingLR implements Schedule { constructor(a: { T_max: number; eta_min?: number }); lr(base: number, k: number): number }
  class LinearLR implements Schedule { constructor(a: { start_factor?: number; end_factor?: number; total_iters?: number }); lr(base: number, k: number): number }
  class OneCycleLR implements Schedule {
    constructor(a: { max_lr: number | Record<string, number>; total_steps: number; pct_start?: number; anneal_strategy?: 'cos' | 'linear'; div_factor?: number; final_div_factor?: number; three_phase?: boolean });
    lr(base: number, k: number, name?: string): number;
  }
  class WarmupCosineLR implements Schedule { constructor(a: { warmup_steps: number; total_steps: number; num_cycles?: number }); lr(base: number, k: number): number }
  class WarmupLinearLR implements Schedule { constructor(a: { warmup_steps: number; total_steps: number }); lr(base: number, k: number): number }
  const SCHEDULES: Record<string, new (args: any) => Schedule>;
  function fromJSON(spec: { type: string; args: Record<string, unknown> }): Schedule;
  function toJSON(schedule: Schedule): { type: string; args: Record<string, unknown> };
}
