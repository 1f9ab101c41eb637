/**
 * The reader of server-sent events (`text/event-stream`, GET /v1/events) that the SDK and the
 * dashboard share: the dashboard loads this module's compiled copy (`/dashboard/sse.js`, served
 * by src/api/dashboard.ts), so it must stay plain ECMAScript with no imports and nothing of
 * Node's. Both read the stream with fetch, since EventSource cannot send an Authorization header.
 */

/** One event of the stream. */
export interface ServerSentEvent {
  /** The `id:` field; undefined when the event has none. */
  id: string | undefined;
  /** The `event:` field; `message` when the event names none. */
  event: string;
  /** The `data:` lines, joined by newlines. */
  data: string;
}

/**
 * The events of a `text/event-stream` body, as they arrive. Comments (`: ping`) and events
 * without data are skipped. Ends when the body ends; a body that fails (an aborted fetch)
 * rejects with its error.
 */
export async function* readEventStream(body: ReadableStream<Uint8Array>): AsyncGenerator<ServerSentEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
      // CRLF and CR end lines too; a CR at the end may be half of a CRLF still on its way.
      buf = buf.replace(/\r\n|\r(?=.)/gs, '\n');
      if (done && buf.endsWith('\r')) buf = `${buf.slice(0, -1)}\n`;
      let i: number;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const ev = parseEvent(buf.slice(0, i));
        buf = buf.slice(i + 2);
        if (ev !== undefined) yield ev;
      }
      if (done) return;
    }
  } finally {
    // A consumer that stops early (break) closes the stream; after its end or its error
    // cancel has nothing to do, and its rejection only repeats the error thrown above.
    await reader.cancel().catch(() => undefined);
  }
}

/** One block of field lines; undefined when it carries no data. */
export function parseEvent(block: string): ServerSentEvent | undefined {
  let id: string | undefined;
  let event = 'message';
  const data: string[] = [];
  for (const line of block.split('\n')) {
    if (line === '' || line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') data.push(value);
    else if (field === 'event') event = value;
    else if (field === 'id') id = value;
  }
  return data.length === 0 ? undefined : { id, event, data: data.join('\n') };
}
