from distflow.config.loader import load_config, to_dict
from distflow.config.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "load_config", "to_dict"]
