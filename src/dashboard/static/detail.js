// A sandbox's page (#sandbox=ID): its state, tenant and labels; memory and CPU over time from
// the meter's samples (GET /v1/sandboxes/{id}/metrics); its checkpoints with their sizes and,
// on request, the secret scan of each (GET /v1/checkpoints/{id}/scan, which reads the
// checkpoint back from the vault: too costly to run for every row unasked); its log; its
// transitions (from the page's event stream); and every action, each asked for first.
import { $, api, confirmAction, el, formatBytes, formatDuration, labelChips, lineChart } from './ui.js';

/**
 * What each action does, the states it may start from (the no-op ones left out: resuming a
 * running sandbox does nothing, so its button is off), and what the confirmation says.
 */
export const ACTIONS = {
  pause: {
    label: 'Pause',
    from: ['running'],
    doing: 'pausing',
    detail: 'Its processes are frozen where they are; its memory stays held. Resume thaws them.',
  },
  hibernate: {
    label: 'Hibernate',
    from: ['running', 'paused'],
    doing: 'hibernating',
    detail:
      'Its processes and files are checkpointed into the vault and its memory is freed. Resume restores it where it was.',
  },
  resume: {
    label: 'Resume',
    from: ['paused', 'hibernated', 'archived'],
    doing: 'resuming',
    detail: 'It runs again: thawed, restored from its checkpoint, or (archived) started afresh on its files.',
  },
  fork: {
    label: 'Fork',
    from: ['running', 'paused', 'hibernated'],
    doing: 'forking',
    detail:
      'A new sandbox starts from a checkpoint of this one (taken now if it runs), with its memory and files; this one carries on.',
  },
  archive: {
    label: 'Archive',
    from: ['running', 'paused', 'hibernated'],
    doing: 'archiving',
    detail: 'Its processes end and only its files are kept. Resume starts its command again on them.',
  },
  delete: {
    label: 'Delete',
    from: ['creating', 'running', 'paused', 'hibernating', 'hibernated', 'resuming', 'archived', 'failed'],
    doing: 'deleting',
    detail: 'The sandbox, its files and its checkpoints are removed for good. This cannot be undone.',
  },
};

/** Pending actions by sandbox id (the button row shows them until the API answers). */
export const pending = new Map();

/**
 * Asks, then runs `op` on sandbox `s`. Resolves to the API's answer (the forked sandbox for a
 * fork), or undefined when the user cancelled. Errors are thrown to the caller, which shows them.
 */
export async function act(s, op, onBusy) {
  const a = ACTIONS[op];
  const ok = await confirmAction(`${a.label} ${s.name}?`, a.detail, a.label);
  if (!ok) return undefined;
  pending.set(s.id, a.doing);
  onBusy?.();
  const path = `/v1/sandboxes/${encodeURIComponent(s.id)}`;
  try {
    if (op === 'delete') return (await api('DELETE', path)) ?? { deleted: s.id };
    return await api('POST', `${path}/${op}`, op === 'fork' ? {} : undefined);
  } finally {
    pending.delete(s.id);
  }
}

// ---- the page ------------------------------------------------------------------------------
const view = {
  id: undefined,
  sandbox: undefined,
  /** checkpoint id -> the scan's report, or {error}, or 'scanning'. */
  scans: new Map(),
  /** Transitions by sandbox id (the list's, fed by the event stream). */
  history: new Map(),
  /** Filters the list by a label (a chip's click). */
  onLabel: undefined,
  /** Tells the list something changed (it refreshes). */
  onChange: undefined,
};

export function initDetail({ history, onLabel, onChange }) {
  view.history = history;
  view.onLabel = onLabel;
  view.onChange = onChange;
}

export const detailOpen = () => view.id !== undefined;

export function openDetail(id) {
  if (view.id !== id) {
    view.scans.clear();
    view.sandbox = undefined;
    $('d-message').textContent = '';
    showDetailError(null);
  }
  view.id = id;
  $('app').hidden = true;
  $('detail').hidden = false;
  void refreshDetail();
}

export function closeDetail() {
  view.id = undefined;
  $('detail').hidden = true;
}

