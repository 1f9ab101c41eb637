/**
 * The dashboard in headless Chromium (Debian's chromium driven by playwright-core over CDP)
 * against a real daemon: it signs in with a token from the URL fragment, shows a sandbox,
 * hibernates and resumes it with its buttons, and shows both transitions in the timeline.
 * Screenshots are kept under test-artifacts/ (gitignored).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium, type Browser, type Page } from 'playwright-core';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';

const CHROMIUM = '/usr/bin/chromium';
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
    let proc: ChildProcess | undefined;
    let browser: Browser | undefined;
    let page: Page;
    const consoleErrors: string[] = [];

    const row = (id: string) => page.locator(`tr[data-sandbox="${id}"]`);

    before(async () => {
      ({ dir } = await testFolder('dashboard'));
      ({ daemon, client } = await startTestDaemon({
        dataDir: join(dir, 'data'),
        readonlyBinds: [],
        policy: false,
      }));
      sb = await client.createSandbox({
        name: 'web-agent',
        rootfs: join(dir, 'rootfs'),
        command: ['sh', '-c', 'while true; do sleep 1; done'],
        memory: '64M',
      });
      ({ proc, browser } = await launch(join(dir, 'chromium-profile')));
      const context = browser.contexts()[0] ?? (await browser.newContext());
      page = await context.newPage();
      await page.setViewportSize({ width: 1280, height: 900 });
      page.on('console', (m) => {
        if (m.type() === 'error') consoleErrors.push(m.text());
      });
      page.on('pageerror', (e) => consoleErrors.push(e.message));
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
      assert.equal(await page.textContent('[data-testid=total-sandboxes]'), '1');
      await page.locator('[data-testid=connection]').filter({ hasText: 'live' }).waitFor();
      assert.match((await row(sb.id).textContent()) ?? '', /web-agent.*running.*held/);
    });

    test('the Hibernate button hibernates it: memory freed, the transition in the timeline', async () => {
      await row(sb.id).getByRole('button', { name: 'Hibernate' }).click();
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
      assert.deepEqual(
        consoleErrors.filter((e) => !/401/.test(e)),
        [],
        'no script errors (the 401 is the bad token of the first test)',
      );
    });
  },
);
