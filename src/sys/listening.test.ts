import { test } from 'node:test';
import assert from 'node:assert/strict';
import { listeningPorts } from './listening.js';

test('listeningPorts reads the LISTEN sockets of /proc/net/tcp and tcp6, nothing else', () => {
  const tcp = [
    '  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode',
    '   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0',
    '   1: 0100007F:2382 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1',
  ].join('\n');
  const tcp6 = [
    '  sl  local_address                         remote_address                        st tx_queue rx_queue',
    '   0: 00000000000000000000000000000000:2382 00000000000000000000000000000000:0000 0A 00000000:00000000',
  ].join('\n');
  assert.deepEqual([...listeningPorts(tcp)], [8080]);
  assert.deepEqual([...listeningPorts(tcp6)], [9090]);
  assert.deepEqual([...listeningPorts('')], []);
});
