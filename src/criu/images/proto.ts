/**
 * A minimal protocol-buffers wire decoder: enough for the handful of CRIU image messages
 * dormant reads. Hand-written rather than generated (@bufbuild/protobuf) because dormant
 * needs only ~20 messages, only decoding, and must treat every byte as hostile: each read
 * is bounds-checked, lengths are capped by what is left, and any violation is one
 * CRIU_IMAGE_MALFORMED error instead of a crash or a huge allocation.
 */
import { DormantError, ErrorCode } from '../../domain/errors.js';

export const WireType = { VARINT: 0, I64: 1, LEN: 2, I32: 5 } as const;

/** One decoded field: its number, wire type and value (bigint for varints and I64, bytes for LEN). */
export type Field =
  | { no: number; wire: 0; value: bigint }
  | { no: number; wire: 1; value: bigint }
  | { no: number; wire: 2; value: Uint8Array }
  | { no: number; wire: 5; value: number };

export function malformed(what: string, cause?: unknown): DormantError {
  return new DormantError(ErrorCode.CRIU_IMAGE_MALFORMED, `malformed CRIU image: ${what}`, {
    cause,
    hint: 'the checkpoint is damaged or was not written by CRIU',
  });
}

/** Reads a base-128 varint at `pos`; returns [value, next position]. */
export function readVarint(buf: Uint8Array, pos: number): [bigint, number] {
  let result = 0n;
  let shift = 0n;
  for (let i = 0; i < 10; i++) {
    if (pos >= buf.length) throw malformed('varint runs past the end of the message');
    const b = buf[pos++]!;
    result |= BigInt(b & 0x7f) << shift;
    if ((b & 0x80) === 0) return [BigInt.asUintN(64, result), pos];
    shift += 7n;
  }
  throw malformed('varint longer than 10 bytes');
}

/** Splits a message into its fields, in wire order. Groups (wire types 3/4) are refused. */
export function decodeFields(buf: Uint8Array): Field[] {
  const fields: Field[] = [];
  let pos = 0;
  while (pos < buf.length) {
    const [key, p1] = readVarint(buf, pos);
    pos = p1;
    if (key > 0xffffffffn) throw malformed('field key out of range');
    const no = Number(key >> 3n);
    const wire = Number(key & 7n);
    if (no === 0) throw malformed('field number 0');
    switch (wire) {
      case 0: {
        const [v, p] = readVarint(buf, pos);
        pos = p;
        fields.push({ no, wire: 0, value: v });
        break;
      }
      case 1: {
        if (pos + 8 > buf.length) throw malformed('fixed64 runs past the end');
        const dv = new DataView(buf.buffer, buf.byteOffset + pos, 8);
        fields.push({ no, wire: 1, value: dv.getBigUint64(0, true) });
        pos += 8;
        break;
      }
      case 2: {
        const [len, p] = readVarint(buf, pos);
        if (len > BigInt(buf.length - p))
          throw malformed(`field ${no} claims ${len} bytes, ${buf.length - p} left`);
        const n = Number(len);
        fields.push({ no, wire: 2, value: buf.subarray(p, p + n) });
        pos = p + n;
        break;
      }
      case 5: {
        if (pos + 4 > buf.length) throw malformed('fixed32 runs past the end');
        const dv = new DataView(buf.buffer, buf.byteOffset + pos, 4);
        fields.push({ no, wire: 5, value: dv.getUint32(0, true) });
        pos += 4;
        break;
      }
      default:
        throw malformed(`unsupported wire type ${wire} (field ${no})`);
    }
  }
  return fields;
}

const utf8 = new TextDecoder('utf-8', { fatal: false });

