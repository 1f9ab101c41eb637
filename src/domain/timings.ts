/**
 * Per-step wall times of one operation (a hibernate, a resume): where the time went. Steps may
 * overlap (two things done at once), so each one carries its start as well as its length; the
 * total is the operation's wall time, not the sum of its steps.
 */

export interface StepTiming {
  /** What ran: `freeze`, `runc checkpoint`, `vault put`, ... */
  step: string;
  /** Milliseconds from the start of the operation to the start of the step. */
  startMs: number;
  ms: number;
}

export interface OperationTimings {
  op: 'create' | 'hibernate' | 'resume' | 'fork' | 'template';
  sandboxId: string;
  /** Wall time of the whole operation (ms). */
  totalMs: number;
  /** False when the operation failed; the steps show how far it got. */
  ok: boolean;
  steps: StepTiming[];
}

/** What lower layers are handed to record their own steps into. */
export interface StepSink {
  time<T>(step: string, fn: () => Promise<T>): Promise<T>;
}

export class StepTimer implements StepSink {
  private readonly t0: number;
  private readonly list: StepTiming[] = [];

  constructor(private readonly now: () => number) {
    this.t0 = now();
  }

  /** Runs `fn` and records its wall time under `step` (also when it throws). */
  async time<T>(step: string, fn: () => Promise<T>): Promise<T> {
    const start = this.now();
    // Listed when it starts, so steps read in the order they began.
    const entry: StepTiming = { step, startMs: round(start - this.t0), ms: 0 };
    this.list.push(entry);
    try {
      return await fn();
    } finally {
      entry.ms = round(this.now() - start);
    }
  }

  /** A moment worth seeing among the steps (a zero-length step): `running`. */
  mark(step: string): void {
    this.list.push({ step, startMs: this.elapsedMs(), ms: 0 });
  }

  elapsedMs(): number {
    return round(this.now() - this.t0);
  }

  /** The steps in the order they started (a running step shows its length so far as 0). */
  steps(): StepTiming[] {
    return this.list.map((s) => ({ ...s }));
  }

  finish(op: OperationTimings['op'], sandboxId: string, ok: boolean): OperationTimings {
    return { op, sandboxId, totalMs: this.elapsedMs(), ok, steps: this.steps() };
  }
}

function round(ms: number): number {
  return Math.round(ms * 10) / 10;
}

/** One line for a log: `hibernate sb-x 812ms ok: freeze 3 | runc checkpoint 402 | ...`. */
export function formatTimings(t: OperationTimings): string {
  const steps = t.steps.map((s) => `${s.step} ${Math.round(s.ms)}@${Math.round(s.startMs)}`).join(' | ');
  return `${t.op} ${t.sandboxId} ${Math.round(t.totalMs)}ms ${t.ok ? 'ok' : 'failed'}: ${steps}`;
}
