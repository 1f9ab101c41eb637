/**
 * The dashboard in headless Chromium (Debian's chromium driven by playwright-core over CDP)
 * against a real daemon with three tenants' sandboxes: it signs in with a token from the URL
 * fragment; an admin sees the tenant column and filters by tenant and by label, a tenant's
 * token sees its own sandboxes only; the list's buttons hibernate and resume after a
 * confirmation; a sandbox's page charts the meter's real samples, shows its log, events and
 * checkpoints (with a secret scan), and each of its actions does what it says (seen through
 * the API afterwards), while a cancelled confirmation does nothing. Screenshots are kept
 * under test-artifacts/ (gitignored).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium, type Browser, type Locator, type Page } from 'playwright-core';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';
import { eventually } from '../api/testing/host.js';

const CHROMIUM = '/usr/bin/chromium';
/** A credential's shape (not a real one) that the secret scan knows. */
const GITHUB_TOKEN = 'ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8';
const ARTIFACTS = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'test-artifacts');

/** Starts chromium ourselves (so its PID is ours to end) and connects over the DevTools protocol. */
async function launch(userDataDir: string): Promise<{ proc: ChildProcess; browser: Browser }> {
  const proc = spawn(
    CHROMIUM,
    [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      `--user-data-dir=${userDataDir}`,
      '--remote-debugging-port=0',
      '--window-size=1280,900',
      'about:blank',
    ],
    { stdio: ['ignore', 'ignore', 'pipe'] },
  );
  const ws = await new Promise<string>((resolve, reject) => {
    let err = '';
    const timer = setTimeout(() => reject(new Error(`chromium did not start: ${err}`)), 30_000);
    proc.stderr.on('data', (c: Buffer) => {
      err += c.toString();
      const m = /DevTools listening on (ws:\/\/\S+)/.exec(err);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]!);
      }
    });
    proc.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`chromium exited (${code}): ${err}`));
    });
  });
  return { proc, browser: await chromium.connectOverCDP(ws) };
}

