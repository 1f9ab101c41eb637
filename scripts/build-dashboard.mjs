#!/usr/bin/env node
// Copies the dashboard's static files (hand-written HTML, CSS and one JavaScript module: no
// bundler needed for a page this size) to dist/dashboard/static, where the daemon serves them.
import { cpSync, mkdirSync, rmSync } from 'node:fs';
import { dirname, resolve } from 'node:path';

const root = resolve(dirname(new URL(import.meta.url).pathname), '..');
const from = resolve(root, 'src/dashboard/static');
const to = resolve(root, 'dist/dashboard/static');
rmSync(to, { recursive: true, force: true });
mkdirSync(to, { recursive: true });
cpSync(from, to, { recursive: true });
process.stdout.write(`dashboard: ${from} -> ${to}\n`);
