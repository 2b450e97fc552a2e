"""The run's settings, one idea per module (importers take what they need from each):

    schema    the sections (dataclasses; each field's default and --help text), Config,
              RANGES and CHOICES (the allowed values)
    load      YAML + dotted `--set` overrides -> Config (load_config, build_config)
    checks    the checks: ranges and choices, the settings that depend on each other, paths
              (check_config, check_settings)
    help      `train.py --help`'s key list, built from the fields' metadata (config_help)

Every default lives in its dataclass, every allowed value in RANGES or CHOICES, and every
check that needs no world size in `checks.check_settings`; `training.optim.deepspeed_config`
writes batch sizes, precision, ZeRO stage, optimizer and clipping into the DeepSpeed config
dict. What follows from the checked config and the world size (layout, stage split, P and the
mask rates, schedules) is resolved once into a `training.plan.RunPlan`.
"""
