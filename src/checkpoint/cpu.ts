/**
 * The CPU features a checkpoint's processes hold state of, read from the images themselves:
 * each x86 thread's XSAVE area (core-N.img) says which state components were in use
 * (xstate_bv), and a component in use is an instruction set the process ran (AVX-512's opmask
 * and upper ZMM registers, AMX's tiles). Restored on a CPU without it, the process dies with an
 * invalid-opcode trap at its next such instruction. podman's and CRI-O's archives have no
 * cpuinfo.img (it is written only when asked for), so this is what an import records, as the
 * /proc/cpuinfo flag names domain/compat.ts compares with the node's.
 */
import { readdir } from 'node:fs/promises';
import { Magic } from '../criu/images/image-file.js';
import { decodeFields, type Field } from '../criu/images/proto.js';
import { imageBudget, readImageEntries } from '../criu/images/reader.js';

/** XSAVE state components (the bits of xstate_bv) and the cpuinfo flag that provides each. */
const XSTATE_FLAGS: readonly [bit: number, flag: string][] = [
  [2, 'avx'],
  [5, 'avx512f'],
  [6, 'avx512f'],
  [7, 'avx512f'],
  [9, 'pku'],
  [17, 'amx_tile'],
  [18, 'amx_tile'],
];

// core_entry.thread_info (2, x86) -> fpregs (3) -> xsave (13) -> xstate_bv (1); CRIU's core-x86.proto.
const sub = (fields: Field[], no: number): Field[] | undefined => {
  const f = fields.find((x) => x.no === no && x.wire === 2);
  return f && f.wire === 2 ? decodeFields(f.value) : undefined;
};

/** The union of xstate_bv over every x86 thread of the dump in `dir` (0n when none says). */
export async function xstateInUse(dir: string): Promise<bigint> {
  const budget = imageBudget();
  let bv = 0n;
  for (const name of await readdir(dir)) {
    if (!/^core-\d+\.img$/.test(name)) continue;
    for (const raw of (await readImageEntries(dir, name, Magic.CORE, budget)) ?? []) {
      const core = decodeFields(raw);
      // mtype 1: x86_64 (aarch64 keeps no XSAVE area).
      if (core.find((f) => f.no === 1)?.value !== 1n) continue;
      const xsave = sub(sub(sub(core, 2) ?? [], 3) ?? [], 13);
      const v = xsave?.find((f) => f.no === 1 && f.wire === 0)?.value;
      if (typeof v === 'bigint') bv |= v;
    }
  }
  return bv;
}

/** The cpuinfo flags a dump's processes need, by the state components they had in use. */
export async function cpuFlagsInUse(dir: string): Promise<string[]> {
  const bv = await xstateInUse(dir);
  return [...new Set(XSTATE_FLAGS.filter(([bit]) => (bv >> BigInt(bit)) & 1n).map(([, f]) => f))].sort();
}
