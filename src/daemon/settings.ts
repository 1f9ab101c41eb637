/**
 * The configuration's environment variables and `dormant serve` flags, each bound to one key
 * of the file (config.ts reads them; docs/CONFIG.md lists them).
 */

/** Read when it exists; `--config` or DORMANT_CONFIG name another (which then must exist). */
export const DEFAULT_CONFIG_FILE = '/etc/dormant/config.json';

/** Where a node keeps its state, vault and sandboxes unless configured otherwise. */
export const DEFAULT_DATA_DIR = '/var/lib/dormant';

export type Kind = 'string' | 'boolean' | 'duration' | 'size' | 'integer' | 'list' | 'paths';

export interface Setting {
  /** Dotted key in the file. */
  key: string;
  kind: Kind;
  env?: string;
  /** The `dormant serve` flag, as commander spells it (`--wake-timeout <duration>`). */
  flag?: string;
  /**
   * The value a boolean's own flag sets: `--log` true, `--stage-lazy-pages` false. A `--no-X`
   * flag needs none: commander gives its value (and serve adds the `--X` that undoes it).
   */
  flagSets?: boolean;
  help: string;
}

/** Every key that has a flag or an environment variable (the maps, policy per tenant and prices, are file-only). */
export const SETTINGS: readonly Setting[] = [
  {
    key: 'listen',
    kind: 'string',
    env: 'DORMANT_LISTEN',
    flag: '--listen <host:port>',
    help: 'where the API listens',
  },
  {
    key: 'dataDir',
    kind: 'string',
    env: 'DORMANT_DATA_DIR',
    flag: '--data-dir <dir>',
    help: 'state, vault and keys',
  },
  {
    key: 'masterKeyFile',
    kind: 'string',
    env: 'DORMANT_MASTER_KEY_FILE',
    flag: '--master-key-file <file>',
    help: "the vault's master key (default <data-dir>/master.key)",
  },
  {
    key: 'masterKeyCommand',
    kind: 'string',
    env: 'DORMANT_MASTER_KEY_COMMAND',
    help: 'a command (run with /bin/sh -c) that prints the master key; wins over masterKeyFile',
  },
  {
    key: 'log',
    kind: 'boolean',
    env: 'DORMANT_LOG',
    flag: '--log',
    flagSets: true,
    help: 'log every request to stderr',
  },
  {
    key: 'logLevel',
    kind: 'string',
    env: 'DORMANT_LOG_LEVEL',
    flag: '--log-level <level>',
    help: 'the least severe lines logged: debug, info, warn, error',
  },
  {
    key: 'logFormat',
    kind: 'string',
    env: 'DORMANT_LOG_FORMAT',
    flag: '--log-format <format>',
    help: 'json (one object a line), text, or auto: text on a terminal, json elsewhere',
  },
  {
    key: 'logFile',
    kind: 'string',
    env: 'DORMANT_LOG_FILE',
    flag: '--log-file <file>',
    help: 'write the log (JSON lines) to this file, mode 0600, instead of stderr; rotated by size',
  },
  {
    key: 'logMaxSize',
    kind: 'size',
    env: 'DORMANT_LOG_MAX_SIZE',
    flag: '--log-max-size <size>',
    help: 'rotate the log file past this size (0: never, for logrotate: SIGHUP reopens it)',
  },
  {
    key: 'logKeep',
    kind: 'integer',
    env: 'DORMANT_LOG_KEEP',
    flag: '--log-keep <n>',
    help: 'rotated log files kept (FILE.1 newest)',
  },
  {
    key: 'debug',
    kind: 'list',
    env: 'DORMANT_DEBUG',
    help: '`timings`: print each create, hibernate, resume and fork step by step to stderr',
  },
  {
    key: 'proxy.enabled',
    kind: 'boolean',
    env: 'DORMANT_PROXY',
    flag: '--no-proxy',
    help: 'run without the wake proxy',
  },
  {
    key: 'proxy.listen',
    kind: 'string',
    env: 'DORMANT_PROXY_LISTEN',
    flag: '--proxy-listen <host:port>',
    help: "the wake proxy's address (default: the API's port + 1)",
  },
  {
    key: 'proxy.domain',
    kind: 'string',
    env: 'DORMANT_PROXY_DOMAIN',
    flag: '--proxy-domain <domain>',
    help: 'sandbox URLs are PORT-ID.<domain>',
  },
  {
    key: 'proxy.wakeTimeout',
    kind: 'duration',
    env: 'DORMANT_PROXY_WAKE_TIMEOUT',
    flag: '--wake-timeout <duration>',
    help: 'how long a request is held while its sandbox wakes',
  },
  {
    key: 'proxy.tcp',
    kind: 'string',
    env: 'DORMANT_PROXY_TCP',
    flag: '--proxy-tcp <mode>',
    help: 'raw TCP listeners for sandbox ports: public (ports declared public), all, off',
  },
  {
    key: 'policy.enabled',
    kind: 'boolean',
    env: 'DORMANT_POLICY',
    flag: '--no-policy',
    help: 'run without the idle policy loop (sandboxes sleep only when told)',
  },
  {
    key: 'policy.interval',
    kind: 'duration',
    env: 'DORMANT_POLICY_INTERVAL',
    flag: '--policy-interval <duration>',
    help: 'time between passes of the idle policy loop',
  },
  {
    key: 'sandbox.allowedSourceRoots',
    kind: 'paths',
    env: 'DORMANT_ALLOWED_SOURCE_ROOTS',
    flag: '--allow-root <dir>',
    help: "tenants' root filesystems, images and archives may come from this folder (repeatable; without it tenant tokens name no host path, admin tokens any)",
  },
  {
    key: 'sandbox.seccompProfile',
    kind: 'string',
    env: 'DORMANT_SECCOMP_PROFILE',
    flag: '--seccomp-profile <file>',
    help: "every sandbox's seccomp profile (OCI linux.seccomp JSON)",
  },
  {
    key: 'sandbox.apparmorProfile',
    kind: 'string',
    env: 'DORMANT_APPARMOR_PROFILE',
    flag: '--apparmor-profile <name>',
    help: 'an AppArmor profile loaded on this host, for every sandbox',
  },
  {
    key: 'sandbox.userNamespace',
    kind: 'boolean',
    env: 'DORMANT_USER_NAMESPACE',
    flag: '--no-user-namespace',
    help: "new sandboxes without a user namespace (root inside is then the host's root; docs/SECURITY.md)",
  },
  {
    key: 'sandbox.diskQuota',
    kind: 'size',
    env: 'DORMANT_DISK_QUOTA',
    flag: '--disk <size>',
    help: "disk quota of a sandbox's writable layer when its create gives none (a sparse ext4 image per sandbox)",
  },
  {
    key: 'checkpoint.keep',
    kind: 'integer',
    env: 'DORMANT_KEEP_CHECKPOINTS',
    flag: '--keep-checkpoints <n>',
    help: 'committed checkpoints kept per sandbox (older ones are deleted)',
  },
  {
    key: 'checkpoint.timeout',
    kind: 'duration',
    env: 'DORMANT_CHECKPOINT_TIMEOUT',
    flag: '--checkpoint-timeout <duration>',
    help: "how long CRIU's dump may run before it is ended as hung",
  },
  {
    key: 'checkpoint.templateCache',
    kind: 'size',
    env: 'DORMANT_TEMPLATE_CACHE',
    flag: '--template-cache <size>',
    help: "templates' checkpoints kept decrypted in memory (the staging tmpfs) between creates, in all; 0 keeps none",
  },
  {
    key: 'restore.lazy',
    kind: 'boolean',
    env: 'DORMANT_LAZY_RESTORE',
    flag: '--no-lazy-restore',
    help: 'resume eagerly: every page in memory before the sandbox runs (default: CRIU lazy pages where userfaultfd works)',
  },
  {
    key: 'restore.pagesFromVault',
    kind: 'boolean',
    env: 'DORMANT_PAGES_FROM_VAULT',
    flag: '--stage-lazy-pages',
    flagSets: false,
    help: "lazy resume copies the page images to staging and CRIU's lazy-pages daemon reads them there, instead of dormant's page server reading them from the vault",
  },
  {
    key: 'restore.pagesFromVaultAbove',
    kind: 'size',
    env: 'DORMANT_PAGES_FROM_VAULT_ABOVE',
    flag: '--pages-from-vault-above <size>',
    help: 'only checkpoints bigger than this are served from the vault (0: all)',
  },
  {
    key: 'restore.timeout',
    kind: 'duration',
    env: 'DORMANT_RESTORE_TIMEOUT',
    flag: '--restore-timeout <duration>',
    help: "how long CRIU's restore may run before it is ended as hung",
  },
  {
    key: 'importLimits.maxBytes',
    kind: 'size',
    env: 'DORMANT_IMPORT_MAX_BYTES',
    flag: '--import-max-bytes <size>',
    help: 'most bytes an imported archive may unpack to',
  },
  {
    key: 'importLimits.maxMemberBytes',
    kind: 'size',
    env: 'DORMANT_IMPORT_MAX_MEMBER_BYTES',
    flag: '--import-max-member-bytes <size>',
    help: 'most bytes one member of an imported archive may unpack to',
  },
  {
    key: 'importLimits.maxEntries',
    kind: 'integer',
    env: 'DORMANT_IMPORT_MAX_ENTRIES',
    flag: '--import-max-entries <n>',
    help: 'most entries an imported archive may hold',
  },
  {
    key: 'api.bodyLimit',
    kind: 'size',
    env: 'DORMANT_API_BODY_LIMIT',
    flag: '--body-limit <size>',
    help: 'largest request body of every API route but exec',
  },
  {
    key: 'api.execBodyLimit',
    kind: 'size',
    env: 'DORMANT_API_EXEC_BODY_LIMIT',
    flag: '--exec-body-limit <size>',
    help: 'largest exec request body (its stdin rides in it)',
  },
  {
    key: 'api.maxUpload',
    kind: 'size',
    env: 'DORMANT_API_MAX_UPLOAD',
    flag: '--max-upload <size>',
    help: 'largest checkpoint archive a client may upload',
  },
  {
    key: 'e2b.listen',
    kind: 'string',
    env: 'DORMANT_E2B_LISTEN',
    flag: '--e2b-listen <host:port>',
    help: "the E2B front's address: E2B's SDK runs against it (docs/E2B.md); off when unset",
  },
  {
    key: 'meter.interval',
    kind: 'duration',
    env: 'DORMANT_METER_INTERVAL',
    flag: '--meter-interval <duration>',
    help: "how often the meter samples each sandbox's resource use",
  },
  {
    key: 'images.insecureRegistries',
    kind: 'list',
    env: 'DORMANT_INSECURE_REGISTRIES',
    help: 'registries (HOST or HOST:PORT, comma-separated) that may be reached over plain HTTP; loopback registries always may',
  },
  {
    key: 'images.pullTimeout',
    kind: 'duration',
    env: 'DORMANT_IMAGE_PULL_TIMEOUT',
    help: 'how long one registry pull may take',
  },
  {
    key: 'images.maxPullSize',
    kind: 'size',
    env: 'DORMANT_IMAGE_MAX_PULL_SIZE',
    help: 'most bytes the blobs of one pulled image may add up to',
  },
  {
    key: 'images.gcInterval',
    kind: 'duration',
    env: 'DORMANT_IMAGE_GC_INTERVAL',
    help: 'how often unpacked images and blobs no sandbox uses are removed (0: never)',
  },
  {
    key: 'state.url',
    kind: 'string',
    env: 'DORMANT_STATE',
    flag: '--state <url>',
    help: 'keep the database of record in PostgreSQL, postgres://USER[:PASSWORD]@HOST[:PORT]/DB, instead of <data-dir>/state.db (docs/STATE.md)',
  },
  {
    key: 'sandbox.subnet',
    kind: 'string',
    env: 'DORMANT_SUBNET',
    flag: '--subnet <cidr>',
    help: 'the IPv4 subnet sandboxes get their addresses from (default 10.213.0.0/16); give each node of a fleet across hosts its own',
  },
  {
    key: 'node.name',
    kind: 'string',
    env: 'DORMANT_NODE',
    flag: '--node <name>',
    help: "this node's name in a fleet (default the host name); needs the state in PostgreSQL (docs/FLEET.md)",
  },
  {
    key: 'node.url',
    kind: 'string',
    env: 'DORMANT_ADVERTISE',
    flag: '--advertise <url>',
    help: "where the other nodes reach this node's API, http://HOST:PORT (default: the address it listens on)",
  },
  {
    key: 'node.lease',
    kind: 'duration',
    env: 'DORMANT_NODE_LEASE',
    help: 'how long a node that stops renewing is trusted; past it, its sandboxes go back to their checkpoints',
  },
  {
    key: 'vault.url',
    kind: 'string',
    env: 'DORMANT_VAULT',
    flag: '--vault <url>',
    help: 'keep checkpoints in an S3-compatible bucket, s3://BUCKET[/PREFIX], instead of <data-dir>/vault (docs/VAULT.md)',
  },
  {
    key: 'vault.endpoint',
    kind: 'string',
    env: 'DORMANT_VAULT_ENDPOINT',
    help: "the S3 server's URL (http://127.0.0.1:7480 for RGW or MinIO); default: AWS's for the region",
  },
  {
    key: 'vault.region',
    kind: 'string',
    env: 'DORMANT_VAULT_REGION',
    help: "the bucket's region (default us-east-1)",
  },
  {
    key: 'vault.accessKeyId',
    kind: 'string',
    env: 'DORMANT_VAULT_ACCESS_KEY_ID',
    help: "the S3 access key id (default: the AWS SDK's credential chain: AWS_ACCESS_KEY_ID, profiles, instance roles)",
  },
  {
    key: 'vault.secretAccessKey',
    kind: 'string',
    env: 'DORMANT_VAULT_SECRET_ACCESS_KEY',
    help: 'the S3 secret key (prefer the variable or secretAccessKeyCommand to the file)',
  },
  {
    key: 'vault.secretAccessKeyCommand',
    kind: 'string',
    env: 'DORMANT_VAULT_SECRET_ACCESS_KEY_COMMAND',
    help: 'a command (run with /bin/sh -c) that prints the S3 secret key',
  },
  {
    key: 'vault.cacheSize',
    kind: 'size',
    env: 'DORMANT_VAULT_CACHE_SIZE',
    help: "local cache of an S3 vault's packs in <data-dir>/vault/cache (0: none)",
  },
  {
    key: 'vault.partSize',
    kind: 'size',
    env: 'DORMANT_VAULT_PART_SIZE',
    help: "an S3 vault's multipart upload part size (at least 5M)",
  },
];