function showDetailError(message) {
  $('d-error').textContent = message ?? '';
  $('d-error').hidden = !message;
}

let timer;
/** Soon, once: transitions come in bursts (hibernating, then hibernated). */
export function scheduleDetailRefresh() {
  if (!view.id) return;
  clearTimeout(timer);
  timer = setTimeout(() => void refreshDetail(), 150);
}

export async function refreshDetail() {
  const id = view.id;
  if (!id) return;
  const enc = encodeURIComponent(id);
  let s;
  try {
    s = await api('GET', `/v1/sandboxes/${enc}`);
  } catch (e) {
    if (e.status === 404) {
      // Deleted (here, by someone else, or by the policy): back to the list, saying so.
      closeDetail();
      location.hash = '';
      view.onChange?.(`sandbox ${view.sandbox?.name ?? id} is gone`);
      return;
    }
    return showDetailError(e.message);
  }
  if (view.id !== id) return;
  view.sandbox = s;
  renderHead(s);
  const [metrics, checkpoints, logs] = await Promise.all([
    api('GET', `/v1/sandboxes/${enc}/metrics`).catch((e) => ({ error: e })),
    api('GET', `/v1/checkpoints?sandbox=${enc}`).catch((e) => ({ error: e })),
    api('GET', `/v1/sandboxes/${enc}/logs`).catch((e) => ({ error: e })),
  ]);
  if (view.id !== id) return;
  renderMetrics(metrics.samples ?? []);
  renderCheckpoints(checkpoints.checkpoints ?? []);
  renderLogs(typeof logs === 'string' ? logs : `(${logs.error?.message ?? 'no log'})`);
  renderEvents();
  const failed = [metrics, checkpoints].find((x) => x.error);
  showDetailError(failed ? failed.error.message : null);
}

function renderHead(s) {
  document.title = `${s.name} · dormant`;
  $('d-name').textContent = s.name;
  $('d-id').textContent = s.id === s.name ? '' : s.id;
  const doing = pending.get(s.id);
  const st = $('d-state');
  st.className = `state s-${s.state}`;
  st.textContent = doing ? `${doing}…` : s.state;
  st.dataset.state = s.state;
  const facts = [
    ['tenant', s.tenant],
    ['in this state for', formatDuration(Date.now() - Date.parse(s.stateSince))],
    ['memory', `${formatBytes(s.memoryBytes)} held of ${formatBytes(s.memoryLimitBytes)}`],
    ['CPUs', String(s.cpus)],
    ['command', s.command.join(' ')],
    ['created', new Date(s.createdAt).toLocaleString()],
  ];
  if (s.lastError) facts.push(['last error', s.lastError]);
  $('d-facts').replaceChildren(
    ...facts.flatMap(([k, v]) => [el('dt', {}, k), el('dd', { 'data-fact': k }, v)]),
    el('dt', {}, 'labels'),
    el(
      'dd',
      { 'data-fact': 'labels' },
      Object.keys(s.labels).length ? labelChips(s.labels, (k, v) => view.onLabel?.(k, v)) : 'none',
    ),
  );
  $('d-actions').replaceChildren(
    ...Object.entries(ACTIONS).map(([op, a]) =>
      el(
        'button',
        {
          type: 'button',
          'data-action': op,
          class: op === 'delete' ? 'danger' : undefined,
          disabled: doing !== undefined || !a.from.includes(s.state),
          onclick: () => void runAction(s, op),
        },
        a.label,
      ),
    ),
  );
}

async function runAction(s, op) {
  showDetailError(null);
  try {
    const r = await act(s, op, () => renderHead(s));
    if (r === undefined) return; // cancelled
    if (op === 'fork') {
      $('d-message').replaceChildren(
        'Forked: ',
        el('a', { href: `#sandbox=${encodeURIComponent(r.id)}`, 'data-testid': 'fork-link' }, r.name),
      );
    } else if (op === 'delete') {
      closeDetail();
      location.hash = '';
      view.onChange?.(`deleted ${s.name}`);
      return;
    } else {
      $('d-message').textContent = `${ACTIONS[op].label}: ${s.name} is ${r.state}`;
    }
  } catch (e) {
    showDetailError(`${op} ${s.name}: ${e.message}`);
  }
  view.onChange?.();
  await refreshDetail();
}

