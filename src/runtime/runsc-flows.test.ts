/** The host's connection tracking read for a gVisor sandbox's open TCP flows (no root needed). */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { describeFlows, openFlows } from './runsc-flows.js';

const TABLE = [
  // A request served with `Connection: close`: the sandbox (…142) closed first.
  'ipv4     2 tcp      6 119 TIME_WAIT src=10.213.19.141 dst=10.213.19.142 sport=58346 dport=8080 src=10.213.19.142 dst=10.213.19.141 sport=8080 dport=58346 [ASSURED] mark=0 zone=0 use=2',
  // The sandbox's own connection out (NAT: the reply's destination is the host's).
  'ipv4     2 tcp      6 431999 ESTABLISHED src=10.213.19.142 dst=10.0.0.9 sport=40000 dport=443 src=10.0.0.9 dst=192.168.1.5 sport=443 dport=40000 [ASSURED] mark=0 zone=0 use=2',
  // Reset: nothing of it is left in gVisor.
  'ipv4     2 tcp      6 9 CLOSE src=10.213.19.141 dst=10.213.19.142 sport=58347 dport=8080 src=10.213.19.142 dst=10.213.19.141 sport=8080 dport=58347 [ASSURED] mark=0 zone=0 use=2',
  // Another sandbox's flow, and UDP (saved by gVisor).
  'ipv4     2 tcp      6 50 ESTABLISHED src=10.213.19.145 dst=10.213.19.146 sport=1 dport=2 src=10.213.19.146 dst=10.213.19.145 sport=2 dport=1 mark=0 zone=0 use=2',
  'ipv4     2 udp      17 20 src=10.213.19.142 dst=10.213.19.141 sport=5353 dport=53 src=10.213.19.141 dst=10.213.19.142 sport=53 dport=5353 mark=0 zone=0 use=2',
  '',
].join('\n');

test("a sandbox's open and closing TCP flows, either direction; not closed ones, others' or UDP", () => {
  assert.deepEqual(openFlows(TABLE, '10.213.19.142'), [
    { local: '10.213.19.142:8080', remote: '10.213.19.141:58346', state: 'TIME_WAIT', secondsLeft: 119 },
    { local: '10.213.19.142:40000', remote: '10.0.0.9:443', state: 'ESTABLISHED', secondsLeft: 431999 },
  ]);
  assert.deepEqual(openFlows(TABLE, '10.213.19.150'), []);
  assert.deepEqual(openFlows('', '10.213.19.142'), []);
});

test('flows named in one line, the rest counted', () => {
  const flows = openFlows(TABLE, '10.213.19.142');
  assert.equal(
    describeFlows(flows),
    '10.213.19.142:8080 - 10.213.19.141:58346 TIME_WAIT, 10.213.19.142:40000 - 10.0.0.9:443 ESTABLISHED',
  );
  assert.equal(describeFlows(flows, 1), '10.213.19.142:8080 - 10.213.19.141:58346 TIME_WAIT and 1 more');
});
