// The dashboard: plain ES modules, no framework and no build step. This one is the list (a
// table, seven numbers, a chart and a timeline) and the page's lifecycle; detail.js is a
// sandbox's own page (#sandbox=ID); ui.js what both use. It talks only to the HTTP API, with
// the token the user pasted (localStorage) or passed once as /#token=... .
//
// Data: GET /v1/sandboxes every few seconds and on every event (with the tenant and label
// filters); GET /v1/checkpoints for the sizes of memory checkpoints (memory freed); GET
// /v1/cost?by=sandbox for what each sandbox spent and what sleeping saved (the daemon's
// metering); GET /v1/events (server-sent events, read with fetch because EventSource cannot
// send an Authorization header) from the first transition, for the timeline, each sandbox's
// events and, on a daemon without /v1/cost, a labelled estimate. The stream is read by the
// SDK's own reader (src/sdk/sse.ts), which the daemon serves compiled as /dashboard/sse.js.
// Whether the token is an admin's (who sees every tenant, and gets the tenant column and
// filter) is asked of GET /v1/tokens, which answers admins only.
import { readEventStream } from './sse.js';
import { $, api, el, formatBytes, formatDuration, formatMoney, labelChips, session } from './ui.js';
import {
  act,
  closeDetail,
  detailOpen,
  initDetail,
  openDetail,
  pending,
  refreshDetail,
  renderEvents,
  scheduleDetailRefresh,
} from './detail.js';

/** Used only when the daemon has no /v1/cost; the page then says it is an estimate. */
const ESTIMATE_PER_GIB_HOUR = 0.005;
const HOLDING = new Set(['creating', 'running', 'paused', 'hibernating', 'resuming']);
const SLEEPING = new Set(['hibernated', 'archived']);
const BUSY = new Set(['creating', 'hibernating', 'resuming', 'deleting']);
const GIB = 1024 ** 3;

const state = {
  sandboxes: [],
  checkpoints: new Map(),
  /** sandboxId -> transitions, oldest first. */
  history: new Map(),
  timeline: [],
  events: null,
  /** The daemon's metering: { currency, totals, bySandbox }, or null (then: the estimate). */
  cost: null,
  /** The list's filters: a tenant (admins), a label `key=value` or `key`. */
  filter: { tenant: '', label: '' },
  /** Tenants an admin can filter by: those of tokens and of sandboxes seen. */
  tenants: new Set(),
};

const money = (x) => formatMoney(x, state.cost?.currency);

/** Reads GET /v1/events as a stream and calls onTransition for each; reconnects after a drop. */
function followEvents(onTransition) {
  const ac = new AbortController();
  let lastId = 0;
  const run = async () => {
    while (!ac.signal.aborted) {
      try {
        const res = await fetch(`/v1/events?since=${lastId}`, {
          headers: { authorization: `Bearer ${session.token}` },
          signal: ac.signal,
        });
        if (res.status === 401) return signOut('the token was refused (revoked?)');
        if (!res.ok || !res.body) throw new Error(`events: HTTP ${res.status}`);
        setConnected(true);
        for await (const ev of readEventStream(res.body)) {
          if (ev.event !== 'transition') continue;
          const t = JSON.parse(ev.data);
          lastId = Math.max(lastId, t.id);
          onTransition(t);
        }
      } catch (e) {
        if (ac.signal.aborted) return;
        console.warn('dormant: events stream dropped', e);
      }
      setConnected(false);
      await new Promise((r) => setTimeout(r, 1000));
    }
  };
  void run();
  return () => ac.abort();
}

// ---- the model -------------------------------------------------------------------------
function onTransition(t) {
  const list = state.history.get(t.sandboxId) ?? [];
  list.push(t);
  state.history.set(t.sandboxId, list);
  state.timeline.unshift(t);
  if (state.timeline.length > 200) state.timeline.length = 200;
  renderTimeline();
  scheduleRefresh();
  if (detailOpen()) {
    renderEvents();
    scheduleDetailRefresh();
  }
}

/** Milliseconds spent holding memory and asleep, from the sandbox's transitions. */
export function timeSplit(transitions, now) {
  let held = 0;
  let asleep = 0;
  for (let i = 0; i < transitions.length; i++) {
    const t = transitions[i];
    const end = i + 1 < transitions.length ? Date.parse(transitions[i + 1].at) : now;
    const d = Math.max(0, end - Date.parse(t.at));
    if (HOLDING.has(t.to)) held += d;
    else if (SLEEPING.has(t.to)) asleep += d;
  }
  return { held, asleep };
}

