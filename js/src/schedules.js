// Learning-rate schedules under the Python package's names (onnx_training_ops.schedules, which
// follows torch.optim.lr_scheduler and transformers): lr(base, k) is the rate of optimizer
// step k (0-based), in closed form. The same float64 arithmetic in the same order, so the
// float32 rate fed to the step model is the one Python feeds (a test compares them).

import { TrainerError } from './errors.js';

const bisectRight = (sorted, x) => {
  let lo = 0;
  let hi = sorted.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (x < sorted[mid]) hi = mid;
    else lo = mid + 1;
  }
  return lo;
};

export class StepLR {
  constructor({ step_size, gamma = 0.1 }) { Object.assign(this, { step_size, gamma }); }
  lr(base, k) { return base * this.gamma ** Math.floor(k / this.step_size); }
}

export class MultiStepLR {
  constructor({ milestones, gamma = 0.1 }) { this.milestones = [...milestones].sort((a, b) => a - b); this.gamma = gamma; }
  lr(base, k) { return base * this.gamma ** bisectRight(this.milestones, k); }
}

export class ExponentialLR {
  constructor({ gamma }) { this.gamma = gamma; }
  lr(base, k) { return base * this.gamma ** k; }
}

export class CosineAnnealingLR {
  constructor({ T_max, eta_min = 0 }) { Object.assign(this, { T_max, eta_min }); }
  lr(base, k) { return this.eta_min + (base - this.eta_min) * (1 + Math.cos(Math.PI * k / this.T_max)) / 2; }
}

export class LinearLR {
  constructor({ start_factor = 1 / 3, end_factor = 1, total_iters = 5 }) { Object.assign(this, { start_factor, end_factor, total_iters }); }
  lr(base, k) {
    const t = Math.min(k, this.total_iters) / this.total_iters;
    return base * (this.start_factor + (this.end_factor - this.start_factor) * t);
  }
}

export class OneCycleLR {
  constructor({ max_lr, total_steps, pct_start = 0.3, anneal_strategy = 'cos', div_factor = 25, final_div_factor = 1e4, three_phase = false }) {
    Object.assign(this, { max_lr, total_steps, pct_start, anneal_strategy, div_factor, final_div_factor, three_phase });
  }
  lr(base, k, name = '') {
    const top = typeof this.max_lr === 'object' ? this.max_lr[name] : this.max_lr;
    if (top === undefined) throw new TrainerError(`OneCycleLR: max_lr has no entry for learning rate ${JSON.stringify(name)}`);
    if (k > this.total_steps) throw new TrainerError(`OneCycleLR: step ${k + 1} is beyond total_steps=${this.total_steps}`);
    const initial = top / this.div_factor;
    const low = initial / this.final_div_factor;
    const end = this.pct_start * this.total_steps - 1;
    const phases = this.three_phase
      ? [[end, initial, top], [2 * this.pct_start * this.total_steps - 2, top, initial], [this.total_steps - 1, initial, low]]
      : [[end, initial, top], [this.total_steps - 1, top, low]];
    let start = 0;
    for (let i = 0; i < phases.length; i++) {
      const [phaseEnd, a, b] = phases[i];
      if (k <= phaseEnd || i === phases.length - 1) {
        const pct = (k - start) / (phaseEnd - start);
        return this.anneal_strategy === 'cos' ? b + (a - b) / 2 * (Math.cos(Math.PI * pct) + 1) : (b - a) * pct + a;
      }
      start = phaseEnd;
    }
    throw new TrainerError('unreachable');
  }
}

export class WarmupCosineLR {
  constructor({ warmup_steps, total_steps, num_cycles = 0.5 }) { Object.assign(this, { warmup_steps, total_steps, num_cycles }); }
  lr(base, k) {
    if (k < this.warmup_steps) return base * k / Math.max(1, this.warmup_steps);
    const progress = (k - this.warmup_steps) / Math.max(1, this.total_steps - this.warmup_steps);
    return base * Math.max(0, 0.5 * (1 + Math.cos(Math.PI * this.num_cycles * 2 * progress)));
  }
}

export class WarmupLinearLR {
  // allow_warmup_past_total (Python's flag for warmup_steps > total_steps) changes no formula
  constructor({ warmup_steps, total_steps }) { Object.assign(this, { warmup_steps, total_steps }); }
  lr(base, k) {
    if (k < this.warmup_steps) return base * k / Math.max(1, this.warmup_steps);
    return base * Math.max(0, (this.total_steps - k) / Math.max(1, this.total_steps - this.warmup_steps));
  }
}

export const SCHEDULES = { StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, OneCycleLR, WarmupCosineLR, WarmupLinearLR };

/** A schedule from the manifest's {type, args} (or a checkpoint's). */
export function fromJSON({ type, args }) {
  const Cls = SCHEDULES[type];
  if (!Cls) throw new TrainerError(`unknown schedule ${JSON.stringify(type)}; known: ${Object.keys(SCHEDULES).join(', ')}`);
  return new Cls(args);
}

/** {type, args} of a schedule, as the manifest stores it. */
export function toJSON(schedule) {
  const type = Object.keys(SCHEDULES).find((name) => schedule instanceof SCHEDULES[name]);
  if (!type) throw new TrainerError('not a schedule of this package');
  return { type, args: { ...schedule } };
}
