/**
 * Can a checkpoint be restored on this node? CRIU restores processes exactly as they were,
 * instructions and all: a different architecture cannot run them, a CPU without an
 * instruction set extension the processes detected at start (AVX-512, say) crashes them
 * later, and an older CRIU may not read newer images. Checked before every restore.
 */
import { compareVersions } from './version.js';

export interface PlatformFacts {
  arch: string;
  criuVersion: string;
  /** CPU flags from /proc/cpuinfo. */
  cpuFlags: readonly string[];
}

/**
 * CPU flags that user-space code detects with CPUID and then relies on. Flags outside this
 * set (virtualisation, power management, bug markers) differ between hosts harmlessly.
 */
const USER_VISIBLE_FLAG =
  /^(sse\d?(_\d)?|ssse3|sse4_[12]|sse4a|avx\w*|fma4?|f16c|bmi[12]|adx|aes|vaes|pclmulqdq|vpclmulqdq|sha_ni|popcnt|lzcnt|abm|movbe|rdrand|rdseed|xsave\w*|pku|ospke|gfni|amx\w*|erms|fsrm|clflushopt|clwb|cx16|mmx|fxsr|cmov|movdir\w*|serialize|lm|asimd\w*|sve\w*|sha[123]|sha512|crc32|atomics|fp|fphp)$/;

/** The platform facts a checkpoint's record carries in its meta (those it has). */
export function checkpointFacts(m: Record<string, unknown>): Partial<PlatformFacts> {
  return {
    ...(typeof m.arch === 'string' ? { arch: m.arch } : {}),
    ...(typeof m.criuVersion === 'string' ? { criuVersion: m.criuVersion } : {}),
    ...(Array.isArray(m.cpuFlags)
      ? { cpuFlags: m.cpuFlags.filter((f): f is string => typeof f === 'string') }
      : {}),
  };
}

/** Problems that forbid restoring a checkpoint made on `from` onto `to`; empty when it may. */
export function restoreProblems(from: Partial<PlatformFacts>, to: PlatformFacts): string[] {
  const problems: string[] = [];
  if (from.arch !== undefined && from.arch !== to.arch) {
    problems.push(`the checkpoint was made on ${from.arch}, this node is ${to.arch}`);
  }
  if (from.criuVersion !== undefined && compareVersions(to.criuVersion, from.criuVersion) < 0) {
    problems.push(
      `the checkpoint was made by CRIU ${from.criuVersion}, this node has the older ${to.criuVersion}`,
    );
  }
  if (from.cpuFlags !== undefined) {
    const have = new Set(to.cpuFlags);
    const missing = from.cpuFlags.filter((f) => USER_VISIBLE_FLAG.test(f) && !have.has(f));
    if (missing.length > 0) {
      problems.push(
        `this node's CPU lacks features the checkpoint's processes may use: ${missing.join(', ')}`,
      );
    }
  }
  return problems;
}
