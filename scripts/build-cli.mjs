#!/usr/bin/env node
// Bundles the CLI that tsc wrote (dist/cli/main.js and what it imports statically: commands,
// SDK, commander, cli-table3) into one CommonJS file, dist/cli/dormant.cjs, which bin/dormant
// runs. Node 20 resolves, reads and links each ES module on its own (34 of them for
// `--version`), and that, not our code, was most of the CLI's start-up: see docs/BENCHMARKS.md
// "CLI start-up" for the profile.
//
// What stays out of the bundle:
// - Every dynamic import(): the daemon (`serve`), the vault, checkpoint tools. They load from
//   the tsc output, as before, where they find their files relative to import.meta.url.
//   Those modules carry their own copy of what the bundle inlined (DormantError): the CLI
//   recognises a DormantError by its name where it may come from there (cli/output.ts).
// - Node built-ins that cost milliseconds to load (child_process, streams, crypto, ...): the
//   bundle gets each as an object of getters that loads the module on first use, so a command
//   pays only for what it runs. Commander alone asks for child_process at load, for the
//   external sub-commands dormant does not have.
import { build } from 'esbuild';
import { createRequire } from 'node:module';
import { dirname, relative, resolve } from 'node:path';

const root = resolve(dirname(new URL(import.meta.url).pathname), '..');
const entry = resolve(root, 'dist/cli/main.js');
const out = resolve(root, 'dist/cli/dormant.cjs');

/** Built-ins loaded on first use; the rest (fs, path, events, ...) are in Node's start-up snapshot. */
const LAZY = [
  'child_process',
  'crypto',
  'fs/promises',
  'http',
  'https',
  'net',
  'readline',
  'stream',
  'stream/promises',
  'worker_threads',
  'zlib',
];
const lazyFilter = new RegExp(`^(node:)?(${LAZY.join('|').replaceAll('/', '\\/')})$`);
const require = createRequire(import.meta.url);

/** A module whose properties are those of `node:${name}`, which loads on the first read of one. */
function lazyBuiltin(name) {
  // The names are this Node's: the bundle runs on the Node that built it.
  const keys = Object.keys(require(`node:${name}`));
  return [
    `let m;`,
    `const load = () => (m ??= require('node:${name}'));`,
    `for (const k of ${JSON.stringify(keys)})`,
    `  Object.defineProperty(exports, k, { enumerable: true, get: () => load()[k] });`,
  ].join('\n');
}

const result = await build({
  entryPoints: [entry],
  outfile: out,
  bundle: true,
  platform: 'node',
  format: 'cjs',
  target: 'node20',
  logLevel: 'silent',
  plugins: [
    {
      name: 'dormant-cli',
      setup(b) {
        b.onResolve({ filter: /.*/ }, (a) => {
          if (a.kind !== 'dynamic-import') return undefined;
          if (!a.path.startsWith('.')) return { path: a.path, external: true };
          const target = relative(dirname(out), resolve(a.resolveDir, a.path));
          return { path: target.startsWith('.') ? target : `./${target}`, external: true };
        });
        b.onResolve({ filter: lazyFilter }, (a) =>
          a.namespace === 'lazy-builtin'
            ? { path: a.path, external: true }
            : { path: a.path.replace(/^node:/, ''), namespace: 'lazy-builtin' },
        );
        b.onLoad({ filter: /.*/, namespace: 'lazy-builtin' }, (a) => ({
          contents: lazyBuiltin(a.path),
          loader: 'js',
        }));
      },
    },
  ],
}).catch((e) => {
  process.stderr.write(`cli bundle: ${e.message}\n`);
  process.exit(1);
});
// A warning here is a bundle that behaves unlike the modules it came from (import.meta in a
// CommonJS file is empty): fail the build rather than ship it.
if (result.warnings.length > 0) {
  for (const w of result.warnings)
    process.stderr.write(`cli bundle: ${w.text} (${w.location?.file ?? ''})\n`);
  process.exit(1);
}
process.stdout.write(`cli: ${relative(root, entry)} -> ${relative(root, out)}\n`);
