/** Test helpers: plain HTTP calls to a daemon, and a reader of its server-sent events. */
export interface Answer {
  status: number;
  type: string;
  /** Parsed JSON, or the text; tests check it with the API's zod schemas. */
  body: unknown;
  text: string;
}

export async function call(
  url: string,
  token: string | undefined,
  method: string,
  path: string,
  body?: unknown,
): Promise<Answer> {
  const res = await fetch(`${url}${path}`, {
    method,
    headers: {
      ...(token !== undefined ? { authorization: `Bearer ${token}` } : {}),
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
    },
    ...(body !== undefined ? { body: typeof body === 'string' ? body : JSON.stringify(body) } : {}),
    signal: AbortSignal.timeout(120_000),
  });
  const text = await res.text();
  const type = res.headers.get('content-type') ?? '';
  return {
    status: res.status,
    type,
    text,
    body: type.includes('application/json') && text !== '' ? (JSON.parse(text) as unknown) : text,
  };
}

export interface SseEvent {
  id?: string;
  event?: string;
  data: string;
}

/** Opens GET /v1/events and collects what arrives until close(). */
export async function openEvents(
  url: string,
  token: string,
  query = '',
): Promise<{
  events: SseEvent[];
  status: number;
  close(): void;
  waitFor(pred: (e: SseEvent[]) => boolean, timeoutMs?: number): Promise<void>;
}> {
  const ac = new AbortController();
  const res = await fetch(`${url}/v1/events${query}`, {
    headers: { authorization: `Bearer ${token}` },
    signal: ac.signal,
  });
  const events: SseEvent[] = [];
  if (res.ok && res.body) {
    const body = res.body;
    void (async () => {
      const decoder = new TextDecoder();
      let buf = '';
      try {
        for await (const chunk of body) {
          buf += decoder.decode(chunk as Uint8Array, { stream: true });
          let i: number;
          while ((i = buf.indexOf('\n\n')) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const ev: SseEvent = { data: '' };
            for (const line of block.split('\n')) {
              if (line.startsWith(':')) continue;
              const k = line.slice(0, line.indexOf(':'));
              const v = line.slice(line.indexOf(':') + 1).replace(/^ /, '');
              if (k === 'id') ev.id = v;
              else if (k === 'event') ev.event = v;
              else if (k === 'data') ev.data += v;
            }
            if (ev.data !== '') events.push(ev);
          }
        }
      } catch {
        // Aborted by close().
      }
    })();
  }
  return {
    events,
    status: res.status,
    close: () => ac.abort(),
    async waitFor(pred, timeoutMs = 15_000) {
      const deadline = Date.now() + timeoutMs;
      while (!pred(events)) {
        if (Date.now() > deadline)
          throw new Error(`events: not after ${timeoutMs} ms: ${JSON.stringify(events)}`);
        await new Promise((r) => setTimeout(r, 50));
      }
    },
  };
}
