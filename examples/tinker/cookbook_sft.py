"""tinker-cookbook's supervised training loop (`tinker_cookbook.supervised.train.main`), from the command line.

0.5.8's own `python -m tinker_cookbook.supervised.train` stops at start-up ("Nested entrypoints must take a type
annotated argument"); this is the entry point it means, with every key of its `train.Config` on the command
line as chz reads them (docs/features/tinker.md#tinker-cookbook-recipes):

    .venv-cookbook/bin/python examples/tinker/cookbook_sft.py base_url=URL model_name=MODEL_DIR ...
"""

import asyncio

import chz
from tinker_cookbook.supervised import train

if __name__ == "__main__":
    asyncio.run(train.main(chz.entrypoint(train.Config)))
