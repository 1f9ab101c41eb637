/**
 * Secret detectors: pure functions over bytes, no I/O. One combined regular expression
 * runs over each chunk (decoded as latin1, so string offsets are byte offsets); each match
 * is classified into a kind. Findings carry a redacted preview and a keyed fingerprint,
 * never the secret itself.
 */
import { createHmac } from 'node:crypto';

export const SECRET_KINDS = [
  'aws_access_key',
  'gcp_api_key',
  'gcp_service_account',
  'azure_storage_key',
  'azure_client_secret',
  'github_token',
  'gitlab_token',
  'openai_api_key',
  'anthropic_api_key',
  'slack_token',
  'slack_webhook',
  'stripe_key',
  'jwt',
  'private_key',
  'ssh_private_key',
  'secret_assignment',
  'high_entropy_assignment',
] as const;
export type SecretKind = (typeof SECRET_KINDS)[number];

/** Specific token shapes: [kind, pattern]. Order matters (sk-ant- before sk-). */
const SPECIFIC: [SecretKind, string][] = [
  ['aws_access_key', String.raw`(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![0-9A-Za-z])`],
  ['gcp_api_key', String.raw`AIza[0-9A-Za-z_\-]{35}`],
  ['gcp_service_account', String.raw`"type"\s*:\s*"service_account"`],
  ['azure_storage_key', String.raw`AccountKey=[A-Za-z0-9+/]{86}==`],
  ['azure_client_secret', String.raw`[A-Za-z0-9_~.\-]{3}[0-9]Q~[A-Za-z0-9_~.\-]{31,34}`],
  ['github_token', String.raw`(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{60,255})`],
  ['gitlab_token', String.raw`gl(?:pat|dt|rt|ptt|cbt)-[A-Za-z0-9_\-]{20,64}`],
  ['anthropic_api_key', String.raw`sk-ant-[A-Za-z0-9]{2,8}-[A-Za-z0-9_\-]{32,128}`],
  ['openai_api_key', String.raw`sk-(?:proj-|svcacct-|admin-|None-)?[A-Za-z0-9_\-]{20,200}`],
  [
    'slack_webhook',
    String.raw`https://hooks\.slack\.com/services/T[A-Z0-9]{6,}/B[A-Z0-9]{6,}/[A-Za-z0-9]{20,}`,
  ],
  ['slack_token', String.raw`xox[abposr]-[0-9A-Za-z\-]{10,250}`],
  ['stripe_key', String.raw`(?:sk|rk|pk)_(?:live|test)_[0-9A-Za-z]{20,250}`],
  ['jwt', String.raw`eyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{16,}`],
  ['ssh_private_key', String.raw`-----BEGIN OPENSSH PRIVATE KEY-----`],
  ['private_key', String.raw`-----BEGIN (?:RSA |EC |DSA |ENCRYPTED |PGP )?PRIVATE KEY(?: BLOCK)?-----`],
];

/** A name that says "secret", then `=` or `:`, then the value (matched at the keyword). */
const ASSIGN = new RegExp(
  String.raw`(?:[Kk]ey|KEY|[Tt]oken|TOKEN|[Ss]ecret|SECRET|[Pp]assw(?:or)?d|PASSW(?:OR)?D|[Pp]wd|PWD|[Cc]redentials?|CREDENTIALS?)["']?[ \t]{0,4}[=:][ \t]{0,4}["']?([^\s"'\0,;{}<>\[\]()\\]{6,512})`,
  'y',
);

/**
 * Stage one: cheap anchors (literal prefixes of every shape, and the secret-ish names).
 * V8 runs this at a few hundred MB/s; the full patterns then run only where it hits.
 */
const ANCHOR =
  /AKIA|ASIA|ABIA|ACCA|AIza|"type"|AccountKey=|[0-9]Q~|gh[pousr]_|github_pat_|gl(?:pat|dt|rt|ptt|cbt)-|sk-|https:\/\/hooks\.slack\.com|xox[abposr]-|(?:sk|rk|pk)_(?:live|test)_|eyJ|-----BEGIN |[Kk]ey|KEY|[Tt]oken|TOKEN|[Ss]ecret|SECRET|[Pp]assw|PASSW|[Pp]wd|PWD|[Cc]redential|CREDENTIAL/g;
