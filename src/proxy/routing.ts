/**
 * How the wake proxy reads a request: which sandbox and port a Host header names
 * (`PORT-REF.<domain>`, REF being a sandbox id or name), and where the caller's dormant token
 * is (and how to take it out before the request reaches the sandbox, which runs untrusted code
 * and must never see it). No I/O.
 */

export interface Route {
  port: number;
  /** A sandbox id or name. */
  ref: string;
}

/** `8080-sb-abc.dormant.localhost:7421` -> {port: 8080, ref: 'sb-abc'}; undefined if not ours. */
export function parseHost(host: string | undefined, domain: string): Route | undefined {
  if (host === undefined) return undefined;
  const name = host.trim().toLowerCase().replace(/:\d+$/, '').replace(/\.$/, '');
  const suffix = `.${domain.toLowerCase()}`;
  if (!name.endsWith(suffix)) return undefined;
  const label = name.slice(0, -suffix.length);
  const m = /^(\d{1,5})-([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)$/.exec(label);
  if (!m) return undefined;
  const port = Number(m[1]);
  if (port < 1 || port > 65535) return undefined;
  return { port, ref: m[2]! };
}

/** The host name of a sandbox port on the proxy. */
export function hostFor(port: number, ref: string, domain: string): string {
  return `${port}-${ref}.${domain}`;
}

/**
 * dormant's own cookie. `__Host-`: a browser takes it only from the host itself, without a
 * Domain, with Path=/ and Secure, so a sandbox (by a header or by script) cannot set one that
 * other sandboxes' hosts would receive. Browsers accept Secure cookies over plain HTTP on
 * `localhost` and its subdomains (the default domain); elsewhere the proxy belongs behind TLS.
 */
export const TOKEN_COOKIE = '__Host-dormant_token';
/** The cookie's name before `__Host-`: never taken as a token, and removed before a request goes on. */
export const LEGACY_TOKEN_COOKIE = 'dormant_token';

/**
 * Whether a `Set-Cookie` value sets dormant's cookie under any spelling a browser might store
 * (any case, with or without a `__Host-` or `__Secure-` prefix): a sandbox's answer never may.
 */
export function setsTokenCookie(value: string): boolean {
  const eq = value.indexOf('=');
  const name = (eq < 0 ? value : value.slice(0, eq)).trim().toLowerCase();
  return name.replace(/^__(host|secure)-/, '') === LEGACY_TOKEN_COOKIE;
}
export const TOKEN_PARAM = 'dormant_token';
export const TOKEN_HEADER = 'x-dormant-token';
/** Bearer tokens with this prefix are dormant's; any other Authorization goes to the sandbox. */
const TOKEN_PREFIX = 'dmt_';

export interface Credentials {
  token?: string;
  /** Where it came from: a token from the query string is turned into a cookie for the browser. */
  from?: 'authorization' | 'header' | 'cookie' | 'query';
  /** The request path with the token parameter removed. */
  path: string;
  /** Header values to send on instead of the caller's (undefined: drop the header). */
  headers: { authorization?: string | undefined; cookie?: string | undefined; [TOKEN_HEADER]?: undefined };
  /** Which of `headers` to apply. */
  rewrite: ('authorization' | 'cookie' | typeof TOKEN_HEADER)[];
}

/**
 * Finds the caller's dormant token and says how to scrub it from what is forwarded. Looked for,
 * in order: `Authorization: Bearer dmt_...`, `X-Dormant-Token`, the `dormant_token` cookie, the
 * `dormant_token` query parameter. All of them are removed, wherever the token was found.
 */
export function extractCredentials(
  path: string,
  headers: {
    authorization?: string | undefined;
    cookie?: string | undefined;
    [TOKEN_HEADER]?: string | string[] | undefined;
  },
): Credentials {
  const out: Credentials = { path, headers: {}, rewrite: [] };
  const found = (token: string, from: NonNullable<Credentials['from']>): void => {
    if (out.token === undefined && token !== '') {
      out.token = token;
      out.from = from;
    }
  };
  const auth = headers.authorization;
  const bearer = auth === undefined ? undefined : /^Bearer\s+(\S+)$/i.exec(auth);
  if (bearer && bearer[1]!.startsWith(TOKEN_PREFIX)) {
    found(bearer[1]!, 'authorization');
    out.headers.authorization = undefined;
    out.rewrite.push('authorization');
  }
  const hv = headers[TOKEN_HEADER];
  if (hv !== undefined) {
    found((Array.isArray(hv) ? hv[0] : hv) ?? '', 'header');
    out.rewrite.push(TOKEN_HEADER);
  }
  if (headers.cookie !== undefined && headers.cookie.includes(`${LEGACY_TOKEN_COOKIE}=`)) {
    const kept: string[] = [];
    for (const part of headers.cookie.split(';')) {
      const [k, ...v] = part.trim().split('=');
      // Only the host-only cookie is a credential; the old name (which a page could have set
      // for the whole domain) is dropped, never believed, and never reaches the sandbox.
      if (k === TOKEN_COOKIE) found(decodeURIComponent(v.join('=')), 'cookie');
      else if (k === LEGACY_TOKEN_COOKIE) continue;
      else if (part.trim() !== '') kept.push(part.trim());
    }
    out.headers.cookie = kept.length > 0 ? kept.join('; ') : undefined;
    out.rewrite.push('cookie');
  }
  const q = path.indexOf('?');
  if (q >= 0 && path.includes(`${TOKEN_PARAM}=`, q)) {
    const params = new URLSearchParams(path.slice(q + 1));
    const t = params.get(TOKEN_PARAM);
    if (t !== null) found(t, 'query');
    params.delete(TOKEN_PARAM);
    const rest = params.toString();
    out.path = path.slice(0, q) + (rest === '' ? '' : `?${rest}`);
  }
  return out;
}
