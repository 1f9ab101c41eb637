/** Compares dotted versions numerically: `4.10` > `4.2`. Non-numeric suffixes (`1.1.5+ds1`) are ignored. */
export function compareVersions(a: string, b: string): number {
  const parse = (v: string): number[] =>
    (/^\d+(?:\.\d+)*/.exec(v.trim())?.[0] ?? '0').split('.').map((n) => Number.parseInt(n, 10));
  const x = parse(a);
  const y = parse(b);
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    const d = (x[i] ?? 0) - (y[i] ?? 0);
    if (d !== 0) return d < 0 ? -1 : 1;
  }
  return 0;
}

export function versionAtLeast(have: string, want: string): boolean {
  return compareVersions(have, want) >= 0;
}

/** This build's version: the CLI's `--version`, `dormant version` and the API's /v1/health. */
export const DORMANT_VERSION = '0.1.0';
