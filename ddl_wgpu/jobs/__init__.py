"""What a run is, not what a GPU is: each command's library function (docs/architecture.md).

train (+ train_config, checkpoint: a run's state on disk), sweep* (variants and seeds over workers and Ray),
run (the step loop every trainer hands over), rundir (an output folder claimed), heal (+ heal_files), accept,
generate, compress, trunk_eval (eval of a trunk too large to hold). May import backend, engine, ops, runtime,
files, data and errors; never the CLI.
"""
