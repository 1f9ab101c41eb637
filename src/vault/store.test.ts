import { after, before } from 'node:test';
import { LocalDirStore } from './store.js';
import { removeDir, shmDir } from './testing/fixtures.js';
import { storeContract } from './testing/store-contract.js';

let dir: string;
before(async () => {
  dir = await shmDir('store');
});
after(async () => {
  await removeDir(dir);
});
storeContract('LocalDirStore', async () => new LocalDirStore(dir));
