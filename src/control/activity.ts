/**
 * Activity the database does not see: exec sessions running right now. The controller's
 * exec records activity when it ends; while it runs (a test suite, a long build) the policy
 * must not hibernate the sandbox under it, so the daemon runs a controller that counts them.
 */
import type { Sandbox } from '../domain/sandbox.js';
import type { AgentClient } from '../runtime/agent-client.js';
import { SandboxController } from './sandboxes.js';

/** Live counters per sandbox id. */
export class Counter {
  private readonly counts = new Map<string, number>();
  begin(id: string): void {
    this.counts.set(id, (this.counts.get(id) ?? 0) + 1);
  }
  end(id: string): void {
    const n = (this.counts.get(id) ?? 0) - 1;
    if (n > 0) this.counts.set(id, n);
    else this.counts.delete(id);
  }
  count(id: string): number {
    return this.counts.get(id) ?? 0;
  }
}

/** A SandboxController that counts running execs (every toolbox call) per sandbox. */
export class TrackingController extends SandboxController {
  readonly execs = new Counter();

  /** Every toolbox call (an exec, a streamed command, a file transfer) counts while it runs. */
  override async toolbox<T>(
    ref: string,
    tenant: string | undefined,
    fn: (agent: AgentClient, s: Sandbox) => Promise<T>,
  ): Promise<T> {
    const id = (await this.get(ref, tenant)).id;
    this.execs.begin(id);
    try {
      return await super.toolbox(ref, tenant, fn);
    } finally {
      this.execs.end(id);
    }
  }
}
