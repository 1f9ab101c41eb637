/** The host-side port firewall's rules for a gVisor sandbox (no root needed; runsc.test.ts applies them). */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { inboundChain, inboundRules } from './runsc-inbound.js';
import type { SandboxNetwork } from './runtime.js';

const net = {
  hostInterface: 'dmh42',
  address: '10.213.0.170',
  hostAddress: '10.213.0.169',
} as SandboxNetwork;

test('replies, ICMP and the declared ports pass; the rest is dropped', () => {
  assert.equal(inboundChain(net), 'DMI-42');
  assert.equal(
    inboundRules(net, [8080, 3000]),
    [
      '*filter',
      ':DMI-42 - [0:0]',
      '-A DMI-42 -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN',
      '-A DMI-42 -p icmp -j RETURN',
      '-A DMI-42 -p tcp -m tcp --dport 8080 -j RETURN',
      '-A DMI-42 -p tcp -m tcp --dport 3000 -j RETURN',
      '-A DMI-42 -j DROP',
      'COMMIT',
      '',
    ].join('\n'),
  );
  assert.ok(!inboundRules(net, []).includes('--dport'), 'no port declared: none open');
});
