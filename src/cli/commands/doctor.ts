import type { Command } from '@commander-js/extra-typings';

export function registerDoctor(program: Command): void {
  program
    .command('doctor')
    .description("this node's capability matrix for pause/resume")
    .option('--json', 'print one JSON value')
    .action(() => {
      throw new Error('doctor: not yet built');
    });
}