/** Stage two: each specific shape, anchored where stage one hit (sticky). */
const STICKY = SPECIFIC.map(([kind, p]) => [kind, new RegExp(p, 'y')] as const);
const AZURE_BACK = 4; // the Azure client secret's anchor ([0-9]Q~) sits 3 characters in
const EXACT_ANYWHERE = SPECIFIC.map(([kind, p]) => [kind, new RegExp(`^(?:${p})`)] as const);
const NAME_CHAR = /[A-Za-z0-9_.-]/;

export interface RawSecret {
  kind: SecretKind;
  /** Byte offset of the secret's first byte in the scanned buffer. */
  offset: number;
  length: number;
  /** The variable name for assignments (not secret). */
  name?: string;
  /** The secret's text: used for the preview and fingerprint, then dropped. */
  value: string;
}

/** Shannon entropy in bits per character. */
export function entropy(s: string): number {
  const counts = new Map<string, number>();
  for (const c of s) counts.set(c, (counts.get(c) ?? 0) + 1);
  let h = 0;
  for (const n of counts.values()) {
    const p = n / s.length;
    h -= p * Math.log2(p);
  }
  return h;
}

/** Names that match the pattern but never hold secrets (the shell's working directories). */
const NOT_SECRET_NAMES = new Set(['PWD', 'OLDPWD', 'pwd', 'oldpwd']);

function looksLikeEnvName(name: string): boolean {
  if (NOT_SECRET_NAMES.has(name)) return false;
  return (
    /^[A-Z][A-Z0-9_]*$/.test(name) &&
    /(?:_|^)(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|CREDENTIALS?)$/.test(name)
  );
}

