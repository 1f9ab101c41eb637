/**
 * Imported first by the daemon's entry points (the CLI, the benchmarks), before anything uses
 * libuv's thread pool: it is sized once, when first used. Its default of 4 threads is too few
 * for a hibernate, where pack writes and their fdatasync (tens of ms each) hold threads while
 * the vault reads the CRIU images CRIU is still writing: reads queued behind syncs cost a 256 MiB
 * hibernate ~100 ms here. An operator's own UV_THREADPOOL_SIZE wins.
 */
process.env.UV_THREADPOOL_SIZE ??= '16';

export {};
