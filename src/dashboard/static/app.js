// The dashboard: a plain ES module, no framework and no build step (the page is one table,
// seven numbers and a list; a framework would outweigh it). It talks only to the HTTP API,
// with the token the user pasted (localStorage) or passed once as /#token=... .
//
// Data: GET /v1/sandboxes every few seconds and on every event; GET /v1/checkpoints for the
// sizes of memory checkpoints (memory freed); GET /v1/cost?by=sandbox for what each sandbox
// spent and what sleeping saved (the daemon's metering); GET /v1/events (server-sent events,
// read with fetch because EventSource cannot send an Authorization header) from the first
// transition, for the timeline and, on a daemon without /v1/cost, a labelled estimate. The
// stream is read by the SDK's own reader (src/sdk/sse.ts), which the daemon serves compiled
// as /dashboard/sse.js.
import { readEventStream } from './sse.js';

/** Used only when the daemon has no /v1/cost; the page then says it is an estimate. */
const ESTIMATE_PER_GIB_HOUR = 0.005;
const HOLDING = new Set(['creating', 'running', 'paused', 'hibernating', 'resuming']);
const SLEEPING = new Set(['hibernated', 'archived']);
const BUSY = new Set(['creating', 'hibernating', 'resuming', 'deleting']);
const GIB = 1024 ** 3;

const $ = (id) => document.getElementById(id);
const state = {
  token: '',
  sandboxes: [],
  checkpoints: new Map(),
  /** sandboxId -> transitions, oldest first. */
  history: new Map(),
  timeline: [],
  pending: new Map(),
  events: null,
  /** The daemon's metering: { currency, totals, bySandbox }, or null (then: the estimate). */
  cost: null,
};

