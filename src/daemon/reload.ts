/**
 * Reloading the configuration of a running daemon (`dormant serve` on SIGHUP): the file, the
 * environment and the flags are read again as at start; a valid result applies the keys that
 * can change live and logs each change, and says which changed keys wait for a restart; an
 * invalid one is refused whole (the error names the file and key) and the daemon keeps the
 * configuration it has.
 */
import type { Logger } from '../sys/log.js';
import { configFileView, type DaemonConfig, type LoadedConfig } from './config.js';
import { liveSettings, type Daemon } from './daemon.js';

/**
 * The keys (a key and everything under it) applied live; each is read where it is used
 * (daemon.ts LiveSettings). Every other key is built into something at start (a listener, the
 * runtime, a route's body limit, a loop's timer, the log's destination) and waits for a restart.
 */
export const LIVE_KEYS: readonly string[] = [
  'logLevel',
  'policy.defaults',
  'policy.tenants',
  'sandbox.allowedSourceRoots',
  'sandbox.diskQuota',
  'checkpoint.keep',
  'importLimits',
  'api.maxUpload',
  'egress.default',
  'egress.tenants',
  'meter.prices',
];

export function isLiveKey(key: string): boolean {
  return LIVE_KEYS.some((k) => key === k || key.startsWith(`${k}.`));
}

/** One key that differs between two configurations, its values as the file spells them. */
export interface ConfigChange {
  key: string;
  /** undefined: not set on that side. */
  from: unknown;
  to: unknown;
  live: boolean;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/** The file view as dotted keys, down to values and arrays: a tenant's policy field is a key. */
function flatten(
  o: Record<string, unknown>,
  prefix = '',
  out = new Map<string, unknown>(),
): Map<string, unknown> {
  for (const [k, v] of Object.entries(o)) {
    const key = `${prefix}${k}`;
    if (isObject(v) && Object.keys(v).length > 0) flatten(v, `${key}.`, out);
    else out.set(key, v);
  }
  return out;
}

/** What differs from `before` to `after`, key by key, sorted by key. */
export function configChanges(before: DaemonConfig, after: DaemonConfig): ConfigChange[] {
  const a = flatten(configFileView(before));
  const b = flatten(configFileView(after));
  const out: ConfigChange[] = [];
  for (const key of new Set([...a.keys(), ...b.keys()])) {
    if (JSON.stringify(a.get(key)) === JSON.stringify(b.get(key))) continue;
    out.push({ key, from: a.get(key), to: b.get(key), live: isLiveKey(key) });
  }
  // The view redacts the key command (it may carry a credential); a new one is still a change.
  if (
    'command' in before.masterKey &&
    'command' in after.masterKey &&
    before.masterKey.command !== after.masterKey.command
  )
    out.push({ key: 'masterKeyCommand', from: '<redacted>', to: '<redacted>', live: false });
  return out.sort((x, y) => x.key.localeCompare(y.key));
}

const show = (v: unknown): string => (v === undefined ? '(unset)' : JSON.stringify(v));

/**
 * A reload function for `dormant serve`: each call reads the configuration with `load`, and
 * applies it or keeps the one in force. Answers what changed live, or undefined when the new
 * configuration was refused.
 */
export function configReloader(o: {
  load: () => LoadedConfig;
  /** The configuration the daemon was started with. */
  started: DaemonConfig;
  daemon: Pick<Daemon, 'reconfigure'>;
  log: Logger;
}): () => ConfigChange[] | undefined {
  let current = o.started;
  return () => {
    let next: LoadedConfig;
    try {
      next = o.load();
    } catch (e) {
      // The message names the file (or variable, or flag) and each bad key.
      o.log.error(
        { err: (e as Error).message },
        `configuration not reloaded, the one in force is kept: ${(e as Error).message}`,
      );
      return undefined;
    }
    // Live keys against what is in force now; the others against what the daemon started
    // with, so a change waiting for a restart is said again at each reload.
    const live = configChanges(current, next.config).filter((c) => c.live);
    const pending = configChanges(o.started, next.config).filter((c) => !c.live);
    o.daemon.reconfigure(liveSettings(next.config));
    current = next.config;
    for (const c of live)
      o.log.info(
        { key: c.key, from: c.from, to: c.to },
        `configuration: ${c.key} ${show(c.from)} -> ${show(c.to)}`,
      );
    for (const c of pending)
      o.log.warn(
        { key: c.key, from: c.from, to: c.to },
        `configuration: ${c.key} changed to ${show(c.to)}; it takes effect at the next restart`,
      );
    o.log.info(
      { file: next.file, applied: live.length, restartNeeded: pending.length },
      `configuration reloaded${next.file !== undefined ? ` from ${next.file}` : ''}: ${live.length} change(s) applied, ${pending.length} waiting for a restart`,
    );
    return live;
  };
}
