/** A seeded random number generator for the fuzz tests: a failing round can be run again. */

/** xorshift32: small, seeded, reproducible; numbers in [0, 1). */
export function rng(seed: number): () => number {
  let x = seed >>> 0 || 1;
  return () => {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return x / 0x100000000;
  };
}
