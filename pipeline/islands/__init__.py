"""Islands: long-lived DeepSpeed launches that pull train, merge, commit and eval tasks from a
lease-based queue in the run root, and one-shot path launches. Imports the layers below it
(core, state, train, outer, evaluation), never tracking.
"""
