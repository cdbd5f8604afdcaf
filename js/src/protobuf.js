// The few protobuf reads and writes the ONNX walkers need. Every read is bounded by the buffer:
// damaged bytes throw Damaged (callers turn it into an error naming the file), never hang.

/** Bytes that are not a well-formed protobuf message. */
export class Damaged extends Error {}

export function readVarint(buf, pos) {
  let value = 0;
  let scale = 1;
  for (let i = 0; i < 10; i++) {
    if (pos >= buf.length) throw new Damaged(`a varint runs past the end (byte ${pos} of ${buf.length})`);
    const byte = buf[pos++];
    value += (byte & 0x7f) * scale;
    if (byte < 0x80) return [value, pos];
    scale *= 128;
  }
  throw new Damaged(`a varint longer than 10 bytes at byte ${pos - 10}`);
}

export function varint(value) {
  const bytes = [];
  while (value >= 0x80) {
    bytes.push((value % 128) | 0x80);
    value = Math.floor(value / 128);
  }
  bytes.push(value);
  return Uint8Array.from(bytes);
}

/** The fields of a message: [{field, wire, start, end, body: [from, to] for length-delimited}]. */
export function fields(buf) {
  const out = [];
  let pos = 0;
  while (pos < buf.length) {
    const start = pos;
    let key;
    [key, pos] = readVarint(buf, pos);
    const field = Math.floor(key / 8);
    const wire = key & 7;
    if (field === 0) throw new Damaged(`field number 0 at byte ${start}`);
    let body = null;
    if (wire === 0) [, pos] = readVarint(buf, pos);
    else if (wire === 1) pos += 8;
    else if (wire === 5) pos += 4;
    else if (wire === 2) {
      let length;
      [length, pos] = readVarint(buf, pos);
      body = [pos, pos + length];
      pos += length;
    } else throw new Damaged(`unsupported protobuf wire type ${wire} at byte ${start}`);
    if (pos > buf.length) throw new Damaged(`field ${field} at byte ${start} runs past the end (${pos} > ${buf.length} bytes)`);
    out.push({ field, wire, start, end: pos, body });
  }
  return out;
}

export function concat(parts) {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let pos = 0;
  for (const p of parts) {
    out.set(p, pos);
    pos += p.length;
  }
  return out;
}

export function lengthDelimited(field, payload) {
  return concat([varint(field * 8 + 2), varint(payload.length), payload]);
}

/** The UTF-8 text of a length-delimited field. */
export function text(buf, field) {
  return new TextDecoder().decode(buf.subarray(...field.body));
}
