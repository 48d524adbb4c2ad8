"""Experiment files (one per phase, `get_config(arg)`) and the layouts they share."""