describe(
  'the dashboard in a browser',
  { skip: !existsSync(CHROMIUM) && `${CHROMIUM} missing (scripts/setup.sh installs it)` },
  () => {
    let dir: string;
    let daemon: Daemon;
    let client: DormantClient;
    let sb: SandboxInfo;
    let acmeBox: SandboxInfo;
    let betaBox: SandboxInfo;
    let acmeToken: string;
    let proc: ChildProcess | undefined;
    let browser: Browser | undefined;
    let page: Page;
    const consoleErrors: string[] = [];
    /** Answers of 400 and above the page got: `STATUS PATH`. */
    const failed: string[] = [];
    let forkId = '';

    const row = (id: string) => page.locator(`tr[data-sandbox="${id}"]`);
    const rows = () => page.locator('#sandboxes tbody tr');
    /** The data-sandbox of each element `locator` finds, in order. */
    const sandboxIds = async (locator: Locator): Promise<(string | null)[]> =>
      Promise.all((await locator.all()).map((x) => x.getAttribute('data-sandbox')));
    /** The state the daemon reports, polled until it is `want`. */
    const apiState = (id: string, want: string) =>
      eventually(
        `${id} ${want} (through the API)`,
        async () => assert.equal((await client.getSandbox(id)).state, want),
        60_000,
      );
    const confirm = async (what: RegExp) => {
      const dialog = page.getByTestId('confirm');
      await dialog.waitFor({ state: 'visible' });
      assert.match(((await dialog.textContent()) ?? '').replace(/\s+/g, ' '), what);
      await page.getByTestId('confirm-ok').click();
      await dialog.waitFor({ state: 'hidden' });
    };
    const detailAction = (op: string) => page.locator(`#d-actions button[data-action="${op}"]`);
    const detailState = (want: string) =>
      page
        .getByTestId('detail-state')
        .filter({ hasText: new RegExp(`^${want}$`) })
        .waitFor({ timeout: 60_000 });

    before(async () => {
      ({ dir } = await testFolder('dashboard'));
      ({ daemon, client } = await startTestDaemon({
        dataDir: join(dir, 'data'),
        readonlyBinds: [],
        policy: false,
        // Samples often enough for the sandbox page's chart to have a line within seconds.
        meterIntervalMs: 300,
        allowedSourceRoots: [dir],
      }));
      sb = await client.createSandbox({
        name: 'web-agent',
        rootfs: join(dir, 'rootfs'),
        // A credential in its memory (the shell's variable), for the checkpoint's secret scan.
        command: ['sh', '-c', `T=${GITHUB_TOKEN}; echo "hello from web-agent"; while true; do sleep 1; done`],
        memory: '64M',
        labels: { team: 'ops' },
      });
      const tenantBox = async (tenant: string, team: string) => {
        const t = await client.createToken({ tenant });
        const c = new DormantClient({ url: daemon.url, token: t.token });
        const box = await c.createSandbox({
          name: `${tenant}-box`,
          rootfs: join(dir, 'rootfs'),
          command: ['sleep', '1000'],
          memory: '32M',
          labels: { team },
        });
        return { token: t.token, box };
      };
      const acme = await tenantBox('acme', 'red');
      acmeBox = acme.box;
      acmeToken = acme.token;
      betaBox = (await tenantBox('beta', 'blue')).box;
      ({ proc, browser } = await launch(join(dir, 'chromium-profile')));
      const context = browser.contexts()[0] ?? (await browser.newContext());
      page = await context.newPage();
      await page.setViewportSize({ width: 1280, height: 900 });
      page.on('console', (m) => {
        if (m.type() === 'error') consoleErrors.push(m.text());
      });
      page.on('pageerror', (e) => consoleErrors.push(e.message));
      page.on('response', (r) => {
        if (r.status() >= 400) failed.push(`${r.status()} ${new URL(r.url()).pathname}`);
      });
      await mkdir(ARTIFACTS, { recursive: true });
    });

    after(async () => {
      await browser?.close().catch(() => undefined);
      if (proc && proc.exitCode === null && proc.pid !== undefined) {
        const exited = new Promise((r) => proc!.once('exit', r));
        process.kill(proc.pid, 'SIGTERM');
        await exited;
      }
      await tearDown(dir, daemon);
    });

    test('without a token it asks for one; a bad one is refused', async () => {
      await page.goto(`${daemon.url}/`);
      await page.locator('#login').waitFor({ state: 'visible' });
      await page.fill('#token', 'dmt_not-a-token');
      await page.click('#login button[type=submit]');
      await page.locator('#login').waitFor({ state: 'visible' });
      assert.match((await page.textContent('[data-testid=connection]')) ?? '', /refused/);
    });

    test('signs in from the URL fragment, and shows the sandbox running', async () => {
      await page.goto(`${daemon.url}/#token=${encodeURIComponent(daemon.adminToken)}`);
      await row(sb.id)
        .locator('[data-testid=state]')
        .filter({ hasText: /^running$/ })
        .waitFor();
      assert.equal(new URL(page.url()).hash, '', 'the token is taken out of the address bar');
      assert.equal(await page.textContent('[data-testid=total-sandboxes]'), '3');
      await page.locator('[data-testid=connection]').filter({ hasText: 'live' }).waitFor();
      assert.match((await row(sb.id).textContent()) ?? '', /web-agent.*running.*held.*team=ops/);
    });

    test('the admin sees every tenant in a column, and filters by tenant and by label', async () => {
      await page.locator('th.col-tenant').waitFor({ state: 'visible' });
      assert.equal(await row(acmeBox.id).getByTestId('tenant').textContent(), 'acme');
      assert.equal(await row(betaBox.id).getByTestId('tenant').textContent(), 'beta');
      const options = await page.getByTestId('tenant-filter').locator('option').allTextContents();
      for (const t of ['acme', 'beta']) assert.ok(options.includes(t), `${t} offered: ${options.join(', ')}`);

      await page.getByTestId('tenant-filter').selectOption('acme');
      await row(betaBox.id).waitFor({ state: 'detached' });
      assert.equal(await rows().count(), 1);
      assert.equal(await row(acmeBox.id).getAttribute('data-tenant'), 'acme');
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-tenant-filter.png'), fullPage: true });

      await page.getByTestId('tenant-filter').selectOption('');
      await row(betaBox.id).waitFor();
      await page.getByTestId('label-filter').fill('team=blue');
      await page.locator('#filters button[type=submit]').click();
      await row(acmeBox.id).waitFor({ state: 'detached' });
      assert.deepEqual(await sandboxIds(rows()), [betaBox.id]);
      // A label chip filters by that label.
      await page.click('#f-clear');
      await row(sb.id).locator('button.chip', { hasText: 'team=ops' }).click();
      await row(acmeBox.id).waitFor({ state: 'detached' });
      assert.deepEqual(await sandboxIds(rows()), [sb.id]);
      await page.click('#f-clear');
      await row(acmeBox.id).waitFor();
      assert.equal(await rows().count(), 3);
    });

    test("a tenant's token sees its own sandboxes only, and no tenant column", async () => {
      await page.goto(`${daemon.url}/#token=${encodeURIComponent(acmeToken)}`);
      await page.getByTestId('whoami').filter({ hasText: 'one tenant' }).waitFor();
      await row(acmeBox.id).waitFor();
      assert.equal(await rows().count(), 1);
      assert.equal(await row(betaBox.id).count(), 0);
      assert.equal(await row(sb.id).count(), 0);
      assert.equal(await page.locator('th.col-tenant').isVisible(), false);
      assert.equal(await page.getByTestId('tenant-filter').isVisible(), false);
      // Nor through the filters: beta's label matches nothing here.
      await page.getByTestId('label-filter').fill('team=blue');
      await page.locator('#filters button[type=submit]').click();
      await row(acmeBox.id).waitFor({ state: 'detached' });
      assert.equal(await rows().count(), 0);
      // Nor in the timeline: only acme's transitions.
      const timelineIds = await sandboxIds(page.locator('#timeline li'));
      assert.ok(
        timelineIds.length > 0 && timelineIds.every((id) => id === acmeBox.id),
        timelineIds.join(','),
      );
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-tenant.png'), fullPage: true });
      // Back to the admin for the rest.
      await page.goto(`${daemon.url}/#token=${encodeURIComponent(daemon.adminToken)}`);
      await row(betaBox.id).waitFor();
    });

    test('the Hibernate button hibernates it: memory freed, the transition in the timeline', async () => {
      await row(sb.id).getByRole('button', { name: 'Hibernate' }).click();
      await confirm(/Hibernate web-agent\?.*vault/);
      await row(sb.id)
        .locator('[data-testid=state]')
        .filter({ hasText: /^hibernated$/ })
        .waitFor({ timeout: 60_000 });
      assert.equal((await client.getSandbox(sb.id)).state, 'hibernated', 'the daemon agrees');
      await page.locator('#timeline li[data-to="hibernated"]').first().waitFor();
      await page.locator('#timeline li[data-to="hibernating"]').first().waitFor();
      await row(sb.id).locator('.freed').filter({ hasText: /freed/ }).waitFor();
      assert.notEqual(await page.textContent('[data-testid=memory-freed]'), '0 B');
      assert.equal(await row(sb.id).getByRole('button', { name: 'Hibernate' }).isDisabled(), true);
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-hibernated.png'), fullPage: true });
    });

    test('the Resume button brings it back', async () => {
      await row(sb.id).getByRole('button', { name: 'Resume' }).click();
      await confirm(/Resume web-agent\?/);
      await row(sb.id)
        .locator('[data-testid=state]')
        .filter({ hasText: /^running$/ })
        .waitFor({ timeout: 60_000 });
      assert.equal((await client.getSandbox(sb.id)).state, 'running');
      await page.locator('#timeline li[data-to="resuming"]').first().waitFor();
      // The row can show running (from the resume's answer) a moment before the event of it
      // reaches the timeline: wait for it to arrive, newest first.
      await page
        .locator('#timeline li')
        .first()
        .filter({ hasText: 'resuming → running' })
        .waitFor({ timeout: 10_000 })
        .catch(() => undefined);
      const timeline = await page.locator('#timeline li').allTextContents();
      assert.ok(timeline[0]?.includes('resuming → running'), `newest first: ${timeline[0] ?? ''}`);
      // The chart of spent against always-warm draws both lines from /v1/cost's series.
      await page.locator('#cost-chart polyline[data-series="spent"]').waitFor();
      assert.equal(await page.locator('#cost-chart polyline').count(), 2);
      const pts = await page.locator('#cost-chart polyline[data-series="alwaysWarm"]').getAttribute('points');
      assert.equal(pts?.split(' ').length, 48, 'one point per series entry');
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard.png'), fullPage: true });
      assert.ok(existsSync(join(ARTIFACTS, 'dashboard.png')));
    });

    test("a sandbox's page: state, labels, memory and CPU charted from the meter's real samples, its log and events", async () => {
      await row(sb.id).getByRole('link', { name: 'web-agent' }).click();
      await page.locator('#detail').waitFor({ state: 'visible' });
      assert.equal(await page.locator('#app').isVisible(), false);
      await detailState('running');
      assert.equal(await page.getByTestId('detail-name').textContent(), 'web-agent');
      assert.match(
        (await page.locator('#d-facts').textContent()) ?? '',
        /tenant\s*default.*labels\s*team=ops/s,
      );
      // The chart's line has a point per sample the API answers: at least two by now.
      await page.locator('[data-testid=memory-chart] path[data-series="memory"]').waitFor();
      await eventually(
        'a memory line of two samples or more',
        async () =>
          assert.ok(Number(await page.getByTestId('memory-chart').getAttribute('data-points')) >= 2),
        30_000,
      );
      const drawn = Number(await page.getByTestId('memory-chart').getAttribute('data-points'));
      const res = await fetch(`${daemon.url}/v1/sandboxes/${sb.id}/metrics`, {
        headers: { authorization: `Bearer ${daemon.adminToken}` },
      });
      const { samples } = (await res.json()) as { samples: { memoryBytes: number }[] };
      assert.ok(drawn >= 2 && drawn <= samples.length, `${drawn} drawn of ${samples.length} samples`);
      assert.ok(
        samples.every((x) => x.memoryBytes > 0),
        'real cgroup readings',
      );
      await page.locator('[data-testid=cpu-chart] path[data-series="cpu"]').waitFor({ timeout: 30_000 });
      await page.getByTestId('logs').filter({ hasText: 'hello from web-agent' }).waitFor({ timeout: 15_000 });
      // Its events: the hibernate and resume of the tests before, newest first.
      const events = await page.locator('#d-events li').allTextContents();
      assert.ok(events[0]?.includes('resuming → running'), events.join(' | '));
      assert.ok(events.some((e) => e.includes('hibernating → hibernated')));
    });

    test('a cancelled confirmation does nothing', async () => {
      await detailAction('pause').click();
      await page.getByTestId('confirm').waitFor({ state: 'visible' });
      await page.getByTestId('confirm-cancel').click();
      await page.getByTestId('confirm').waitFor({ state: 'hidden' });
      // Escape cancels too.
      await detailAction('delete').click();
      await page.getByTestId('confirm').waitFor({ state: 'visible' });
      await page.keyboard.press('Escape');
      await page.getByTestId('confirm').waitFor({ state: 'hidden' });
      await new Promise((r) => setTimeout(r, 1500));
      const s = await client.getSandbox(sb.id);
      assert.equal(s.state, 'running', 'neither paused nor deleted');
      assert.equal(await page.getByTestId('detail-state').textContent(), 'running');
    });

    test('pause, resume and hibernate from its page; the checkpoint listed with its size and its secret scan', async () => {
      await detailAction('pause').click();
      await confirm(/Pause web-agent\?.*frozen/);
      await apiState(sb.id, 'paused');
      await detailState('paused');
      assert.equal(await detailAction('pause').isDisabled(), true, 'no pausing a paused sandbox');

      await detailAction('resume').click();
      await confirm(/Resume web-agent\?/);
      await apiState(sb.id, 'running');
      await detailState('running');

      await detailAction('hibernate').click();
      await confirm(/Hibernate web-agent\?/);
      await apiState(sb.id, 'hibernated');
      await detailState('hibernated');
      const newest = (await client.getSandbox(sb.id)).checkpointId!;
      const ck = page.locator(`#d-checkpoints tr[data-checkpoint="${newest}"]`);
      await ck.waitFor();
      assert.equal(await ck.getAttribute('data-kind'), 'memory');
      assert.notEqual(await ck.locator('[data-size=logical]').textContent(), '0 B');
      await ck.getByRole('button', { name: 'Scan for secrets' }).click();
      const found = ck.locator('.findings');
      await found.waitFor({ timeout: 60_000 });
      assert.match((await found.textContent()) ?? '', /github_token/);
      assert.ok(Number(await found.getAttribute('data-findings')) >= 1);
      await page.locator('#d-events li').first().filter({ hasText: 'hibernating → hibernated' }).waitFor();
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-sandbox.png'), fullPage: true });
    });

    test('fork, archive and delete from its page', async () => {
      const before = new Set((await client.listSandboxes()).map((x) => x.id));
      await detailAction('fork').click();
      await confirm(/Fork web-agent\?/);
      const link = page.getByTestId('fork-link');
      await link.waitFor({ timeout: 60_000 });
      const forks = (await client.listSandboxes()).filter((x) => !before.has(x.id));
      assert.equal(forks.length, 1, 'one new sandbox');
      const fork = forks[0]!;
      forkId = fork.id;
      assert.equal(await link.textContent(), fork.name);
      await apiState(fork.id, 'running');
      assert.equal((await client.getSandbox(sb.id)).state, 'hibernated', 'the origin as it was');

      await link.click();
      await page.getByTestId('detail-name').filter({ hasText: fork.name }).waitFor();
      await detailState('running');
      await detailAction('archive').click();
      await confirm(/Archive .*files/);
      await apiState(fork.id, 'archived');
      await detailState('archived');

      await detailAction('delete').click();
      await confirm(/Delete .*cannot be undone/);
      await page.locator('#app').waitFor({ state: 'visible' });
      await eventually(
        'the fork gone (through the API)',
        async () =>
          assert.equal(
            (await client.listSandboxes()).some((x) => x.id === fork.id),
            false,
          ),
        30_000,
      );
      await row(fork.id).waitFor({ state: 'detached' });
      assert.match((await page.locator('#notice').textContent()) ?? '', /deleted/);
    });

    test('no script errors on the way, and no failed request but the expected ones', () => {
      // The browser reports each failed request as a console error too: those are judged below.
      assert.deepEqual(
        consoleErrors.filter((e) => !/^Failed to load resource/.test(e)),
        [],
        'no script errors',
      );
      const expected = [
        /^401 \/v1\//, // the bad token of the first test
        /^403 \/v1\/tokens$/, // the tenant token's admin probe
        new RegExp(`^404 /v1/(sandboxes/${forkId}(/|$)|checkpoints$)`), // the deleted fork, looked up once more
      ];
      assert.deepEqual(
        failed.filter((f) => !expected.some((e) => e.test(f))),
        [],
        failed.join(', '),
      );
    });
  },
);
