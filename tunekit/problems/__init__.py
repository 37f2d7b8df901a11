"""What to tune: model specs (``models``), per-token problems (``shapes``) and what each op is (``opspec``).

Data and arithmetic only; importing this package imports neither torch nor optuna.
"""
