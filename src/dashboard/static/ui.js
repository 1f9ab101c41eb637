// What the dashboard's two views (the list, app.js; a sandbox's page, detail.js) share: the
// API call with the token, element building, number formatting, the confirmation dialog and
// the small SVG line chart.

/** The signed-in session: the token, and whether it is an admin's (probed at sign-in). */
export const session = { token: '', admin: false };

export const $ = (id) => document.getElementById(id);

export async function api(method, path, body) {
  const headers = { authorization: `Bearer ${session.token}` };
  if (body !== undefined) headers['content-type'] = 'application/json';
  const res = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const type = res.headers.get('content-type') ?? '';
  const data = res.status === 204 ? null : type.includes('json') ? await res.json() : await res.text();
  if (!res.ok) {
    const e = data?.error ?? { code: `HTTP_${res.status}`, message: String(data) };
    const err = new Error(`${e.code}: ${e.message}${e.hint ? ` (${e.hint})` : ''}`);
    err.status = res.status;
    throw err;
  }
  return data;
}

export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== false) e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

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

/** A sandbox's labels as chips; a click on one calls onPick(key, value) (the list filters by it). */
export function labelChips(labels, onPick) {
  return el(
    'span',
    { class: 'labels' },
    ...Object.entries(labels ?? {}).map(([k, v]) =>
      el(
        'button',
        {
          class: 'chip',
          type: 'button',
          title: `only sandboxes labelled ${k}=${v}`,
          onclick: () => onPick?.(k, v),
        },
        `${k}=${v}`,
      ),
    ),
  );
}

/**
 * Asks before an action (the page's <dialog>): resolves true when confirmed, false when
 * cancelled (the Cancel button or Escape). `detail` explains what will happen.
 */
export function confirmAction(title, detail, confirmLabel) {
  const dialog = $('confirm');
  $('confirm-title').textContent = title;
  $('confirm-detail').textContent = detail;
  $('confirm-ok').textContent = confirmLabel;
  $('confirm-ok').classList.toggle('danger', /delete/i.test(confirmLabel));
  return new Promise((resolve) => {
    const done = (ok) => {
      dialog.removeEventListener('close', onClose);
      resolve(ok);
    };
    const onClose = () => done(dialog.returnValue === 'ok');
    dialog.addEventListener('close', onClose);
    dialog.returnValue = '';
    dialog.showModal();
  });
}

const SVG = 'http://www.w3.org/2000/svg';

/**
 * One series as a line in `svg` (viewBox 0 0 W H): x is time, y from 0 to the series' top;
 * labels at the top (the largest value) and under the axis (first and last time). The svg's
 * data-points says how many samples it drew.
 */
export function lineChart(svg, points, { format, series }) {
  svg.replaceChildren();
  const W = 600;
  const H = 140;
  const pad = 28;
  const add = (name, attrs) => {
    const e = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    svg.appendChild(e);
    return e;
  };
  add('line', { x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, class: 'axis' });
  add('line', { x1: pad, y1: pad, x2: pad, y2: H - pad, class: 'axis' });
  svg.dataset.points = String(points.length);
  if (points.length === 0) {
    add('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle' }).textContent = 'no samples yet';
    return;
  }
  const t0 = points[0].at;
  const t1 = points[points.length - 1].at;
  const top = Math.max(...points.map((p) => p.value), 1e-9);
  const x = (at) => pad + ((at - t0) / Math.max(t1 - t0, 1)) * (W - 2 * pad);
  const y = (v) => H - pad - (v / top) * (H - 2 * pad);
  // No samples while it slept: a gap well past the usual interval (and past a busy node's
  // jitter, 5 s) breaks the line rather than drawing a slope across a time nothing was
  // measured (a lone point shows as a dot).
  const steps = points.slice(1).map((p, i) => p.at - points[i].at);
  const usual = [...steps].sort((a, b) => a - b)[Math.floor(steps.length / 2)] ?? 0;
  const gap = Math.max(3 * usual, 5000);
  const xy = (p) => `${x(p.at).toFixed(1)},${y(p.value).toFixed(1)}`;
  const d = points
    .map((p, i) => (i === 0 || p.at - points[i - 1].at > gap ? `M${xy(p)} L${xy(p)}` : `L${xy(p)}`))
    .join(' ');
  add('path', { class: series, 'data-series': series, d });
  add('text', { x: pad + 4, y: pad - 8 }).textContent = format(top);
  add('text', { x: pad, y: H - 8 }).textContent = new Date(t0).toLocaleTimeString();
  add('text', { x: W - pad, y: H - 8, 'text-anchor': 'end' }).textContent = new Date(t1).toLocaleTimeString();
}