/** Typed access to a decoded message; absent fields give undefined or []. */
export class Msg {
  private readonly byNo = new Map<number, Field[]>();
  constructor(buf: Uint8Array) {
    for (const f of decodeFields(buf)) {
      const list = this.byNo.get(f.no);
      if (list) list.push(f);
      else this.byNo.set(f.no, [f]);
    }
  }
  has(no: number): boolean {
    return this.byNo.has(no);
  }
  private last(no: number): Field | undefined {
    const l = this.byNo.get(no);
    return l?.[l.length - 1];
  }
  /** A uint64/uint32/enum/bool varint as a bigint. */
  big(no: number): bigint | undefined {
    const f = this.last(no);
    if (f === undefined) return undefined;
    if (f.wire === 0 || f.wire === 1) return f.value;
    if (f.wire === 5) return BigInt(f.value);
    throw malformed(`field ${no} has the wrong wire type`);
  }
  /** A 32-bit or 53-bit-safe unsigned value as a number. */
  num(no: number): number | undefined {
    const v = this.big(no);
    if (v === undefined) return undefined;
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw malformed(`field ${no} is too large`);
    return Number(v);
  }
  /** An int32 (two's complement in a 64-bit varint). */
  int32(no: number): number | undefined {
    const v = this.big(no);
    return v === undefined ? undefined : Number(BigInt.asIntN(32, v));
  }
  /** A zigzag-encoded sint32/sint64 (safe range). */
  sint(no: number): number | undefined {
    const v = this.big(no);
    if (v === undefined) return undefined;
    return Number((v >> 1n) ^ -(v & 1n));
  }
  bool(no: number): boolean | undefined {
    const v = this.big(no);
    return v === undefined ? undefined : v !== 0n;
  }
  bytes(no: number): Uint8Array | undefined {
    const f = this.last(no);
    if (f === undefined) return undefined;
    if (f.wire !== 2) throw malformed(`field ${no} is not length-delimited`);
    return f.value;
  }
  str(no: number): string | undefined {
    const b = this.bytes(no);
    return b === undefined ? undefined : utf8.decode(b);
  }
  /**
   * A singular embedded message. One written twice is refused: protobuf-c (CRIU) would merge
   * the two (repeated fields concatenated), so reading only the last could judge other values
   * than CRIU restores.
   */
  msg(no: number): Msg | undefined {
    if ((this.byNo.get(no)?.length ?? 0) > 1) throw malformed(`field ${no}: embedded message given twice`);
    const b = this.bytes(no);
    return b === undefined ? undefined : new Msg(b);
  }
  /** A uint32 as protobuf-c reads it: the low 32 bits of the varint. */
  u32(no: number): number | undefined {
    const v = this.big(no);
    return v === undefined ? undefined : Number(BigInt.asUintN(32, v));
  }
  /** Repeated uint32 (packed or not), each the low 32 bits of its varint, as protobuf-c reads them. */
  u32s(no: number): number[] {
    return this.bigs(no).map((v) => Number(BigInt.asUintN(32, v)));
  }
  /** Repeated embedded messages. */
  msgs(no: number): Msg[] {
    return (this.byNo.get(no) ?? []).map((f) => {
      if (f.wire !== 2) throw malformed(`field ${no} is not length-delimited`);
      return new Msg(f.value);
    });
  }
  strs(no: number): string[] {
    return (this.byNo.get(no) ?? []).map((f) => {
      if (f.wire !== 2) throw malformed(`field ${no} is not length-delimited`);
      return utf8.decode(f.value);
    });
  }
  /** Repeated varints, packed or not. */
  nums(no: number): number[] {
    const out: number[] = [];
    for (const f of this.byNo.get(no) ?? []) {
      if (f.wire === 0) out.push(Number(BigInt.asUintN(53, f.value)));
      else if (f.wire === 5) out.push(f.value);
      else if (f.wire === 2) {
        let p = 0;
        while (p < f.value.length) {
          const [v, n] = readVarint(f.value, p);
          out.push(Number(BigInt.asUintN(53, v)));
          p = n;
        }
      } else throw malformed(`field ${no}: unexpected wire type`);
    }
    return out;
  }
  /** Repeated uint64 as bigints (packed or not). */
  bigs(no: number): bigint[] {
    const out: bigint[] = [];
    for (const f of this.byNo.get(no) ?? []) {
      if (f.wire === 0 || f.wire === 1) out.push(f.value);
      else if (f.wire === 2) {
        let p = 0;
        while (p < f.value.length) {
          const [v, n] = readVarint(f.value, p);
          out.push(v);
          p = n;
        }
      } else throw malformed(`field ${no}: unexpected wire type`);
    }
    return out;
  }
  /** A required field: throws when absent. */
  req<T>(no: number, v: T | undefined, what: string): T {
    if (v === undefined) throw malformed(`${what}: required field ${no} missing`);
    return v;
  }
}
