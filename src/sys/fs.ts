/** Small file-system questions shared by the layers above. */
import { stat } from 'node:fs/promises';
import { errnoCode } from '../domain/errors.js';

/** Whether `path` exists (following links); errors other than ENOENT are thrown. */
export async function exists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return false;
    throw e;
  }
}
