/** Database URLs as logs, errors and `dormant config` may show them. No I/O, no driver: the CLI loads it. */

/** The URL as it may be shown: without its password. */
export function redactUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password !== '') u.password = '';
    for (const k of ['password', 'sslpassword']) if (u.searchParams.has(k)) u.searchParams.set(k, '***');
    return u.toString();
  } catch {
    return url.replace(/password=\S*/gi, (m) => `${m.slice(0, m.indexOf('=') + 1)}***`);
  }
}
