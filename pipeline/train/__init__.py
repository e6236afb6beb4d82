"""Training one path for one round on DeepSpeed ZeRO: the process group and each rank's threads, the
engine and its precision, the packed data and the inner loop. Imports pipeline.core, pipeline.state
and pipeline.outer.compression (the format of the outer gradient a path job writes).
"""