function costOf(s, now) {
  if (state.cost) {
    const row = state.cost.bySandbox.get(s.id);
    return { cost: row?.spent ?? 0, saved: row?.saved ?? 0 };
  }
  const hist = state.history.get(s.id);
  // Without history (events not read yet, or older than the stream): the current state only.
  const split = hist?.length ? timeSplit(hist, now) : timeSplit([{ to: s.state, at: s.stateSince }], now);
  const gib = s.memoryLimitBytes / GIB;
  return {
    cost: (gib * split.held * ESTIMATE_PER_GIB_HOUR) / 3_600_000,
    saved: (gib * split.asleep * ESTIMATE_PER_GIB_HOUR) / 3_600_000,
  };
}

function freedBytes(s) {
  if (!SLEEPING.has(s.state)) return 0;
  const ck = s.checkpointId ? state.checkpoints.get(s.checkpointId) : undefined;
  return ck && ck.kind === 'memory' ? ck.logicalBytes : 0;
}

// ---- rendering -------------------------------------------------------------------------

// ---- rendering -------------------------------------------------------------------------
const openLink = (s) =>
  el(
    'a',
    { href: `#sandbox=${encodeURIComponent(s.id)}`, title: 'its page: metrics, checkpoints, logs, events' },
    s.name,
  );

function render() {
  const now = Date.now();
  const body = $('sandboxes').querySelector('tbody');
  body.replaceChildren();
  let held = 0;
  let freed = 0;
  let cost = 0;
  let saved = 0;
  let awake = 0;
  let asleep = 0;
  for (const th of document.querySelectorAll('.col-tenant')) th.hidden = !session.admin;
  for (const s of state.sandboxes) {
    const c = costOf(s, now);
    cost += c.cost;
    saved += c.saved;
    held += s.memoryBytes;
    const f = freedBytes(s);
    freed += f;
    if (SLEEPING.has(s.state)) asleep++;
    else if (s.state !== 'failed') awake++;
    const doing = pending.get(s.id);
    const busy = doing !== undefined || BUSY.has(s.state);
    const canHibernate = !busy && (s.state === 'running' || s.state === 'paused');
    const canResume = !busy && (s.state === 'paused' || SLEEPING.has(s.state));
    const memory =
      s.memoryBytes > 0
        ? el('span', {}, `${formatBytes(s.memoryBytes)} held`)
        : el('span', { class: 'freed' }, f > 0 ? `${formatBytes(f)} freed` : 'none held');
    body.append(
      el(
        'tr',
        { 'data-sandbox': s.id, 'data-state': s.state, 'data-tenant': s.tenant },
        el('td', {}, el('b', {}, openLink(s)), s.name !== s.id ? el('span', { class: 'id' }, s.id) : null),
        session.admin ? el('td', { 'data-testid': 'tenant' }, s.tenant) : null,
        el(
          'td',
          {},
          el('span', { class: `state s-${s.state}`, 'data-testid': 'state' }, doing ? `${doing}…` : s.state),
        ),
        el('td', { title: s.stateSince }, formatDuration(now - Date.parse(s.stateSince))),
        el('td', {}, memory),
        el('td', {}, money(c.cost)),
        el('td', {}, money(c.saved)),
        el('td', {}, labelChips(s.labels, filterByLabel)),
        el(
          'td',
          { class: 'actions' },
          el(
            'button',
            { disabled: !canHibernate, onclick: () => void rowAction(s, 'hibernate') },
            'Hibernate',
          ),
          el('button', { disabled: !canResume, onclick: () => void rowAction(s, 'resume') }, 'Resume'),
        ),
      ),
    );
  }
  $('empty').hidden = state.sandboxes.length > 0 || filtered();
  $('no-match').hidden = state.sandboxes.length > 0 || !filtered();
  $('t-count').textContent = String(state.sandboxes.length);
  $('t-awake').textContent = String(awake);
  $('t-asleep').textContent = String(asleep);
  $('t-held').textContent = formatBytes(held);
  $('t-freed').textContent = formatBytes(freed);
  // Filtered, the totals are those of the rows shown; else the daemon's own (which also
  // count sandboxes deleted within its window).
  const whole = state.cost && !filtered();
  $('t-cost').textContent = money(whole ? state.cost.totals.spent : cost);
  $('t-saved').textContent = money(whole ? state.cost.totals.saved : saved);
  $('cost-metered').hidden = !state.cost;
  $('cost-estimate').hidden = !!state.cost;
}