const PLACEHOLDER =
  /^(?:\$\{?[A-Za-z_]|%[sd]|\*+$|x{6,}$|<|null$|none$|true$|false$|undefined$|changeme$|redacted$|example$)/i;

function specificAt(
  text: string,
  i: number,
): { kind: SecretKind; offset: number; value: string } | undefined {
  for (const [kind, re] of STICKY) {
    const at = kind === 'azure_client_secret' ? i - AZURE_BACK + 1 : i;
    if (at < 0) continue;
    re.lastIndex = at;
    const m = re.exec(text);
    if (m) return { kind, offset: at, value: m[0] };
  }
  return undefined;
}

/**
 * The detectors at one anchor: `idx` is where an anchor literal of `anchorLength` characters
 * starts in `text`. Pushes what it finds (offsets in `text` plus `shift`) and returns where the
 * search for the next anchor resumes: after the secret, after the assignment, or after the
 * anchor.
 */
function detectAt(text: string, idx: number, anchorLength: number, out: RawSecret[], shift: number): number {
  const sp = specificAt(text, idx);
  if (sp) {
    out.push({ kind: sp.kind, offset: sp.offset + shift, length: sp.value.length, value: sp.value });
    return sp.offset + sp.value.length;
  }
  ASSIGN.lastIndex = idx;
  const m = ASSIGN.exec(text);
  if (!m) return idx + anchorLength;
  const value = m[1]!;
  const whole = m[0];
  // The name runs backwards from the keyword over identifier characters.
  let start = idx;
  while (start > 0 && idx - start < 128 && NAME_CHAR.test(text[start - 1]!)) start--;
  const keywordEnd = whole.search(/["']?[ \t]{0,4}[=:]/);
  const name = text.slice(start, idx + keywordEnd);
  const valueOffset = idx + whole.length - value.length + shift;
  const next = idx + whole.length;
  if (PLACEHOLDER.test(value) || NOT_SECRET_NAMES.has(name)) return next;
  const specific = EXACT_ANYWHERE.find(([, re]) => re.test(value));
  if (specific) {
    const sm = specific[1].exec(value)![0];
    out.push({ kind: specific[0], offset: valueOffset, length: sm.length, name, value: sm });
  } else if (looksLikeEnvName(name) && value.length >= 8) {
    out.push({ kind: 'secret_assignment', offset: valueOffset, length: value.length, name, value });
  } else if (value.length >= 16 && entropy(value) >= 3.5 && /[0-9]/.test(value) && /[A-Za-z]/.test(value)) {
    out.push({ kind: 'high_entropy_assignment', offset: valueOffset, length: value.length, name, value });
  }
  return next;
}

/**
 * Finds secrets in `text` (a latin1 view of bytes). `offset`s are relative to `text`. The
 * reference form: findSecretsInBytes finds the same over bytes without decoding them all.
 */
export function findSecrets(text: string): RawSecret[] {
  const out: RawSecret[] = [];
  ANCHOR.lastIndex = 0;
  for (let a = ANCHOR.exec(text); a !== null; a = ANCHOR.exec(text)) {
    ANCHOR.lastIndex = detectAt(text, a.index, a[0].length, out, 0);
  }
  return out;
}

/**
 * Shortest text any detector matches: an assignment is a 3-letter name (`key`), `=` and 6
 * characters; every token shape is longer.
 */
export const MIN_SECRET_CHARS = 10;

/** Bytes a secret (and the name before it) is made of: printable ASCII, tab, CR, LF. */
const TEXT_BYTE = new Uint8Array(256);
for (let c = 0x20; c < 0x7f; c++) TEXT_BYTE[c] = 1;
TEXT_BYTE[0x09] = TEXT_BYTE[0x0a] = TEXT_BYTE[0x0d] = 1;

/**
 * The prefilter: regions of `buf` that hold runs of at least `minRun` text bytes, as flat
 * [start, end) pairs; runs closer than `maxGap` bytes are merged into one region. It looks
 * at one byte in `minRun` where there is no text (a byte that is not text ends every run
 * through it), so random and zero pages pass at memory speed and the detectors run only on
 * the text in them.
 */
/**
 * The end of a run of text bytes that goes on at `e`: the first byte at or after `e` that is
 * not text, or `n`. Over `words` (the same bytes, when they start 4-aligned) it steps a word
 * at a time while all four bytes are printable (0x20-0x7e), and byte by byte over a word with
 * any other byte (tab, CR and LF are text too).
 */
function runEnd(buf: Uint8Array, words: Int32Array | undefined, e: number, n: number): number {
  if (words === undefined) {
    while (e < n && TEXT_BYTE[buf[e]!] === 1) e++;
    return e;
  }
  for (;;) {
    const aligned = Math.min(n, (e + 3) & ~3);
    for (; e < aligned; e++) if (TEXT_BYTE[buf[e]!] === 0) return e;
    let w = e >> 2;
    const nw = words.length;
    while (w < nw) {
      const x = words[w]!;
      // A byte under 0x20, or from 0x7f up, sets its lane's top bit.
      if ((((x - 0x20202020) & ~x) | (x + 0x01010101) | x) & 0x80808080) break;
      w++;
    }
    e = w << 2;
    if (e >= n) return n;
    const end = Math.min(n, e + 4);
    for (; e < end; e++) if (TEXT_BYTE[buf[e]!] === 0) return e;
    if (e >= n) return n;
  }
}

export function textRegions(buf: Uint8Array, minRun = MIN_SECRET_CHARS, maxGap = 16): number[] {
  const out: number[] = [];
  const n = buf.length;
  const words =
    (buf.byteOffset & 3) === 0 && n >= 64 ? new Int32Array(buf.buffer, buf.byteOffset, n >> 2) : undefined;
  let i = 0;
  while (i + minRun <= n) {
    const p = i + minRun - 1;
    if (TEXT_BYTE[buf[p]!] === 0) {
      i = p + 1;
      continue;
    }
    // buf[i - 1] is not text (or i is 0): the run cannot start before i.
    let s = p;
    while (s > i && TEXT_BYTE[buf[s - 1]!] === 1) s--;
    const e = runEnd(buf, words, p + 1, n);
    if (e - s >= minRun) {
      const last = out.length - 1;
      if (last > 0 && s - out[last]! <= maxGap) out[last] = e;
      else out.push(s, e);
    }
    i = e + 1;
  }
  return out;
}

/**
 * The anchors of ANCHOR as byte literals, in its order (at any one position at most one of
 * them matches), each with how far past its start a detector anchored there can read: a
 * fixed bound for the bounded shapes, or "while the bytes are of this set" for the three
 * shapes with an open-ended part (JWTs, Slack webhooks, the service-account `"type"`).
 */
interface ByteAnchor {
  bytes: Uint8Array;
  /** Bytes past the anchor's start that a match (and a lookahead after it) can reach. */
  reach: number;
  /** Or: a match runs only over bytes of this set (the window ends at the first other byte). */
  runOf?: Uint8Array;
}

function byteSet(chars: string): Uint8Array {
  const set = new Uint8Array(256);
  for (const c of chars) set[c.charCodeAt(0)] = 1;
  return set;
}
const ALNUM = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789';
/** Longest assignment: an 11-character keyword, a quote, 4 blanks, `=`, 4 blanks, a quote, 512. */
const ASSIGN_REACH = 11 + 1 + 4 + 1 + 4 + 1 + 512 + 16;
const BYTE_ANCHORS: ByteAnchor[] = (
  [
    ...['AKIA', 'ASIA', 'ABIA', 'ACCA'].map((a) => ({ a, reach: 21 })),
    { a: 'AIza', reach: 39 },
    { a: '"type"', reach: 0, runOf: byteSet(`${ALNUM}_":\t\n\r\v\f `) },
    { a: 'AccountKey=', reach: 99 },
    ...'0123456789'.split('').map((d) => ({ a: `${d}Q~`, reach: 37 })),
    ...'pousr'.split('').map((c) => ({ a: `gh${c}_`, reach: 259 })),
    { a: 'github_pat_', reach: 266 },
    ...['pat', 'dt', 'rt', 'ptt', 'cbt'].map((x) => ({ a: `gl${x}-`, reach: 70 })),
    { a: 'sk-', reach: 211 },
    { a: 'https://hooks.slack.com', reach: 0, runOf: byteSet(`${ALNUM}/:.`) },
    ...'abposr'.split('').map((c) => ({ a: `xox${c}-`, reach: 255 })),
    ...['sk', 'rk', 'pk'].flatMap((x) => ['live', 'test'].map((y) => ({ a: `${x}_${y}_`, reach: 258 }))),
    { a: 'eyJ', reach: 0, runOf: byteSet(`${ALNUM}_-.`) },
    { a: '-----BEGIN ', reach: 60 },
    ...[
      'Key',
      'key',
      'KEY',
      'Token',
      'token',
      'TOKEN',
      'Secret',
      'secret',
      'SECRET',
      'Passw',
      'passw',
      'PASSW',
    ].map((a) => ({ a, reach: ASSIGN_REACH })),
    ...['Pwd', 'pwd', 'PWD', 'Credential', 'credential', 'CREDENTIAL'].map((a) => ({
      a,
      reach: ASSIGN_REACH,
    })),
  ] as { a: string; reach: number; runOf?: Uint8Array }[]
).map(({ a, reach, runOf }) => ({ bytes: Buffer.from(a, 'latin1'), reach: reach + 8, runOf }));

/** The anchors by their first two bytes (a 64 Ki table), for a scan that looks at each position once. */
const BY_PAIR = new Array<ByteAnchor[] | undefined>(65536);
for (const a of BYTE_ANCHORS) {
  const k = (a.bytes[0]! << 8) | a.bytes[1]!;
  (BY_PAIR[k] ??= []).push(a);
}
const HAS_PAIR = new Uint8Array(65536);
for (let k = 0; k < 65536; k++) if (BY_PAIR[k]) HAS_PAIR[k] = 1;
/**
 * Pairs that are an anchor's first two bytes or its second and third (every anchor has at
 * least three): where the pair at i + 1 is neither, no anchor starts at i or at i + 1, so
 * the loop steps two bytes at a time through text without anchors.
 */
const NEAR_PAIR = new Uint8Array(65536);
for (const a of BYTE_ANCHORS) {
  const b = a.bytes;
  if (b.length < 3)
    throw new RangeError(`anchor ${Buffer.from(b).toString('latin1')} is shorter than 3 bytes`);
  NEAR_PAIR[(b[0]! << 8) | b[1]!] = 1;
  NEAR_PAIR[(b[1]! << 8) | b[2]!] = 1;
}

/** The anchor that starts at `i` of `buf` (before `to`), if any. */
function anchorAt(buf: Uint8Array, i: number, to: number): ByteAnchor | undefined {
  for (const a of BY_PAIR[(buf[i]! << 8) | buf[i + 1]!]!) {
    const b = a.bytes;
    if (i + b.length > to) continue;
    let j = 2;
    while (j < b.length && buf[i + j] === b[j]) j++;
    if (j === b.length) return a;
  }
  return undefined;
}

/** Characters before an anchor a detector can read: the variable name (128) and Azure's 3. */
const LOOK_BEHIND = 128;

/**
 * findSecrets over the bytes of one text region [from, to) of `buf`, without decoding it
 * whole: anchors are found by their bytes, and only a window around each (as far back and
 * forward as a detector anchored there can read) is decoded and run through the detectors,
 * so the result is the same as findSecrets over the region's text.
 */
function findInRegion(buf: Buffer, from: number, to: number, out: RawSecret[]): void {
  let i = from;
  const last = to - 1;
  while (i < last) {
    if (i + 2 <= last && NEAR_PAIR[(buf[i + 1]! << 8) | buf[i + 2]!] === 0) {
      i += 2;
      continue;
    }
    if (HAS_PAIR[(buf[i]! << 8) | buf[i + 1]!] === 0) {
      i++;
      continue;
    }
    const a = anchorAt(buf, i, to);
    if (a === undefined) {
      i++;
      continue;
    }
    let end: number;
    if (a.runOf) {
      end = i + a.bytes.length;
      while (end < to && a.runOf[buf[end]!] === 1) end++;
      end = Math.min(to, end + 1);
    } else end = Math.min(to, i + a.reach);
    const start = Math.max(from, i - LOOK_BEHIND);
    const text = buf.toString('latin1', start, end);
    i = start + detectAt(text, i - start, a.bytes.length, out, start);
  }
}

/**
 * findSecrets over raw bytes, behind the prefilter: only text regions are looked at, and in
 * them only the windows around anchors are decoded. Offsets are relative to `buf`. A value
 * ends at its first byte that is not ASCII text (the detectors alone would run on through
 * high bytes).
 */
export function findSecretsInBytes(buf: Buffer): RawSecret[] {
  const regions = textRegions(buf);
  const out: RawSecret[] = [];
  for (let r = 0; r < regions.length; r += 2) findInRegion(buf, regions[r]!, regions[r + 1]!, out);
  return out;
}

/** A preview that names the secret's shape without revealing it: a short prefix and the length. */
export function redact(kind: SecretKind, value: string, name?: string): string {
  if (kind === 'private_key' || kind === 'ssh_private_key' || kind === 'gcp_service_account') return value;
  const known =
    /^(?:sk-ant-|sk-proj-|sk-|gh[pousr]_|github_pat_|glpat-|xox[abposr]-|(?:sk|rk|pk)_(?:live|test)_|AKIA|ASIA|AIza|eyJ|AccountKey=)/.exec(
      value,
    );
  let keep = known ? known[0].length : 2;
  keep = Math.min(keep, Math.floor(value.length / 4) + (known ? known[0].length : 0), value.length - 4);
  keep = Math.max(0, Math.min(keep, Math.floor(value.length / 3)));
  const preview = `${value.slice(0, keep)}…[${value.length} chars]`;
  return name ? `${name}=${preview}` : preview;
}

/** A keyed fingerprint: equal secrets compare equal within one key; without the key it says nothing. */
export function fingerprint(key: Buffer, value: string): string {
  return createHmac('sha256', key).update(value, 'latin1').digest('hex').slice(0, 16);
}

/** A secret as a scan reports it: where it is and what stands in for it, never its text. */
export interface ChunkHit {
  kind: SecretKind;
  /** Byte offset in the chunk (negative: it starts in the chunk before, found in the seam). */
  offset: number;
  length: number;
  name?: string;
  preview: string;
  fingerprint: string;
}

/**
 * The detectors over one chunk of a stream and its seam with the chunk before: `seam` is the
 * previous chunk's last bytes (`edge` of them) followed by this chunk's first bytes. The seam
 * adds only what crosses the boundary, the chunk alone finds what lies inside it; seam hits
 * come first, as the stream reads. The worker threads and the calling thread both run this,
 * so a scan reports the same with and without workers.
 */
export function scanChunk(key: Buffer, data: Buffer, seam: Buffer | undefined, edge: number): ChunkHit[] {
  const out: ChunkHit[] = [];
  const add = (s: RawSecret, shift: number): void => {
    out.push({
      kind: s.kind,
      offset: s.offset - shift,
      length: s.length,
      ...(s.name !== undefined ? { name: s.name } : {}),
      preview: redact(s.kind, s.value, s.name),
      fingerprint: fingerprint(key, s.value),
    });
  };
  if (seam !== undefined && edge > 0)
    for (const s of findSecretsInBytes(seam)) if (s.offset < edge && s.offset + s.length > edge) add(s, edge);
  for (const s of findSecretsInBytes(data)) add(s, 0);
  return out;
}
