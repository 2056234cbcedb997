"""distflow: fully distributed RL post-training of LLMs (multi-controller).

    import distflow
    result = distflow.train("examples/arith_grpo.yaml", ["trainer.total_steps=20"], rewards=my_reward)

`train` is the engine of the `distflow train` command too (api.py); its errors are
`DistflowError`s: `ConfigError` (a user error) and `RunFailed` (a run that failed).
"""

__version__ = "0.1.0"
from distflow.api import RunResult, train
from distflow.config.loader import load_config, to_dict
from distflow.config.schema import Config, ConfigError
from distflow.errors import DistflowError, RunFailed

__all__ = ["Config", "ConfigError", "DistflowError", "RunFailed", "RunResult", "load_config", "to_dict", "train"]
