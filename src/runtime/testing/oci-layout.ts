/**
 * Test fixture: writes an OCI image layout (index.json, blobs) from folders, the way skopeo
 * or umoci would, so image tests need no registry. Layer 1 is gzip-compressed, later ones are
 * plain tar.
 */
import { createHash } from 'node:crypto';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';

async function putBlob(layout: string, data: Buffer): Promise<{ digest: string; size: number }> {
  const hex = createHash('sha256').update(data).digest('hex');
  await writeFile(join(layout, 'blobs', 'sha256', hex), data);
  return { digest: `sha256:${hex}`, size: data.length };
}

export async function writeOciLayout(
  layout: string,
  opts: { layers: string[]; config: Record<string, unknown>; tag: string },
): Promise<{ manifestDigest: string; layerDigests: string[] }> {
  await mkdir(join(layout, 'blobs', 'sha256'), { recursive: true });
  await writeFile(join(layout, 'oci-layout'), '{"imageLayoutVersion":"1.0.0"}');
  const layers: { mediaType: string; digest: string; size: number }[] = [];
  for (const [i, dir] of opts.layers.entries()) {
    const tmp = join(layout, `layer-${i}.tar`);
    await run('tar', ['--numeric-owner', '-cf', tmp, '-C', dir, '.'], { timeoutMs: 60_000 });
    let data = await readFile(tmp);
    await rm(tmp);
    let mediaType = 'application/vnd.oci.image.layer.v1.tar';
    if (i === 0) {
      data = (await import('node:zlib')).gzipSync(data);
      mediaType += '+gzip';
    }
    layers.push({ mediaType, ...(await putBlob(layout, data)) });
  }
  const config = await putBlob(
    layout,
    Buffer.from(JSON.stringify({ architecture: 'amd64', os: 'linux', ...opts.config })),
  );
  const manifest = Buffer.from(
    JSON.stringify({
      schemaVersion: 2,
      mediaType: 'application/vnd.oci.image.manifest.v1+json',
      config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...config },
      layers,
    }),
  );
  const m = await putBlob(layout, manifest);
  await writeFile(
    join(layout, 'index.json'),
    JSON.stringify({
      schemaVersion: 2,
      manifests: [
        {
          mediaType: 'application/vnd.oci.image.manifest.v1+json',
          ...m,
          annotations: { 'org.opencontainers.image.ref.name': opts.tag },
        },
      ],
    }),
  );
  return { manifestDigest: m.digest, layerDigests: layers.map((l) => l.digest) };
}