// ---- formatting ------------------------------------------------------------------------
export function formatBytes(n) {
  if (!n) return '0 B';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n >= 10 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

export function formatDuration(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

/** Small amounts keep their digits (a sandbox-hour of memory is a fraction of a cent). */
export function formatMoney(x, currency) {
  const abs = Math.abs(x);
  const digits = abs === 0 || abs >= 1 ? 2 : abs >= 0.01 ? 4 : 6;
  let text = x.toFixed(digits);
  // Rounded to nothing (or to minus nothing): say zero plainly.
  if (Number(text) === 0) text = (0).toFixed(2);
  return currency ? `${text} ${currency}` : `$${text}`;
}

const money = (x) => formatMoney(x, state.cost?.currency);

// ---- API -------------------------------------------------------------------------------
async function api(method, path) {
  const res = await fetch(path, { method, headers: { authorization: `Bearer ${state.token}` } });
  const body = res.headers.get('content-type')?.includes('json') ? await res.json() : await res.text();
  if (!res.ok) {
    const e = body?.error ?? { code: `HTTP_${res.status}`, message: String(body) };
    const err = new Error(`${e.code}: ${e.message}${e.hint ? ` (${e.hint})` : ''}`);
    err.status = res.status;
    throw err;
  }
  return body;
}

/** Reads GET /v1/events as a stream and calls onTransition for each; reconnects after a drop. */
function followEvents(onTransition) {
  const ac = new AbortController();
  let lastId = 0;
  const run = async () => {
    while (!ac.signal.aborted) {
      try {
        const res = await fetch(`/v1/events?since=${lastId}`, {
          headers: { authorization: `Bearer ${state.token}` },
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
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== false) e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

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
  for (const s of state.sandboxes) {
    const c = costOf(s, now);
    cost += c.cost;
    saved += c.saved;
    held += s.memoryBytes;
    const f = freedBytes(s);
    freed += f;
    if (SLEEPING.has(s.state)) asleep++;
    else if (s.state !== 'failed') awake++;
    const pending = state.pending.get(s.id);
    const busy = pending !== undefined || BUSY.has(s.state);
    const canHibernate = !busy && (s.state === 'running' || s.state === 'paused');
    const canResume = !busy && (s.state === 'paused' || SLEEPING.has(s.state));
    const memory =
      s.memoryBytes > 0
        ? el('span', {}, `${formatBytes(s.memoryBytes)} held`)
        : el('span', { class: 'freed' }, f > 0 ? `${formatBytes(f)} freed` : 'none held');
    body.append(
      el(
        'tr',
        { 'data-sandbox': s.id, 'data-state': s.state },
        el('td', {}, el('b', {}, s.name), s.name !== s.id ? el('span', { class: 'id' }, s.id) : null),
        el(
          'td',
          {},
          el(
            'span',
            { class: `state s-${s.state}`, 'data-testid': 'state' },
            pending ? `${pending}…` : s.state,
          ),
        ),
        el('td', { title: s.stateSince }, formatDuration(now - Date.parse(s.stateSince))),
        el('td', {}, memory),
        el('td', {}, money(c.cost)),
        el('td', {}, money(c.saved)),
        el(
          'td',
          { class: 'actions' },
          el('button', { disabled: !canHibernate, onclick: () => act(s, 'hibernate') }, 'Hibernate'),
          el('button', { disabled: !canResume, onclick: () => act(s, 'resume') }, 'Resume'),
        ),
      ),
    );
  }
  $('empty').hidden = state.sandboxes.length > 0;
  $('t-count').textContent = String(state.sandboxes.length);
  $('t-awake').textContent = String(awake);
  $('t-asleep').textContent = String(asleep);
  $('t-held').textContent = formatBytes(held);
  $('t-freed').textContent = formatBytes(freed);
  $('t-cost').textContent = money(state.cost ? state.cost.totals.spent : cost);
  $('t-saved').textContent = money(state.cost ? state.cost.totals.saved : saved);
  $('cost-metered').hidden = !state.cost;
  $('cost-estimate').hidden = !!state.cost;
}

function renderTimeline() {
  const names = new Map(state.sandboxes.map((s) => [s.id, s.name]));
  $('timeline').replaceChildren(
    ...state.timeline
      .slice(0, 100)
      .map((t) =>
        el(
          'li',
          { 'data-to': t.to, 'data-sandbox': t.sandboxId },
          el('time', { datetime: t.at, title: t.at }, new Date(t.at).toLocaleTimeString()),
          el('b', {}, names.get(t.sandboxId) ?? t.sandboxId),
          el(
            'span',
            {},
            t.from ? el('span', { class: `s-${t.from}` }, t.from) : '(new)',
            ' → ',
            el('span', { class: `s-${t.to}` }, t.to),
          ),
          el('span', { class: 'reason' }, t.reason),
        ),
      ),
  );
}

function showError(message) {
  $('error').textContent = message ?? '';
  $('error').hidden = !message;
}

async function act(s, op) {
  state.pending.set(s.id, op === 'hibernate' ? 'hibernating' : 'resuming');
  showError(null);
  render();
  try {
    await api('POST', `/v1/sandboxes/${encodeURIComponent(s.id)}/${op}`);
  } catch (e) {
    showError(`${op} ${s.name}: ${e.message}`);
  } finally {
    state.pending.delete(s.id);
    await refresh();
  }
}

// ---- chart ------------------------------------------------------------------------------
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
      // The largest page: the table shows every sandbox of a node this size.
      api('GET', '/v1/sandboxes?limit=1000'),
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
    state.checkpoints = new Map(checkpoints.map((c) => [c.id, c]));
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
  state.token = '';
  $('app').hidden = true;
  $('signout').hidden = true;
  $('login').hidden = false;
  $('conn').textContent = why ?? 'not connected';
  $('conn').classList.remove('live');
}

async function start(token) {
  state.token = token;
  state.history.clear();
  state.timeline = [];
  $('login').hidden = true;
  $('app').hidden = false;
  $('signout').hidden = false;
  await refresh();
  if (!state.token) return;
  state.events = followEvents(onTransition);
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
  // Pasting a /#token=... address into an open tab changes only the fragment: no reload.
  window.addEventListener('hashchange', () => {
    const t = tokenFromHash();
    if (t) {
      state.events?.();
      void start(t);
    }
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
  // Time in state and costs move on their own.
  setInterval(() => state.token && render(), 1000);
  setInterval(() => state.token && void refresh(), 5000);
  const saved = localStorage.getItem('dormant.token');
  if (saved) void start(saved);
  else signOut();
}

if (typeof document !== 'undefined') boot();
