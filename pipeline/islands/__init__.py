"""Islands: long-lived DeepSpeed launches that pull train, merge, commit and eval tasks from a
lease-based queue in the run root, the supervisor that starts and restarts them for `dipaco run`,
one-shot path launches, how `train.max_attempts` is counted for all of them (attempts), and, on
an object store, a train task's reads of its published peers' files while it publishes (peers).
Imports the layers below it (core, state, routing, train, outer, evaluation), never tracking nor
the Beam app: a reroute task's Beam job is handed to the island by its entry point
(pipeline.island_rank) or by the stages.
"""
