/**
 * Lazy restores whose pages come from a page source (a stored checkpoint opened for random
 * reads) rather than from the pages images: the pages that are not lazy are written into the
 * images folder, and a page server reads the lazy ones from the source while CRIU's
 * lazy-pages daemon asks for them. The runtime owns the server from the restore on.
 */
import type { Socket } from 'node:net';
import { readCriuImages } from '../criu/images/reader.js';
import { isPagesImage, startPageServer, writeEagerPages, type PageServer } from '../criu/page-server.js';
import { startKeeper, type Keeper } from '../sys/keeper.js';
import type { CallOptions, PageSource } from './runtime.js';
import { timed } from './runc-host.js';

/** A lazy restore's pages, served from their source while they stream in. */
export interface ServedPages {
  server: PageServer;
  source: PageSource;
  /** Hold the server's connections, to end the sandbox's processes should dormant die. */
  keepers: Keeper[];
  /** Set once the server is being stopped: a keeper that starts after that is released at once. */
  ended: { now: boolean };
}

/**
 * Writes the pages images' non-lazy pages into `imagesDir` and starts a page server that
 * reads the lazy ones from `source` (closed here if this fails). `what` names the pages in
 * the server's errors; `procsFiles`, the sandbox's processes for its keepers.
 */
export async function servePages(o: {
  source: PageSource;
  what: string;
  imagesDir: string;
  procsFiles: string[] | undefined;
  opts: CallOptions;
}): Promise<ServedPages> {
  const { source: reader, procsFiles } = o;
  try {
    const dump = await timed(o.opts, 'read images', () => readCriuImages(o.imagesDir));
    await timed(o.opts, 'eager pages', () =>
      writeEagerPages(
        dump.processes,
        o.imagesDir,
        reader,
        reader.list().filter((f) => isPagesImage(f.path)),
      ),
    );
    const keepers: Keeper[] = [];
    const ended = { now: false };
    const server = await startPageServer({
      processes: dump.processes,
      source: reader,
      what: o.what,
      // Should dormant die while pages are still on the way, its processes are ended
      // before CRIU's lazy-pages daemon sees the connection drop (and fills with zeros).
      ...(procsFiles
        ? {
            onConnection: async (sock: Socket) => {
              const k = await startKeeper({ hold: [sock], procsFiles });
              // Left running, it would end a healthy sandbox whenever this daemon exits.
              if (ended.now) await k.release();
              else keepers.push(k);
            },
          }
        : {}),
    });
    return { server, source: reader, keepers, ended };
  } catch (e) {
    await reader.close();
    throw e;
  }
}

/**
 * Stops a lazy restore's page server and closes its source. Call once its tasks are ended or
 * whole; `warn` hears what failed to close.
 */
export async function endPageServer(p: ServedPages, warn: (what: string, e: unknown) => void): Promise<void> {
  p.ended.now = true;
  await Promise.all(p.keepers.map((k) => k.release()));
  await p.server.close().catch((e: unknown) => warn('page server', e));
  await p.source.close().catch((e: unknown) => warn('checkpoint reader', e));
}
