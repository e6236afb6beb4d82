"""Islands: long-lived DeepSpeed launches that pull train, merge, commit and eval tasks from a
lease-based queue in the run root, and one-shot path launches. Imports the layers below it
(core, state, routing, train, outer, evaluation), never tracking nor the Beam app: a reroute task's
Beam job is handed to the island by its entry point (pipeline.island_rank).
"""