function renderMetrics(samples) {
  lineChart(
    $('d-memory'),
    samples.map((p) => ({ at: p.at, value: p.memoryBytes })),
    { series: 'memory', format: formatBytes },
  );
  lineChart(
    $('d-cpu'),
    samples.filter((p) => p.cpuPercent !== null).map((p) => ({ at: p.at, value: p.cpuPercent })),
    { series: 'cpu', format: (v) => `${v.toFixed(v >= 10 ? 0 : 1)}% of a CPU` },
  );
  $('d-samples').textContent = samples.length
    ? `${samples.length} samples of the last hour, while it ran or was paused`
    : 'No samples yet: the meter samples a running sandbox every few seconds.';
}

function scanCell(ck) {
  if (ck.kind !== 'memory') return el('span', { class: 'muted' }, 'files only');
  const r = view.scans.get(ck.id);
  if (r === undefined)
    return el(
      'button',
      { type: 'button', 'data-scan': ck.id, onclick: () => void scan(ck) },
      'Scan for secrets',
    );
  if (r === 'scanning') return el('span', { class: 'muted' }, 'scanning…');
  if (r.error) return el('span', { class: 'error' }, r.error);
  if (r.findings.length === 0)
    return el('span', { class: 'clean', 'data-findings': '0' }, 'no secrets found');
  const kinds = [...new Set(r.findings.map((f) => `${f.kind} (${f.where})`))].join(', ');
  return el(
    'span',
    { class: 'findings', 'data-findings': String(r.findings.length), title: kinds },
    `${r.findings.length} possible secret${r.findings.length === 1 ? '' : 's'}: ${kinds}`,
  );
}

async function scan(ck) {
  view.scans.set(ck.id, 'scanning');
  rerenderCheckpoints();
  try {
    view.scans.set(ck.id, await api('GET', `/v1/checkpoints/${encodeURIComponent(ck.id)}/scan`));
  } catch (e) {
    view.scans.set(ck.id, { error: e.message });
  }
  rerenderCheckpoints();
}

let lastCheckpoints = [];
const rerenderCheckpoints = () => renderCheckpoints(lastCheckpoints);

function renderCheckpoints(list) {
  lastCheckpoints = list;
  const current = view.sandbox?.checkpointId;
  const rows = [...list]
    .sort((a, b) => Date.parse(b.createdAt) - Date.parse(a.createdAt))
    .map((ck) =>
      el(
        'tr',
        { 'data-checkpoint': ck.id, 'data-kind': ck.kind },
        el('td', {}, ck.id, ck.id === current ? el('span', { class: 'id' }, 'newest') : null),
        el('td', {}, ck.kind),
        el('td', { title: ck.createdAt }, new Date(ck.createdAt).toLocaleString()),
        el('td', { 'data-size': 'logical' }, formatBytes(ck.logicalBytes)),
        el('td', { 'data-size': 'stored' }, formatBytes(ck.storedBytes)),
        el('td', {}, scanCell(ck)),
      ),
    );
  $('d-checkpoints')
    .querySelector('tbody')
    .replaceChildren(...rows);
  $('d-no-checkpoints').hidden = list.length > 0;
}

/** The log's end: a long-running sandbox's whole log would be more than a page wants. */
const LOG_TAIL = 64 * 1024;

function renderLogs(text) {
  const pre = $('d-logs');
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = text.length > LOG_TAIL ? `…\n${text.slice(-LOG_TAIL)}` : text || '(empty)';
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

export function renderEvents() {
  if (!view.id) return;
  const list = [...(view.history.get(view.id) ?? [])].reverse();
  $('d-events').replaceChildren(
    ...list.map((t) =>
      el(
        'li',
        { 'data-to': t.to },
        el('time', { datetime: t.at, title: t.at }, new Date(t.at).toLocaleTimeString()),
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
