"""The `routereplay` command line: one subcommand per module, dispatched by `main`.

Files:
- `arguments.py`      Argument groups shared by several subcommands, and the parsers (argparse types) of their
                      values
- `bench.py`          `routereplay bench SUITE`: measured figures (medians of repeated runs), as a table or
                      --json
- `console.py`        Where the CLI's rich tables and text go: a terminal at its own width, a pipe or file
                      never hard-wrapped
- `convert.py`        `routereplay convert IN OUT`: between engine payloads, .npy and the compact codec
- `demo.py`           `routereplay demo`: see the problem R3 solves, and the fix, on a laptop CPU
- `env.py`            `routereplay env`: versions and platform facts to paste into a bug report
- `extras.py`         Optional packages a command needs, checked before its work starts
- `failure.py`        How the CLI ends when something goes wrong: exit statuses, one-line messages, and hints
- `inspect.py`        `routereplay inspect FILE`: shape, experts, layers, coverage, expert load and validation
                      verdict
- `main.py`           `routereplay` entry point: builds the parser from one module per subcommand and
                      dispatches
- `outputs.py`        Output paths of the CLI: checked before the work starts, written whole at the end
- `progress.py`       Progress of long CLI work on stderr: rich bars on a terminal, plain rate-limited lines
                      elsewhere
- `step_tables.py`    The tables `routereplay train` prints: one row per GRPO step, synchronous or fully-async
- `threads.py`        The `--threads N` option of the commands that run torch on the CPU (demo, train, every
                      bench suite)
- `train.py`          `routereplay train`: GRPO on the demo task with router replay off, R2 or R3
"""