function renderTimeline() {
  const names = new Map(state.sandboxes.map((s) => [s.id, s.name]));
  const t = state.filter.tenant;
  $('timeline').replaceChildren(
    ...state.timeline
      .filter((x) => !t || x.tenant === t)
      .slice(0, 100)
      .map((x) =>
        el(
          'li',
          { 'data-to': x.to, 'data-sandbox': x.sandboxId },
          el('time', { datetime: x.at, title: x.at }, new Date(x.at).toLocaleTimeString()),
          el('b', {}, names.get(x.sandboxId) ?? x.sandboxId),
          el(
            'span',
            {},
            x.from ? el('span', { class: `s-${x.from}` }, x.from) : '(new)',
            ' → ',
            el('span', { class: `s-${x.to}` }, x.to),
          ),
          el('span', { class: 'reason' }, x.reason),
        ),
      ),
  );
}

function showError(message) {
  $('error').textContent = message ?? '';
  $('error').hidden = !message;
}

async function rowAction(s, op) {
  showError(null);
  try {
    await act(s, op, render);
  } catch (e) {
    showError(`${op} ${s.name}: ${e.message}`);
  }
  await refresh();
}

// ---- filters ---------------------------------------------------------------------------
const filtered = () => state.filter.tenant !== '' || state.filter.label !== '';

function filterByLabel(k, v) {
  state.filter.label = `${k}=${v}`;
  $('f-label').value = state.filter.label;
  if (detailOpen()) location.hash = '';
  void refresh();
}

function renderTenantFilter() {
  const select = $('f-tenant');
  $('f-tenant-wrap').hidden = !session.admin;
  if (!session.admin) return;
  const want = ['', ...[...state.tenants].sort()];
  const have = [...select.options].map((o) => o.value);
  if (want.join('\n') !== have.join('\n')) {
    select.replaceChildren(...want.map((t) => el('option', { value: t }, t || 'all tenants')));
  }
  select.value = state.filter.tenant;
}

function listQuery() {
  // The largest page: the table shows every sandbox of a node this size.
  const q = new URLSearchParams({ limit: '1000' });
  if (state.filter.tenant) q.set('tenant', state.filter.tenant);
  if (state.filter.label) q.append('label', state.filter.label);
  return q.toString();
}

/** Cumulative spent against always-warm over the metered window, as two SVG lines. */
function renderChart(series, currency) {
  const svg = $('cost-chart');
  const ns = 'http://www.w3.org/2000/svg';
  svg.replaceChildren();
  if (series.length === 0) return;
  const W = 600;
  const H = 160;
  const pad = 28;
  const t0 = Date.parse(series[0].at);
  const t1 = Date.parse(series[series.length - 1].at);
  const top = Math.max(...series.map((p) => Math.max(p.alwaysWarm, p.spent)), 1e-9);
  const x = (at) => pad + ((Date.parse(at) - t0) / Math.max(t1 - t0, 1)) * (W - 2 * pad);
  const y = (v) => H - pad - (v / top) * (H - 2 * pad);
  const el = (name, attrs) => {
    const e = document.createElementNS(ns, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    svg.appendChild(e);
    return e;
  };
  el('line', { x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, class: 'axis' });
  el('line', { x1: pad, y1: pad, x2: pad, y2: H - pad, class: 'axis' });
  for (const key of ['alwaysWarm', 'spent']) {
    el('polyline', {
      class: key === 'spent' ? 'spent' : 'warm',
      'data-series': key,
      points: series.map((p) => `${x(p.at).toFixed(1)},${y(p[key]).toFixed(1)}`).join(' '),
    });
  }
  el('text', { x: pad + 4, y: pad - 8 }).textContent = `${top.toFixed(top >= 1 ? 2 : 6)} ${currency}`;
  el('text', { x: W - pad, y: H - 8, 'text-anchor': 'end' }).textContent = new Date(t1).toLocaleTimeString();
  el('text', { x: pad, y: H - 8 }).textContent = new Date(t0).toLocaleTimeString();
}

// ---- lifecycle -------------------------------------------------------------------------
let refreshTimer;
function scheduleRefresh() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(() => void refresh(), 150);
}

