"""Islands: long-lived DeepSpeed launches that pull train, merge, commit and eval tasks from a
lease-based queue in the run root, the supervisor that starts and restarts them for `dipaco run`,
one-shot path launches, and how `train.max_attempts` is counted for all of them (attempts).
Imports the layers below it (core, state, train, outer, evaluation), never tracking.
"""
