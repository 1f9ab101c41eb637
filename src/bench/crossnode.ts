/**
 * A resume on another node against a resume on the same node, in a fleet of two nodes on this
 * machine (one PostgreSQL, one S3 bucket on Ceph RGW, shared master key). A 256 MiB sandbox
 * gets new random memory, hibernates on its node, resumes there (its packs in that node's
 * cache: same-node), hibernates again and resumes on the other node through the first one's
 * API (`?node=`: forwarded; the packs read from the bucket: cross-node). The next round starts
 * where the last one ended, so both nodes take both parts. Each resume is timed until the
 * sandbox answers the digest of all its memory.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { loadavg } from 'node:os';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { rgwVault, startTestDaemon, stopTestDaemon } from '../api/testing/daemon.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import { rgwMissing, startRgw, type TestRgw } from '../vault/testing/rgw.js';
import type { BenchSection, BenchSuite } from './harness.js';
import { median } from './harness.js';
import { HOLDER, digestOf } from './s3.js';

const MIB = 256;

export const crossnodeSuite: BenchSuite = {
  name: 'crossnode',
  async run({ quick }) {
    const title = 'Resume on another node against the same node (a fleet on S3)';
    const missing = (await pgMissing()) ?? (await rgwMissing());
    if (missing !== undefined)
      return { title, description: 'not run', rows: [], notes: [`not run: ${missing}`] };
    const loadAtStart = loadavg()[0] ?? 0;
    const rounds = quick ? 2 : 4;
    const dir = await mkdtemp('/tmp/dormant-bench-crossnode-');
    let pgServer: TestPostgres | undefined;
    let rgw: TestRgw | undefined;
    const nodes: Daemon[] = [];
    const same: number[] = [];
    const cross: number[] = [];
    const sameCall: number[] = [];
    const crossCall: number[] = [];
    try {
      pgServer = await startPostgres();
      const url = await pgServer.createDatabase('fleet');
      rgw = await startRgw({ bucket: 'dormant-bench-fleet' });
      const key = randomBytes(32);
      for (const name of ['n1', 'n2']) {
        const { daemon } = await startTestDaemon({
          dataDir: join(dir, name),
          masterKey: { key },
          state: { url },
          node: { name },
          vault: rgwVault(rgw, 'fleet'),
          proxy: false,
          policy: false,
        });
        nodes.push(daemon);
      }
      const rootfs = join(dir, 'rootfs');
      await buildBusyboxRootfs(rootfs, { 'srv/holder.py': HOLDER });
      const api = async (
        via: Daemon,
        method: string,
        path: string,
        body?: unknown,
      ): Promise<{ id: string; address?: string; node?: string }> => {
        const res = await fetch(`${via.url}${path}`, {
          method,
          headers: {
            authorization: `Bearer ${via.adminToken}`,
            ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
          },
          ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
        });
        const out = (await res.json()) as { id: string; address?: string; node?: string; error?: unknown };
        if (!res.ok) throw new Error(`bench crossnode: ${method} ${path}: ${JSON.stringify(out.error)}`);
        return out;
      };
      const s = await api(nodes[0]!, 'POST', '/v1/sandboxes', {
        rootfs,
        command: ['/usr/bin/python3', '/srv/holder.py', String(MIB)],
        ports: [8080],
        memory: `${MIB + 512}M`,
      });
      let host = s.address!;
      let at = 0;
      const settle = (): Promise<void> => new Promise((r) => setTimeout(r, 1000));
      /** Resumes on node `to` through node `at`'s API; ms until the call, ms until the digest. */
      const resumeOn = async (to: number, digest: string): Promise<[number, number]> => {
        await settle();
        const t0 = performance.now();
        const r = await api(nodes[at]!, 'POST', `/v1/sandboxes/${s.id}/resume?node=n${to + 1}`);
        const call = performance.now() - t0;
        host = r.address!;
        const got = await digestOf(host);
        const all = performance.now() - t0;
        if (got !== digest) throw new Error(`bench crossnode: memory changed across a resume (${got})`);
        if (r.node !== `n${to + 1}`) throw new Error(`bench crossnode: resumed on ${r.node}, not n${to + 1}`);
        at = to;
        return [call, all];
      };
      for (let i = 0; i < rounds; i++) {
        process.stderr.write(`bench: crossnode round ${i + 1}/${rounds}\n`);
        const digest = await digestOf(host, '/refill');
        await settle();
        await api(nodes[at]!, 'POST', `/v1/sandboxes/${s.id}/hibernate`);
        const [c1, a1] = await resumeOn(at, digest);
        sameCall.push(c1);
        same.push(a1);
        await settle();
        await api(nodes[at]!, 'POST', `/v1/sandboxes/${s.id}/hibernate`);
        const [c2, a2] = await resumeOn(1 - at, digest);
        crossCall.push(c2);
        cross.push(a2);
      }
    } finally {
      for (const d of nodes) await stopTestDaemon(d).catch(() => undefined);
      await rgw?.stop().catch(() => undefined);
      await pgServer?.stop().catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    }
    const loadAtEnd = loadavg()[0] ?? 0;
    const section: BenchSection = {
      title,
      description: `Two nodes on this machine sharing one PostgreSQL and one S3 bucket (Ceph RGW on loopback). A ${MIB} MiB sandbox of random memory: hibernate on its node, resume there (same-node: its packs in that node's cache), hibernate, resume on the other node asked through the first one's API (cross-node: forwarded, the packs read from the bucket). ${rounds} rounds, alternating nodes; medians, each until the sandbox answers the digest of all its memory (the call alone in the notes).`,
      rows: [
        {
          name: `resume of ${MIB} MiB on another node, until all memory answers`,
          dormant: Math.round(median(cross)),
          peer: Math.round(median(same)),
          peerName: 'the same node',
          unit: 'ms',
          better: 'lower',
        },
      ],
      notes: [
        `the resume call alone (processes running): cross-node ${Math.round(median(crossCall))} ms, same-node ${Math.round(median(sameCall))} ms`,
        `load average ${loadAtStart.toFixed(1)} at the start, ${loadAtEnd.toFixed(1)} at the end (2 cores)`,
      ],
    };
    return section;
  },
};
