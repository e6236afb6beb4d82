"""Build DeepSpeed's CPU communication op once, at install time, so no run or test pays for it."""

import logging
import time

from pipeline.train.distributed import init_distributed


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.time()
    init_distributed()
    logging.info("DeepSpeed runtime ready in %.1fs", time.time() - start)


if __name__ == "__main__":
    main()
