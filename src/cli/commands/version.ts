/**
 * `dormant version`: this CLI's version and the daemon's (from /v1/health), so a mismatch
 * after an upgrade is visible; and `dormant completion bash|zsh`, shell completion of the
 * commands and their flags, made from the program's own definitions so it cannot drift.
 */
import type { Command } from '@commander-js/extra-typings';
import { DormantError } from '../../domain/errors.js';
import { DORMANT_VERSION } from '../../domain/version.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

export function registerVersion(program: Command): void {
  program
    .command('version')
    .description("this CLI's version and the daemon's")
    .option('--json', 'print { client, server, url } as JSON (server: null when unreachable)')
    .action(async (o) => {
      const client = clientFromEnv();
      let server: string | null = null;
      let why: string | undefined;
      try {
        server = (await client.health({ signal: AbortSignal.timeout(5000) })).version;
      } catch (e) {
        why = e instanceof Error ? e.message : String(e);
      }
      if (o.json) {
        printJson({ client: DORMANT_VERSION, server, url: client.url });
        return;
      }
      process.stdout.write(`client: ${DORMANT_VERSION}\n`);
      process.stdout.write(
        server !== null
          ? `server: ${server} (${client.url})\n`
          : `server: unreachable at ${client.url}: ${why}\n`,
      );
    });

  program
    .command('completion')
    .description('shell completion for bash or zsh: eval "$(dormant completion bash)"')
    .argument('<shell>', 'bash or zsh')
    .action((shell) => {
      if (shell !== 'bash' && shell !== 'zsh') {
        throw new DormantError(
          'INVALID_ARGUMENT',
          `completion: unknown shell ${shell.slice(0, 20)} (bash or zsh)`,
        );
      }
      process.stdout.write(completionScript(program, shell));
    });
}

interface Words {
  /** `dormant` itself is '', a command `ls`, a subcommand `checkpoint ls`. */
  path: string;
  words: string[];
}

/** Every command path with what may follow it: its subcommands and flags. */
export function completionWords(program: Command): Words[] {
  const out: Words[] = [];
  const walk = (cmd: Command, path: string): void => {
    const subs = cmd.commands.filter((c) => !(c as unknown as { _hidden?: boolean })._hidden);
    const flags = cmd.options.filter((o) => !o.hidden).map((o) => o.long ?? o.short ?? '');
    out.push({ path, words: [...subs.map((c) => c.name()), ...flags.filter((f) => f !== ''), '--help'] });
    for (const c of subs) walk(c as unknown as Command, path === '' ? c.name() : `${path} ${c.name()}`);
  };
  walk(program, '');
  return out;
}

function completionScript(program: Command, shell: 'bash' | 'zsh'): string {
  // The case arms match the words typed so far that name commands (flags and their values
  // skipped), longest first, so `dormant checkpoint ls --` completes checkpoint ls's flags.
  const arms = completionWords(program)
    .sort((a, b) => b.path.length - a.path.length)
    .map((w) => `    "${w.path}") words="${w.words.join(' ')}" ;;`)
    .join('\n');
  const bash = `# dormant completion (bash). Made by \`dormant completion ${shell}\`.
_dormant_complete() {
  local cur=\${COMP_WORDS[COMP_CWORD]} path="" i w words=""
  for ((i = 1; i < COMP_CWORD; i++)); do
    w=\${COMP_WORDS[i]}
    case "$w" in -*) continue ;; esac
    case " $(_dormant_words "$path") " in *" $w "*) path="\${path:+$path }$w" ;; esac
  done
  COMPREPLY=($(compgen -W "$(_dormant_words "$path")" -- "$cur"))
}
_dormant_words() {
  local words=""
  case "$1" in
${arms}
  esac
  printf '%s' "$words"
}
complete -F _dormant_complete dormant
`;
  if (shell === 'bash') return bash;
  return `# dormant completion (zsh), through zsh's bash completion support.
autoload -U +X bashcompinit && bashcompinit
${bash}`;
}
