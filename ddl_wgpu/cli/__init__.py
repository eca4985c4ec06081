"""The `ddl-wgpu` command line, a thin typer layer over the library (docs/commands.md).

app.py: the commands and the entry point; jobs.py: the long-running commands (train, resume, heal);
options.py: the options the commands share; checks.py: every option's range and every output checked before
work starts; console.py: what is printed (progress, tables); plots.py: the sweep's figures.
May import every layer.
"""


def main() -> None:
    """The console script `ddl-wgpu` (and `python -m ddl_wgpu.cli`): app.py sets its Ctrl-C handler first thing."""
    from ddl_wgpu.cli.app import main as run

    run()
