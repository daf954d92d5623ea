"""Extension examples: each new component is one class plus one YAML file, with no edit to shared
code (issue 19). ``tests/test_contracts.py`` composes them into the project's own Hydra configs
(``hydra.searchpath`` adds ``tests/examples/configs``) and runs the same contract checks as the
built-in implementations.

* a world model: ``constant_wm.py`` + ``configs/worldmodel/constant.yaml``;
* a task: ``lift_high_task.py`` + ``configs/suite/lift_high.yaml`` (a suite listing it).
"""
