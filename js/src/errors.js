// The errors the trainer raises. Each message names the file, input or field, what was
// expected and what was found; nothing has changed when one is thrown.

/** Bad input: a manifest, file, batch, learning rate or state that does not fit the export. */
export class TrainerError extends Error {
  constructor(message) {
    super(message);
    this.name = 'TrainerError';
  }
}

/** Raised by step() on a NaN or infinite loss (onNonFinite "raise"); the state is left as it was. */
export class NonFiniteLossError extends TrainerError {
  constructor(message) {
    super(message);
    this.name = 'NonFiniteLossError';
  }
}

/** JSON.stringify for messages (undefined and functions included). */
export function show(value) {
  if (value === undefined) return 'undefined';
  if (typeof value === 'bigint') return `${value}`;
  try {
    const text = JSON.stringify(value);
    return text === undefined ? String(value) : text.length > 80 ? `${text.slice(0, 77)}...` : text;
  } catch {
    return String(value);
  }
}