async function refresh() {
  try {
    const [{ sandboxes }, { checkpoints }, cost] = await Promise.all([
      api('GET', `/v1/sandboxes?${listQuery()}`),
      api('GET', '/v1/checkpoints'),
      // A daemon without metering answers 404: the page falls back to its estimate.
      api('GET', '/v1/cost?by=sandbox&points=48').catch((e) => {
        if (e.status === 404) return null;
        throw e;
      }),
    ]);
    state.cost = cost && {
      currency: cost.currency,
      totals: cost.totals,
      bySandbox: new Map((cost.sandboxes ?? []).map((r) => [r.sandboxId, r])),
    };
    state.sandboxes = sandboxes;
    for (const s of sandboxes) state.tenants.add(s.tenant);
    state.checkpoints = new Map(checkpoints.map((c) => [c.id, c]));
    renderTenantFilter();
    renderChart(cost?.series ?? [], cost?.currency ?? '');
    render();
    renderTimeline();
  } catch (e) {
    if (e.status === 401) signOut('the token was refused');
    else showError(e.message);
  }
}

function setConnected(live) {
  $('conn').textContent = live ? 'live' : 'reconnecting…';
  $('conn').classList.toggle('live', live);
}

function signOut(why) {
  localStorage.removeItem('dormant.token');
  state.events?.();
  state.events = null;
  session.token = '';
  session.admin = false;
  closeDetail();
  $('app').hidden = true;
  $('signout').hidden = true;
  $('login').hidden = false;
  $('whoami').textContent = '';
  $('conn').textContent = why ?? 'not connected';
  $('conn').classList.remove('live');
}

/** Admin or tenant: GET /v1/tokens answers admins (with every token's tenant) and 403 to others. */
async function whoAmI() {
  try {
    const { tokens } = await api('GET', '/v1/tokens');
    session.admin = true;
    for (const t of tokens) if (!t.revokedAt) state.tenants.add(t.tenant);
  } catch (e) {
    if (e.status !== 403) throw e;
    session.admin = false;
  }
  $('whoami').textContent = session.admin ? 'admin: every tenant' : 'one tenant';
}

async function start(token) {
  state.events?.();
  session.token = token;
  state.history.clear();
  state.timeline = [];
  state.tenants.clear();
  state.filter = { tenant: '', label: '' };
  $('f-label').value = '';
  $('login').hidden = true;
  $('signout').hidden = false;
  try {
    await whoAmI();
  } catch (e) {
    if (e.status === 401) return signOut('the token was refused');
    showError(e.message);
  }
  route();
  await refresh();
  if (!session.token) return;
  state.events = followEvents(onTransition);
}

/** The view the fragment names: a sandbox's page (#sandbox=ID), else the list. */
function route() {
  const m = /^#sandbox=([^&]+)/.exec(location.hash);
  if (m) return openDetail(decodeURIComponent(m[1]));
  closeDetail();
  document.title = 'dormant';
  $('app').hidden = false;
  scheduleRefresh();
}

/** A token in the fragment (never sent to a server) is saved, then removed from the address bar. */
function tokenFromHash() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (!m) return undefined;
  const token = decodeURIComponent(m[1]);
  localStorage.setItem('dormant.token', token);
  history.replaceState(null, '', location.pathname + location.search);
  return token;
}

function boot() {
  $('price').textContent = `$${ESTIMATE_PER_GIB_HOUR}`;
  tokenFromHash();
  initDetail({
    history: state.history,
    onLabel: filterByLabel,
    onChange: (message) => {
      if (message) showError(null);
      if (message) $('notice').textContent = message;
      scheduleRefresh();
    },
  });
  window.addEventListener('hashchange', () => {
    // Pasting a /#token=... address into an open tab changes only the fragment: no reload.
    const t = tokenFromHash();
    if (t) return void start(t);
    if (session.token) route();
  });
  $('login').addEventListener('submit', (e) => {
    e.preventDefault();
    const t = $('token').value.trim();
    if (!t) return;
    localStorage.setItem('dormant.token', t);
    $('token').value = '';
    void start(t);
  });
  $('signout').addEventListener('click', () => signOut());
  $('f-tenant').addEventListener('change', () => {
    state.filter.tenant = $('f-tenant').value;
    void refresh();
  });
  $('filters').addEventListener('submit', (e) => {
    e.preventDefault();
    state.filter.label = $('f-label').value.trim();
    void refresh();
  });
  $('f-clear').addEventListener('click', () => {
    state.filter = { tenant: '', label: '' };
    $('f-label').value = '';
    void refresh();
  });
  // Time in state and costs move on their own; metrics and logs without any transition.
  setInterval(() => session.token && render(), 1000);
  setInterval(() => {
    if (!session.token) return;
    void refresh();
    if (detailOpen()) void refreshDetail();
  }, 5000);
  const saved = localStorage.getItem('dormant.token');
  if (saved) void start(saved);
  else signOut();
}

if (typeof document !== 'undefined') boot();
