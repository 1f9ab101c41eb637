/** Human durations and sizes at the edges; milliseconds and bytes inside. */

const DURATION_UNITS: Record<string, number> = {
  ms: 1,
  s: 1000,
  m: 60_000,
  h: 3_600_000,
  d: 86_400_000,
  w: 604_800_000,
};

/** Parses `1500ms`, `30s`, `15m`, `1h30m`, `7d` into milliseconds. Throws a RangeError naming the input. */
export function parseDurationMs(text: string): number {
  const s = text.trim();
  if (s === '' || s.length > 64)
    throw new RangeError(`invalid duration "${text}": expected e.g. 30s, 15m, 7d`);
  if (/^\d+$/.test(s)) throw new RangeError(`invalid duration "${text}": give a unit (ms, s, m, h, d, w)`);
  const re = /(\d+(?:\.\d+)?)(ms|s|m|h|d|w)/gy;
  let total = 0;
  let pos = 0;
  for (const m of s.matchAll(re)) {
    if (m.index !== pos) break;
    total += Number(m[1]) * DURATION_UNITS[m[2]!]!;
    pos += m[0].length;
  }
  if (pos !== s.length) throw new RangeError(`invalid duration "${text}": expected e.g. 30s, 15m, 1h30m, 7d`);
  return Math.round(total);
}

/** Formats milliseconds the way people read them: `850ms`, `12s`, `15m`, `2h5m`, `7d`. */
export function formatDurationMs(ms: number): string {
  if (!Number.isFinite(ms)) return String(ms);
  if (ms < 1000) return `${Math.round(ms)}ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(ms < 10_000 ? 1 : 0).replace(/\.0$/, '')}s`;
  const parts: string[] = [];
  let rest = Math.round(ms / 1000);
  for (const [unit, secs] of [
    ['d', 86_400],
    ['h', 3600],
    ['m', 60],
    ['s', 1],
  ] as const) {
    const n = Math.floor(rest / secs);
    if (n > 0) parts.push(`${n}${unit}`);
    rest -= n * secs;
    if (parts.length === 2) break;
  }
  return parts.join('');
}

const SIZE_UNITS: Record<string, number> = {
  '': 1,
  b: 1,
  k: 1024,
  kb: 1024,
  kib: 1024,
  m: 1024 ** 2,
  mb: 1024 ** 2,
  mib: 1024 ** 2,
  g: 1024 ** 3,
  gb: 1024 ** 3,
  gib: 1024 ** 3,
  t: 1024 ** 4,
  tb: 1024 ** 4,
  tib: 1024 ** 4,
};

/** Parses `512M`, `1G`, `1.5GiB`, `4096` into bytes (binary units, as memory limits are). */
export function parseSizeBytes(text: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/.exec(text);
  const unit = m ? SIZE_UNITS[m[2]!.toLowerCase()] : undefined;
  if (!m || unit === undefined) throw new RangeError(`invalid size "${text}": expected e.g. 512M, 2G`);
  return Math.round(Number(m[1]) * unit);
}

/** Formats bytes as `1.5 GiB`, `512 MiB`, `900 B`. */
export function formatBytes(bytes: number): string {
  if (!Number.isFinite(bytes)) return String(bytes);
  const sign = bytes < 0 ? '-' : '';
  let v = Math.abs(bytes);
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${sign}${v.toFixed(digits)} ${units[i]}`;
}
