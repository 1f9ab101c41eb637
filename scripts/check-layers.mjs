#!/usr/bin/env node
// Keeps the layer graph honest: a module may import only from its own layer
// or from layers below it. Layers are the top-level folders of src/.
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join, relative, resolve, dirname, sep } from 'node:path';

// Lowest first. A layer may depend on any layer listed before it.
const ORDER = [
  'domain', // types, errors, state machine rules; no I/O
  'sys', // running external commands, files, the node's facts
  'state',
  'vault',
  'criu',
  'checkpoint',
  'runtime',
  'proxy',
  'control',
  'api',
  'dashboard',
  'sdk',
  'cli',
  'bench',
];
// Layers that must stay free of I/O and of everything above them.
const ONLY = {
  domain: ['domain'],
  // The SDK talks to the daemon over HTTP only; it may share the domain's types and errors.
  sdk: ['domain', 'sdk'],
};

const root = resolve(dirname(new URL(import.meta.url).pathname), '..', 'src');
const problems = [];

function walk(dir) {
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) walk(p);
    else if (p.endsWith('.ts')) check(p);
  }
}

function layerOf(file) {
  return relative(root, file).split(sep)[0];
}

function check(file) {
  // Tests may build their fixtures with any layer (a vault test may dump a real process
  // with criu/); only production code is held to the graph.
  if (file.endsWith('.test.ts') || file.includes(`${sep}testing${sep}`)) return;
  const from = layerOf(file);
  const rank = ORDER.indexOf(from);
  if (rank < 0) {
    problems.push(`${relative(root, file)}: folder "${from}" is not a known layer`);
    return;
  }
  const src = readFileSync(file, 'utf8');
  const re = /(?:import|export)\s[^'"]*?from\s+['"]([^'"]+)['"]|import\(\s*['"]([^'"]+)['"]\s*\)/g;
  for (const m of src.matchAll(re)) {
    const spec = m[1] ?? m[2];
    if (!spec.startsWith('.')) continue;
    const target = resolve(dirname(file), spec);
    if (!target.startsWith(root + sep)) {
      problems.push(`${relative(root, file)}: imports ${spec}, outside src/`);
      continue;
    }
    const to = layerOf(target);
    const allowed = ONLY[from] ? ONLY[from].includes(to) : ORDER.indexOf(to) <= rank;
    if (!allowed) problems.push(`${relative(root, file)}: layer "${from}" must not import "${to}" (${spec})`);
  }
  if (from === 'domain' && /from\s+['"]node:/.test(src)) {
    problems.push(`${relative(root, file)}: domain/ must not do I/O (imports node:*)`);
  }
}

walk(root);
if (problems.length > 0) {
  for (const p of problems) console.error(p);
  console.error(`layer check: ${problems.length} problem(s)`);
  process.exit(1);
}
console.log('layer check: ok');
