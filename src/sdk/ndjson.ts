/**
 * The reader of newline-delimited JSON bodies (`application/x-ndjson`): a command's output
 * stream and a folder's watch events. Each line is one JSON value.
 */

/**
 * A line longer than this is refused: the daemon's longest line is one output chunk (at most
 * 1 MiB of bytes, base64) with its envelope, so anything past it is not a dormant daemon.
 */
const MAX_LINE = 4 * 1024 * 1024;

/** The values of an ndjson body as they arrive. Ends when the body ends; a failing body rejects. */
export async function* readNdjson<T>(body: ReadableStream<Uint8Array>): AsyncGenerator<T> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let nl: number;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (line !== '') yield JSON.parse(line) as T;
      }
      if (buf.length > MAX_LINE) throw new Error(`ndjson line longer than ${MAX_LINE} bytes`);
      if (done) {
        if (buf.trim() !== '') yield JSON.parse(buf) as T;
        return;
      }
    }
  } finally {
    // Stops the transfer when the caller leaves early (a break, a thrown callback).
    await reader.cancel().catch(() => undefined);
  }
}

/** Decodes base64 to bytes (no Buffer: the SDK runs wherever fetch does). */
export function fromBase64(b64: string): Uint8Array {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
